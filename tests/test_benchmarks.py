"""The benchmark suite's own machinery: the flash-attn CPU shim, the byte counter, task coalescing, reports.

A benchmark that measures the wrong thing is worse than none: the shim must compute exact attention
(the peers' numbers rest on it), the byte counter must agree with ds_seqpar's own accounting, and
the ring engine must issue one kernel call where the mask allows it.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

import ds_seqpar
from benchmarks import measure, peers
from benchmarks.report import attention_markdown
from benchmarks.run import score_attention_rows
from benchmarks.suites.attention import REFERENCE_NO_COMM, REFERENCE_ONE_PROCESS
from ds_seqpar import SeqParMesh
from ds_seqpar.layout import ring_layout
from ds_seqpar.ops.attention.reference import dense_attention_reference
from ds_seqpar.ops.masks import BlockKind, MaskSpec
from ds_seqpar.parallel.ring import RingPlan, build_schedule
from ds_seqpar.parallel.ring.plan import query_meta, step_tasks


@pytest.fixture(scope="module")
def shim():
    if str(peers.SHIM) not in sys.path:
        sys.path.insert(0, str(peers.SHIM))
    from flash_attn import flash_attn_interface

    return flash_attn_interface


@pytest.mark.parametrize(("h", "h_kv", "causal"), [(4, 4, True), (4, 2, True), (4, 1, False)])
def test_flash_shim_matches_reference(shim, h: int, h_kv: int, causal: bool) -> None:
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 48, h, 16, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 48, h_kv, 16, generator=g, dtype=torch.float64) for _ in range(2))
    out, lse, _, _ = shim._flash_attn_forward(q, k, v, 0.0, 0.25, causal)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    shim._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.25, causal)

    q_r, k_r, v_r = (x.clone().requires_grad_() for x in (q, k, v))
    mask = torch.ones(48, 48, dtype=torch.bool).tril() if causal else None
    ref_out, ref_lse = dense_attention_reference(q_r, k_r, v_r, mask, scale=0.25)
    ref_out.backward(dout)
    for got, want in ((out, ref_out), (lse, ref_lse), (dq, q_r.grad), (dk, k_r.grad), (dv, v_r.grad)):
        assert torch.allclose(got.double(), want.double(), atol=1e-10), (got - want).abs().max()


def test_flash_shim_refuses_what_it_does_not_serve(shim) -> None:
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(NotImplementedError, match="dropout_p=0"):
        shim._flash_attn_forward(q, q, q, 0.1, 0.5, True)
    with pytest.raises(NotImplementedError, match="alibi"):
        shim._flash_attn_forward(q, q, q, 0.0, 0.5, True, alibi_slopes=torch.ones(2))


@pytest.mark.parametrize(("sq", "sk", "window"), [(6, 10, (-1, -1)), (10, 10, (3, 0)), (4, 9, (2, 1))])
def test_flash_shim_aligns_causality_and_windows_bottom_right(shim, sq, sk, window) -> None:
    """flash-attn's convention: key j visible to query i iff i + sk - sq - left <= j <= i + sk - sq + right
    (causal: right = 0); the shim must match it for rectangular blocks, windows and the varlen pair."""
    g = torch.Generator().manual_seed(sq * sk)
    q = torch.randn(1, sq, 2, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, sk, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    causal = window == (-1, -1)
    i, j = torch.arange(sq)[:, None] + sk - sq, torch.arange(sk)[None, :]
    left, right = (-1, 0) if causal else window
    visible = (j <= i + right) & ((j >= i - left) if left >= 0 else True)
    want, _ = dense_attention_reference(q, k, v, visible, 0.5)
    out, lse, _, _ = shim._flash_attn_forward(q, k, v, 0.0, 0.5, causal, *window)
    assert (out - want).abs().max() <= 1e-12
    packed = [torch.cat([x[0], x[0]]) for x in (q, k, v)]  # two copies as two varlen sequences
    cu_q, cu_k = torch.tensor([0, sq, 2 * sq]), torch.tensor([0, sk, 2 * sk])
    out2, lse2, _, _ = shim._flash_attn_varlen_forward(*packed, cu_q, cu_k, sq, sk, 0.0, 0.5, causal, *window)
    assert (out2 - torch.cat([want[0], want[0]])).abs().max() <= 1e-12
    assert lse2.shape == (2, 2 * sq) and torch.equal(lse2[:, :sq], lse[0])


def sent_bytes_vs_comm_stats(u: int) -> tuple[int, int]:
    world = torch.distributed.get_world_size()
    mesh = SeqParMesh.from_config({"size": world, "ulysses_degree": u, "ring": {"layout": "zigzag"}})
    q, k, v = (torch.randn(1, 16, 4, 8, requires_grad=True) for _ in range(3))
    ds_seqpar.attention(q, k, v, mesh=mesh)  # the ranks' one-time shape agreement (not an exchange of data)
    with measure.SentBytes() as sent, mesh.comm_stats.measure() as region:
        ds_seqpar.attention(q, k, v, mesh=mesh).sum().backward()
    return sent.total, region.total_bytes


@pytest.mark.parametrize("u", [1, 2, 4])
def test_sent_bytes_agree_with_comm_stats(dist_pool, u: int) -> None:
    """The generic counter (used for every peer row) counts exactly what ds_seqpar records itself."""
    for counted, recorded in dist_pool(4).run(sent_bytes_vs_comm_stats, u):
        assert counted == recorded > 0


def zigzag_calls_per_step() -> list[list[str]]:
    world = torch.distributed.get_world_size()
    mesh = SeqParMesh.build(world, 1)
    plan = RingPlan(build_schedule(mesh), ring_layout("zigzag", world), MaskSpec(causal=True))
    q_pos, q_doc = query_meta(plan, 64, torch.device("cpu"))
    return [[t.kind.value for t in step_tasks(plan, 64, owner, q_pos, q_doc)] for owner in range(world)]


def test_zigzag_runs_one_kernel_call_per_step(dist_pool) -> None:
    """Own block: one top-left causal call; every other block: one FULL rectangle (no masks)."""
    for rank, kinds in enumerate(dist_pool(4).run(zigzag_calls_per_step)):
        for owner, calls in enumerate(kinds):
            want = BlockKind.CAUSAL.value if owner == rank else BlockKind.FULL.value
            assert calls == [want], (rank, owner, calls)


def test_attention_report_lists_rows_and_what_could_not_run() -> None:
    ok = {
        "P": 2,
        "H_kv": 8,
        "S": 4096,
        "status": "ok",
        "time_s": 0.5,
        "efficiency": 0.9,
        "sent_MiB": 8.0,
        "balance": 1.0,
        "peak_MiB": 10.0,
        "max_abs_err": 0.01,
        "system": "ds_seqpar auto",
        "peer": "ds_seqpar",
    }
    bad = {
        "P": 2,
        "H_kv": 2,
        "S": 4096,
        "status": "unsupported",
        "why": "H_kv=2 < U=4",
        "system": "x",
        "peer": "x",
    }
    meta = {
        "dtype": "bf16",
        "machine": {"cores": 2, "cpu": "cpu", "torch": "2"},
        "reps": 3,
        "T_single_s": {"P=2 S=4096 H_kv=8": 0.9},
    }
    text = attention_markdown({"meta": meta, "rows": [ok, bad]})
    assert "| 2 | 8 | 4096 | ds_seqpar auto | 0.500 | 0.900 | – |" in text
    assert "- **x** (P=2, H_kv=2): unsupported: H_kv=2 < U=4" in text


def test_attention_rows_are_scored_against_the_references_of_their_own_case() -> None:
    def row(system: str, peer: str, time_s: float, seq_len: int = 4096) -> dict:
        return {
            "P": 4,
            "H_kv": 8,
            "S": seq_len,
            "status": "ok",
            "system": system,
            "peer": peer,
            "time_s": time_s,
        }

    rows = [
        row("ds_seqpar auto", "ds_seqpar", 0.5),
        row("deepspeed DistributedAttention", "deepspeed", 0.4),
        row("yunchang ulysses 4x1", "yunchang", 0.6),
        row(REFERENCE_ONE_PROCESS, "reference", 0.8),
        row(REFERENCE_NO_COMM, "reference", 0.45),
        row(REFERENCE_ONE_PROCESS, "reference", 99.0, seq_len=16384),  # another case: never used here
        row("ds_seqpar auto", "ds_seqpar", 5.0, seq_len=16384),  # its case lacks a reference: not scored
        {"P": 4, "H_kv": 8, "S": 4096, "status": "failed", "system": "x", "peer": "x", "why": "boom"},
    ]
    refs = score_attention_rows(rows, cores=2)
    ours, ds, one, no_comm = rows[0], rows[1], rows[3], rows[4]
    assert refs[(4, 4096, 8, None, REFERENCE_ONE_PROCESS)] == 0.8
    assert ours["T_limit_s"] == pytest.approx(0.4)  # T_single / min(P, cores) = 0.8 / 2
    assert ours["efficiency"] == pytest.approx(0.8) and ds["efficiency"] == pytest.approx(1.0)
    assert ours["vs_ceiling"] == pytest.approx(0.9) and no_comm["efficiency"] == pytest.approx(0.4 / 0.45)
    assert ours["vs_fastest_peer"] == pytest.approx(1.25)  # references are not peers
    assert "vs_fastest_peer" not in one and "efficiency" not in rows[-1] and "efficiency" not in rows[-2]
    # packed-documents rows are their own cases: the dense references and peers never score them
    packed = [dict(row("ds_seqpar auto", "ds_seqpar", 0.2), docs="16 documents"),
              dict(row("ring-flash-attn llama3 varlen", "ring-flash-attn", 0.25), docs="16 documents"),
              dict(row(REFERENCE_NO_COMM, "reference", 0.1), docs="16 documents"),
              dict(row(REFERENCE_ONE_PROCESS, "reference", 0.2), docs="16 documents")]  # fmt: skip
    score_attention_rows(rows + packed, cores=2)
    assert packed[0]["vs_fastest_peer"] == pytest.approx(0.8) and packed[0]["vs_ceiling"] == pytest.approx(
        0.5
    )


def gpu_check_dry_run(out_dir: str) -> int:
    from benchmarks.gpu_check import main

    return main(["--dry-run", "--out", out_dir])


def test_gpu_check_dry_run_runs_every_code_path(dist_pool, tmp_path):
    """benchmarks/gpu_check.py on CPU: the CUDA kernel calls on meta tensors, the engine at tiny sizes."""
    assert dist_pool(1).run(gpu_check_dry_run, str(tmp_path)) == [0]
    text = (tmp_path / "gpu_check.md").read_text()
    assert "| cuda_sdpa | partial | torch.bfloat16 | 2 | 64 |" in text and "ds_seqpar P=1" in text
    assert "| packed documents | sdpa | torch.float32 |" in text and "| sliding window |" in text
    if importlib.util.find_spec("triton") is not None:  # the Triton sparse kernel under its interpreter
        assert "| triton | window+docs+softcap | torch.float32 |" in text
    assert "| delta | kda | float32 | PyTorch |" in text and "| linear | token | float32 | PyTorch |" in text
    assert "| False |" not in text


def logprob_memory_rows() -> list[dict]:
    from benchmarks.logprob_memory import run

    world = torch.distributed.get_world_size()
    mesh = SeqParMesh.from_config({"size": world, "ulysses_degree": 2})
    return run(mesh, ((4000, (128, 256), (8,), 64),), width=16)


def test_logprob_memory_peak_grows_with_the_chunk_not_the_shard(dist_pool) -> None:
    """benchmarks/logprob_memory.py at tiny sizes (V 4000, E 16, c 8, n 32 and 64): the unchunked pass holds
    three ``[n, V]`` fp32 tensors at its peak, so it grows by three times ``[n, V]``'s growth; the chunked one
    grows by the layers' activations only (below the training forward's growth)."""
    small, large = dist_pool(4).run(logprob_memory_rows)[0]
    for r in (small, large):
        assert 3 * r["logits_n_MiB"] <= r["unchunked_MiB"], r
        bound = 3 * r["logits_c8_MiB"] + 3 * r["head_grad_MiB"] + r["train_forward_MiB"]
        assert r["logprobs_c8_MiB"] < min(r["unchunked_MiB"], bound), r
    grown = {k: large[k] - small[k] for k in ("unchunked_MiB", "logprobs_c8_MiB", "logits_n_MiB")}
    assert grown["unchunked_MiB"] >= 3 * grown["logits_n_MiB"], grown
    assert grown["logprobs_c8_MiB"] < grown["logits_n_MiB"], grown
