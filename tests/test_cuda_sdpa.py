"""The ``cuda_sdpa`` kernel without a GPU.

1. Meta tensors: PyTorch's fused CUDA ops have meta kernels, so every call the kernel makes is
   checked for argument order, shapes and dtypes, and its results for the engine's layout
   (out ``[B, Sq, H, D]`` in q's dtype, lse ``[B, H, Sq]`` fp32, gradients in the K/V layout), for
   FULL, CAUSAL and PARTIAL blocks, GQA, D in {40, 64, 128}, fp16 / bf16 / fp32.
2. CPU stand-ins of the two op pairs (same schemas, dense float64 math, the efficient op's padded lse)
   replace ``torch.ops.aten`` for the kernel module: forward, lse and every gradient then equal the
   fp64 reference, which checks GQA head repetition and group sums, the additive bias, lse slicing and
   padding, and rows that see no key. The vendor arithmetic itself is checked by benchmarks/gpu_check.py.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from ds_seqpar.ops.attention import KERNELS, available_kernels, cuda_sdpa
from ds_seqpar.ops.attention.reference import dense_attention_reference

KINDS = ("full", "causal", "partial")


def _mask(kind: str, b: int, sq: int, sk: int, device: str) -> torch.Tensor | None:
    if kind != "partial":
        return None
    g = torch.Generator().manual_seed(sq * 7 + sk)
    mask = torch.rand(b, sq, sk, generator=g) < 0.6
    mask[:, 0] = False  # a row that sees no key
    return mask.to(device)


@pytest.mark.parametrize(
    ("kind", "d", "dtype", "h_kv"),
    list(itertools.product(KINDS, (40, 64, 128), (torch.float16, torch.bfloat16, torch.float32), (4, 1))),
)
def test_meta_calls_have_the_engine_layout(kind, d, dtype, h_kv):
    b, h, sq = 2, 4, 37
    sk = sq if kind == "causal" else 29
    q = torch.empty(b, sq, h, d, device="meta", dtype=dtype)
    k = torch.empty(b, sk, h_kv, d, device="meta", dtype=dtype)
    mask = _mask(kind, b, sq, sk, "meta")
    from ds_seqpar.ops.attention import Alibi

    alibi = Alibi(
        torch.empty(h, device="meta"), torch.arange(sq, device="meta"), torch.arange(sk, device="meta")
    )
    for bias in ({}, {"alibi": alibi}):  # ALiBi: the efficient op in float32 with a per-head bias
        out, lse = cuda_sdpa.forward(q, k, k, 0.125, mask, kind == "causal", **bias)
        assert (out.shape, out.dtype) == ((b, sq, h, d), dtype)
        assert (lse.shape, lse.dtype) == ((b, h, sq), torch.float32)
        dout = torch.empty(b, sq, h, d, device="meta", dtype=torch.float32)
        dq, dk, dv = cuda_sdpa.backward(
            dout, q, k, k, out.float(), lse, 0.125, mask, kind == "causal", **bias
        )
        assert (dq.shape, dq.dtype) == ((b, sq, h, d), dtype)
        assert dk.shape == dv.shape == (b, sk, h_kv, d) and dk.dtype == dtype


def test_flash_op_for_unmasked_half_precision_else_efficient():
    q16 = torch.empty(1, 8, 2, 64, device="meta", dtype=torch.bfloat16)
    assert cuda_sdpa.use_flash(q16, None)
    assert not cuda_sdpa.use_flash(q16, torch.ones(1, 8, 8, dtype=torch.bool, device="meta"))
    assert not cuda_sdpa.use_flash(q16.float(), None)
    assert cuda_sdpa.use_flash(q16, None, causal=True, sk=8)
    assert not cuda_sdpa.use_flash(q16, None, causal=True, sk=12)  # rectangular causal: top-left needed
    assert not cuda_sdpa.use_flash(
        torch.empty(1, 8, 2, 40, device="meta", dtype=torch.float16)[..., :36], None
    )


def test_kernels_without_softcap_never_drop_it():
    """Called directly (past the dispatcher, which never passes them one), they raise instead of ignoring it."""
    q = torch.zeros(1, 4, 2, 8)
    for kernel in (KERNELS["cuda_sdpa"], KERNELS["sdpa"]):
        with pytest.raises(ValueError, match=r"cannot apply softcap=2.0"):
            kernel.forward(q, q, q, 0.5, None, False, 2.0)
        with pytest.raises(ValueError, match=r"cannot apply softcap=2.0"):
            kernel.backward(q, q, q, q, q, q[:, :, :, 0].transpose(1, 2), 0.5, None, False, 2.0)


def test_registry_and_availability():
    assert list(KERNELS) == ["flash_attn", "cuda_sdpa", "sdpa", "torch"]
    assert not KERNELS["cuda_sdpa"].softcap
    assert "cuda_sdpa" not in available_kernels("cpu", torch.float32)
    assert "needs CUDA" in cuda_sdpa.unavailable(torch.device("cpu"), torch.float32)
    assert "float64" in cuda_sdpa.unavailable(torch.device("cuda"), torch.float64)


# ---------------------------------------------------------------------------------------------
# CPU stand-ins of the fused ops (same schemas as torch.ops.aten's), dense float64 math


def _scores(q, k, scale, bias, causal):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.double()
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    return s


def _fwd(q, k, v, scale, bias, causal):
    s = _scores(q, k, scale, bias, causal)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.nan_to_num(neginf=0.0).unsqueeze(-1))
    return (p @ v.double()).to(q.dtype), lse.float()


def _bwd(do, q, k, v, bias, out, lse, scale, causal):
    s = _scores(q, k, scale, bias, causal)
    p = torch.exp(s - lse.double().unsqueeze(-1))
    do, out = do.double(), out.double()
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ v.double().transpose(-1, -2) - (do * out).sum(-1, keepdim=True))
    return (
        (ds @ k.double() * scale).to(q.dtype),
        (ds.transpose(-1, -2) @ q.double() * scale).to(q.dtype),
        dv.to(q.dtype),
    )


def _flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    out, lse = _fwd(q, k, v, scale, None, is_causal)
    return out, lse, None, None, q.shape[2], k.shape[2], torch.zeros(2), torch.zeros(()), torch.empty(0)


def _flash_bwd(do, q, k, v, out, lse, cq, ck, mq, mk, p, is_causal, seed, offset, *, scale=None):
    assert lse.shape == q.shape[:3] and (mq, mk) == (q.shape[2], k.shape[2])
    return _bwd(do, q, k, v, None, out, lse, scale, is_causal)


EFFICIENT_DTYPES: list[
    torch.dtype
] = []  # the dtype of every efficient-op call the stand-ins served (a test clears it)


def _check_bias(q, k, bias):
    """The real op checks every size of the bias, the batch too (an H200 refused a [1, H, Sq, Sk] bias for B = 2)."""
    if bias is not None:
        assert bias.shape == (*q.shape[:3], k.shape[2]), "attn_bias: wrong shape"
        assert bias.stride(-1) == 1 and bias.stride(-2) % cuda_sdpa.BIAS_ALIGN == 0
        assert bias.shape[0] == 1 or bias.stride(0) != 0  # batch rows written, not a stride-0 expand


def _efficient(q, k, v, bias, compute_lse, dropout_p=0.0, is_causal=False, *, scale=None):
    _check_bias(q, k, bias)
    EFFICIENT_DTYPES.append(q.dtype)
    out, lse = _fwd(q, k, v, scale, bias, is_causal)
    padded = -(-q.shape[2] // 32) * 32
    return out, torch.nn.functional.pad(lse, (0, padded - q.shape[2]), value=math.inf), None, None


def _efficient_bwd(do, q, k, v, bias, out, lse, seed, offset, p, mask, is_causal=False, *, scale=None):
    assert lse.shape[-1] % 32 == 0 and lse.shape[-1] >= q.shape[2]
    _check_bias(q, k, bias)
    EFFICIENT_DTYPES.append(q.dtype)
    return (*_bwd(do, q, k, v, bias, out, lse[..., : q.shape[2]], scale, is_causal), None)


STAND_INS = SimpleNamespace(
    _scaled_dot_product_flash_attention=_flash,
    _scaled_dot_product_flash_attention_backward=_flash_bwd,
    _scaled_dot_product_efficient_attention=_efficient,
    _scaled_dot_product_efficient_attention_backward=_efficient_bwd,
)


@pytest.mark.parametrize(
    ("kind", "dtype", "h_kv"), list(itertools.product(KINDS, (torch.bfloat16, torch.float32), (4, 2)))
)
def test_plumbing_against_stand_ins_equals_reference(monkeypatch, kind, dtype, h_kv):
    monkeypatch.setattr(torch.ops, "aten", STAND_INS, raising=True)
    b, h, sq, d = 2, 4, 37, 16
    sk = sq if kind == "causal" else 29
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(b, s, n, d, generator=g, dtype=torch.float64)
        for s, n in ((sq, h), (sk, h_kv), (sk, h_kv))
    )
    dout = torch.randn(b, sq, h, d, generator=g, dtype=torch.float64)
    mask = _mask(kind, b, sq, sk, "cpu")
    ref_mask = torch.ones(sq, sk, dtype=torch.bool).tril() if kind == "causal" else mask
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = dense_attention_reference(*leaves, ref_mask, scale=0.3)
    ref.backward(dout)
    q_l, k_l, v_l = (t.to(dtype) for t in (q, k, v))
    out, lse = cuda_sdpa.forward(q_l, k_l, v_l, 0.3, mask, kind == "causal")
    finite = torch.where(torch.isinf(ref_lse), 0.0, ref_lse)
    grads = cuda_sdpa.backward(dout, q_l, k_l, v_l, ref.detach(), finite, 0.3, mask, kind == "causal")
    tol = 1e-6 if dtype == torch.float32 else 3e-2
    assert (out.double() - ref).abs().max() <= tol * 10
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert (lse.double() - ref_lse).nan_to_num(0.0).abs().max() <= tol * 10
    for got, want in zip(grads, leaves, strict=True):
        assert got.shape == want.shape
        assert (got.double() - want.grad).abs().max() <= tol * 10 * max(1.0, want.grad.abs().max().item())


@pytest.mark.parametrize(("sq", "sk"), [(64, 32), (257, 193), (64, 33)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_efficient_blocks_off_32_run_in_fp32(monkeypatch, sq, sk, dtype):
    """A mask shared by the batch (expanded to B in the bias) and the efficient op in half precision only
    on 32-aligned blocks: elsewhere in float32, results back in the input dtype."""
    monkeypatch.setattr(torch.ops, "aten", STAND_INS, raising=True)
    EFFICIENT_DTYPES.clear()
    b, h, d = 2, 4, 16
    g = torch.Generator().manual_seed(sq + sk)
    q = torch.randn(b, sq, h, d, generator=g).to(dtype)
    k, v = (torch.randn(b, sk, 2, d, generator=g).to(dtype) for _ in range(2))
    mask = (torch.rand(1, sq, sk, generator=g) < 0.6) | torch.eye(sq, sk, dtype=torch.bool)
    out, lse = cuda_sdpa.forward(q, k, v, 0.25, mask, False)
    dout = torch.randn(b, sq, h, d, generator=g)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = dense_attention_reference(*leaves, mask[0], scale=0.25)
    ref.backward(dout.double())
    grads = cuda_sdpa.backward(dout, q, k, v, ref.detach(), lse, 0.25, mask, False)
    aligned = sq % 32 == 0 and sk % 32 == 0
    served = list(EFFICIENT_DTYPES)
    assert served == [dtype if aligned else torch.float32] * 2
    assert cuda_sdpa.efficient_in_fp32(q, mask, False, sk) == (not aligned)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert [t.dtype for t in grads] == [dtype] * 3
    assert (out.double() - ref).abs().max() <= 3e-2 * ref.abs().max()
    for got, want in zip(grads, leaves, strict=True):
        assert (got.double() - want.grad).abs().max() <= 3e-2 * want.grad.abs().max()


@pytest.mark.parametrize(
    ("kind", "dtype", "h_kv"), list(itertools.product(KINDS, (torch.bfloat16, torch.float32), (4, 2)))
)
def test_alibi_against_stand_ins_equals_reference(monkeypatch, kind, dtype, h_kv):
    """ALiBi: every block on the efficient op in float32 with the per-head bias (causality folded in), also
    through the flash_attn kernel, whose ALiBi blocks all go to cuda_sdpa."""
    from ds_seqpar.ops.attention import Alibi, flash_attn_kernel

    monkeypatch.setattr(torch.ops, "aten", STAND_INS, raising=True)
    b, h, sq, d = 2, 4, 37, 16
    sk = sq if kind == "causal" else 29
    g = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(b, s, n, d, generator=g, dtype=torch.float64)
        for s, n in ((sq, h), (sk, h_kv), (sk, h_kv))
    )
    dout = torch.randn(b, sq, h, d, generator=g, dtype=torch.float64)
    mask = _mask(kind, b, sq, sk, "cpu")
    ref_mask = torch.ones(sq, sk, dtype=torch.bool).tril() if kind == "causal" else mask
    slopes, q_pos, k_pos = 2.0 ** -torch.arange(1.0, h + 1), torch.arange(sq) + 40, torch.arange(sk) * 3
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = dense_attention_reference(
        *leaves, ref_mask, scale=0.3, alibi=Alibi(slopes.double(), q_pos, k_pos)
    )
    ref.backward(dout)
    alibi, finite = Alibi(slopes, q_pos, k_pos), torch.where(torch.isinf(ref_lse), 0.0, ref_lse)
    q_l, k_l, v_l = (t.to(dtype) for t in (q, k, v))
    flash = flash_attn_kernel(cuda_sdpa.CUDA_SDPA, KERNELS["torch"], unavailable=lambda device, dtype: None)
    assert flash.alibi
    tol = 1e-5 if dtype == torch.float32 else 3e-1  # bf16 inputs rounded; the op runs in float32
    EFFICIENT_DTYPES.clear()
    for kern in (cuda_sdpa.CUDA_SDPA, flash):
        out, lse = kern.forward(q_l, k_l, v_l, 0.3, mask, kind == "causal", None, alibi=alibi)
        grads = kern.backward(
            dout, q_l, k_l, v_l, ref.detach(), finite, 0.3, mask, kind == "causal", None, alibi=alibi
        )
        assert out.dtype == dtype and torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        assert (out.double() - ref).abs().max() <= tol
        assert (lse.double() - ref_lse).nan_to_num(0.0).abs().max() <= tol
        for got, want in zip(grads, leaves, strict=True):
            assert got.shape == want.shape and got.dtype == dtype
            assert (got.double() - want.grad).abs().max() <= tol * max(1.0, want.grad.abs().max().item())
    assert set(EFFICIENT_DTYPES) == {torch.float32}  # every call: the efficient op, in float32
