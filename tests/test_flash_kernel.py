"""The ``flash_attn`` kernel without a GPU: flash-attn's block functions served by the CPU stand-in.

``benchmarks/peers/flash_attn_shim`` implements flash-attn 2.6's ``_flash_attn_forward`` /
``_flash_attn_backward`` and the varlen pair on CPU (PyTorch's CPU flash op; windows, softcap and
varlen on fp64 math). With it on ``sys.path`` the kernel (built with CPU fallbacks in place of
cuda_sdpa) runs every block kind through the same adapter code as on a GPU:

1. block level, fp64 against the torch kernel: FULL, square CAUSAL (flash-attn), rectangular causal,
   PARTIAL and odd head dims (fallback), softcap on both routes, GQA, D in {40, 64, 128};
2. the ring engine with packed documents on gloo ranks: per-document tasks run as ONE varlen call per
   run of documents, exact against the dense reference, forward and backward;
3. the version adapter: flash-attn 2.5 (``window_size`` tuple, 8-tuple result), 2.7 (in-place
   gradients), 3 (required ``None`` inputs) and unknown signatures (refused by name);
4. ``auto`` logs its choice once.
"""

from __future__ import annotations

import inspect
import logging
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from benchmarks import peers
from ds_seqpar.ops import attention, backends
from ds_seqpar.ops.attention import KERNELS, block_attn_backward, block_attn_forward, flash_attn_kernel
from ds_seqpar.ops.attention import flash as flash_kernel
from tests.helpers.cases import AttentionCase

TOL = 1e-10


def _cpu_flash() -> attention.AttentionKernel:
    """The flash_attn kernel with CPU fallbacks (sdpa for masks, torch with a softcap), any device."""
    return flash_attn_kernel(KERNELS["sdpa"], KERNELS["torch"], unavailable=lambda device, dtype: None)


def _use_shim() -> None:
    if str(peers.SHIM) not in sys.path:
        sys.path.insert(0, str(peers.SHIM))
    flash_kernel.flash_api.cache_clear()


@pytest.fixture
def shim(monkeypatch):
    monkeypatch.syspath_prepend(str(peers.SHIM))
    flash_kernel.flash_api.cache_clear()
    from flash_attn import flash_attn_interface

    yield flash_attn_interface
    flash_kernel.flash_api.cache_clear()


def _inputs(b, sq, sk, h, h_kv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(b, sq, h, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, sk, h_kv, d, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, dout


CASES = [  # (sq, sk, causal, masked, d, softcap, routed to flash-attn)
    (24, 40, False, False, 64, None, True),
    (32, 32, True, False, 40, None, True),
    (32, 32, True, False, 128, 3.0, True),
    (16, 40, True, False, 64, None, False),  # rectangular causal: top-left, fallback
    (24, 40, False, True, 64, None, False),  # PARTIAL: fallback (cuda_sdpa on a GPU)
    (24, 40, False, True, 64, 3.0, False),  # PARTIAL with softcap: torch kernel
    (24, 40, False, False, 36, None, False),  # D % 8 != 0: fallback
]


@pytest.mark.parametrize(("sq", "sk", "causal", "masked", "d", "softcap", "flash"), CASES)
@pytest.mark.parametrize("h_kv", [4, 1])
def test_blocks_match_the_torch_kernel(shim, sq, sk, causal, masked, d, softcap, flash, h_kv):
    q, k, v, dout = _inputs(2, sq, sk, 4, h_kv, d, seed=sq + d)
    mask = None
    if masked:
        mask = torch.rand(2, sq, sk, generator=torch.Generator().manual_seed(1)) < 0.5
        mask[:, 0] = False  # a row that sees no key
    kw = dict(scale=0.3, mask=mask, causal=causal, softcap=softcap)
    before = shim.PAIRS[0]
    got = block_attn_forward(q, k, v, kernel=_cpu_flash(), **kw)
    assert (shim.PAIRS[0] > before) == flash  # flash-attn served exactly the blocks it can take
    want = block_attn_forward(q, k, v, kernel="torch", **kw)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(torch.isfinite(g), torch.isfinite(w))
        assert (g - w).nan_to_num(posinf=0, neginf=0).abs().max().item() <= TOL
    out, lse = want
    grads = block_attn_backward(dout, q, k, v, out, lse, kernel=_cpu_flash(), **kw)
    ref = block_attn_backward(dout, q, k, v, out, lse, kernel="torch", **kw)
    for g, w in zip(grads, ref, strict=True):
        assert g.shape == w.shape and (g - w).abs().max().item() <= TOL


# ---------------------------------------------------------------------------------------------- engine


def run_varlen_cases(cases: list[AttentionCase]) -> list[dict]:
    """Ring attention (R = world) with packed documents on the CPU flash kernel; errors and call counts."""
    from ds_seqpar import SeqParMesh
    from ds_seqpar.layout import ring_layout
    from ds_seqpar.ops.attention.reference import dense_attention_reference
    from ds_seqpar.ops.masks import token_mask
    from ds_seqpar.parallel.ring import RingPlan, build_schedule, ring_attention

    _use_shim()
    from flash_attn import flash_attn_interface as fa

    world, me = dist.get_world_size(), dist.get_rank()
    mesh = SeqParMesh.build(world, 1)
    kernel = _cpu_flash()
    calls = {"varlen": 0, "band": 0}

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)

        return call

    kernel = attention.AttentionKernel(
        kernel.name, kernel.forward, kernel.backward, kernel.unavailable, kernel.softcap,
        attention.Varlen(counted("varlen", kernel.varlen.forward), kernel.varlen.backward, kernel.varlen.takes),
        attention.Band(counted("band", kernel.band.forward), kernel.band.backward, kernel.band.takes),
    )  # fmt: skip
    results = []
    for i, case in enumerate(cases):
        s = case.seq_len
        layout = ring_layout(case.layout, world)
        q, k, v, dout = _inputs(case.batch, s, s, 4, case.h_kv, 16, seed=i)
        docs, spec = case.doc_ids(), case.spec
        plan = RingPlan(build_schedule(mesh, "p2p"), layout, spec, docs, kernel)
        leaves = [layout.shard(t, me).clone().requires_grad_() for t in (q, k, v)]
        calls.update(varlen=0, band=0)
        out, _ = ring_attention(*leaves, plan)
        out.backward(layout.shard(dout, me))
        pos = torch.arange(s)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        mask = token_mask(pos, pos, spec) if docs is None else token_mask(pos, pos, spec, docs, docs)
        ref_out, _ = dense_attention_reference(*ref, mask)
        ref_out.backward(dout)
        got = [out.detach(), *(t.grad for t in leaves)]
        want = [ref_out.detach(), *(t.grad for t in ref)]
        err = max((a - layout.shard(b, me)).abs().max().item() for a, b in zip(got, want, strict=True))
        results.append({"err": err, **calls, "pairs": fa.PAIRS[0]})
    return results


def test_packed_documents_and_windows_run_as_varlen_and_band_calls(dist_pool):
    s = 96
    sixteen = tuple(range(0, s + 1, 6))
    base = AttentionCase(seq_len=s, layout="contiguous", batch=1)
    cases = [
        replace(base, h_kv=4, cu_seqlens=sixteen),
        replace(base, layout="zigzag", batch=2, h_kv=2, cu_seqlens=(0, 5, 30, 61, 90)),
        replace(base, batch=2, h_kv=1, cu_seqlens=sixteen, window=4),
        replace(base, h_kv=2, window=20),
        replace(base, layout="zigzag", batch=2, h_kv=4, window=7),
    ]
    results = dist_pool(2).run(run_varlen_cases, cases)
    for rank, per_rank in enumerate(results):
        for case, r in zip(cases, per_rank, strict=True):
            assert r["err"] <= TOL, (case, rank, r)
        # 16 documents of 6 tokens, 48 per rank: the own step's documents are one varlen call
        assert per_rank[0]["varlen"] >= 1, per_rank[0]
        # windows: the blocks they cut are bands, run through flash-attn's window_size without a mask
        assert all(r["band"] >= 1 for r in per_rank[2:]), per_rank


# ---------------------------------------------------------------------------------------------- versions


def _fake_api(forward, backward, version="2.6.3") -> flash_kernel.FlashApi:
    return flash_kernel.FlashApi(version, "fake", forward, backward, None, None)


def _reference_forward(q, k, v, softmax_scale, causal):
    out, lse = block_attn_forward(q, k, v, scale=softmax_scale, causal=causal, kernel="torch")
    return out.to(q.dtype), lse.float()


def test_flash_attn_2_5_window_tuple_and_eight_tuple_result(monkeypatch):
    seen = {}

    def forward(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
        seen["window"] = window_size
        out, lse = _reference_forward(q, k, v, softmax_scale, causal)
        return out, q, k, v, out, lse, None, None

    def backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
                 alibi_slopes, deterministic, rng_state=None):  # fmt: skip
        for buf in (dq, dk, dv):
            buf.fill_(1.0)

    monkeypatch.setattr(flash_kernel, "flash_api", lambda: _fake_api(forward, backward, "2.5.9"))
    q, k, v, dout = _inputs(1, 8, 8, 2, 2, 8)
    out, lse = flash_kernel.flash_forward(q, k, v, 0.5, True)
    assert seen["window"] == (-1, -1) and lse.shape == (1, 2, 8)
    assert torch.equal(out, _reference_forward(q, k, v, 0.5, True)[0])
    grads = flash_kernel.flash_backward(dout, q, k, v, out, lse, 0.5, True)
    assert all(bool((g == 1).all()) for g in grads)  # gradients read from the buffers it filled
    with pytest.raises(
        ValueError, match=r"flash-attn 2.5.9 cannot apply softcap=2.0 \(needs flash-attn >= 2.6\)"
    ):
        flash_kernel.flash_forward(q, k, v, 0.5, True, softcap=2.0)


def test_flash_attn_3_required_none_inputs(monkeypatch):
    seen = {}

    def forward(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q,
                seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos,
                rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, causal,
                window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, sm_margin=0):  # fmt: skip
        seen.update(out=out, k_new=k_new, softcap=softcap)
        out, lse = _reference_forward(q, k, v, softmax_scale, causal)
        return out, lse, None, None

    monkeypatch.setattr(flash_kernel, "flash_api", lambda: _fake_api(forward, forward, "3.0.0b1"))
    q, k, v, _ = _inputs(1, 8, 8, 2, 1, 8)
    _, lse = flash_kernel.flash_forward(q, k, v, 0.5, False, softcap=7.0)
    assert seen == {"out": None, "k_new": None, "softcap": 7.0}
    assert torch.equal(lse, _reference_forward(q, k, v, 0.5, False)[1])


def test_unknown_required_parameter_is_refused_by_name(monkeypatch):
    def forward(q, k, v, softmax_scale, causal, tile_scheduler):
        raise AssertionError("never called")

    monkeypatch.setattr(flash_kernel, "flash_api", lambda: _fake_api(forward, forward, "9.1"))
    q, k, v, _ = _inputs(1, 8, 8, 2, 2, 8)
    with pytest.raises(RuntimeError, match=r"flash-attn 9.1 .*required parameter 'tile_scheduler'"):
        flash_kernel.flash_forward(q, k, v, 0.5, False)


def test_unavailable_names_the_reason(shim, monkeypatch):
    assert "needs CUDA" in flash_kernel.flash_unavailable(torch.device("cpu"), torch.float16)
    monkeypatch.setattr(flash_kernel, "_installed_version", lambda package, module: "2.3.6")
    flash_kernel.flash_api.cache_clear()
    assert "needs flash-attn >= 2.5 (found 2.3.6)" in flash_kernel.flash_api()
    flash_kernel.flash_api.cache_clear()
    monkeypatch.undo()
    api = flash_kernel.flash_api()
    assert api.version == "2.6.3" and api.varlen_forward is not None
    assert "softcap" in inspect.signature(api.forward).parameters


def test_auto_logs_its_choice_once(caplog):
    backends._log_auto.cache_clear()
    with caplog.at_level(logging.INFO, logger="ds_seqpar"):
        for _ in range(3):
            attention.resolve_kernel("auto", "cpu", torch.float32)
        attention.resolve_kernel("auto", "cpu", torch.float32, softcap=2.0)
    lines = [r.getMessage() for r in caplog.records if "kernel 'auto' runs as" in r.getMessage()]
    assert lines == [
        "ds_seqpar: kernel 'auto' runs as 'sdpa' on cpu torch.float32 (set sequence_parallel.kernel to choose)",
        "ds_seqpar: kernel 'auto' runs as 'torch' on cpu torch.float32 with softcap (set sequence_parallel.kernel "
        "to choose)",
    ]


def test_registry_kernel_is_unavailable_on_cpu():
    kern = KERNELS["flash_attn"]
    assert kern.varlen is not None and kern.softcap
    assert kern.unavailable(torch.device("cpu"), torch.float16) is not None
