"""Single-device attention layer (ds_seqpar.ops): kernels, masks and merges vs the dense fp64 reference.

Every kernel runs the same cases: forward (out, lse) and all gradients (dq, dk, dv), causal and
not, GQA (H_kv = H, H/2, 1), packed documents with odd lengths and padding, sliding windows,
Sq != Sk and rows that see no key. Tolerances (max abs error vs fp64): fp64 1e-10, fp32 1e-5.
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ds_seqpar.ops import (
    AttentionKernel,
    BlockKind,
    MaskSpec,
    available_kernels,
    block_attn_backward,
    block_attn_forward,
    classify_block,
    dense_attention_reference,
    merge_attn,
    merge_attn_,
    resolve_kernel,
    token_mask,
    torch_chunked_kernel,
)

D = 16
B = 2
HAS_FLASH = torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


# ----------------------------------------------------------------------------------------------
# cases


@dataclass(frozen=True)
class KernelCase:
    kernel: str | AttentionKernel
    dtype: torch.dtype
    tol: float
    device: str = "cpu"


def _kernel_param(label: str, case: KernelCase, *, gpu: bool = False) -> object:
    marks = (
        [pytest.mark.gpu, pytest.mark.skipif(not HAS_FLASH, reason="needs CUDA and flash-attn")]
        if gpu
        else []
    )
    return pytest.param(case, id=label, marks=marks)


KERNEL_CASES = [
    _kernel_param("torch-fp64", KernelCase("torch", torch.float64, 1e-10)),
    _kernel_param("torch-fp32", KernelCase("torch", torch.float32, 1e-5)),
    _kernel_param("torch-bf16in", KernelCase("torch", torch.bfloat16, 1e-5)),
    _kernel_param("torch_chunk13-fp64", KernelCase(torch_chunked_kernel(13), torch.float64, 1e-10)),
    _kernel_param("torch_chunk13-fp32", KernelCase(torch_chunked_kernel(13), torch.float32, 1e-5)),
    _kernel_param("sdpa-fp64", KernelCase("sdpa", torch.float64, 1e-10)),
    _kernel_param("sdpa-fp32", KernelCase("sdpa", torch.float32, 1e-5)),
    # the CPU op computes bf16 natively (probabilities rounded to bf16 before P @ V, like flash-attn)
    _kernel_param("sdpa-bf16", KernelCase("sdpa", torch.bfloat16, 5e-2)),
    _kernel_param("flash_attn-bf16", KernelCase("flash_attn", torch.bfloat16, 5e-2, "cuda"), gpu=True),
]
HEADS = [pytest.param(h, hkv, id=f"H{h}-Hkv{hkv}") for h, hkv in [(4, 4), (4, 2), (4, 1), (3, 1)]]


def _docs(lengths: list[int], pad: int = 0) -> torch.Tensor:
    """Document ids for packed documents of ``lengths`` followed by ``pad`` padding tokens (-1)."""
    ids = [torch.full((n,), i) for i, n in enumerate(lengths)]
    return torch.cat([*ids, torch.full((pad,), -1)])


@dataclass(frozen=True)
class MaskCase:
    """A block: Sq queries x Sk keys, with an explicit mask (or None) or the ``causal`` flag."""

    sq: int
    sk: int
    mask: torch.Tensor | None = None
    causal: bool = False

    def dense_mask(self) -> torch.Tensor | None:
        if self.causal:
            return torch.ones(self.sq, self.sk, dtype=torch.bool).tril()
        return self.mask


def _mask_cases() -> dict[str, MaskCase]:
    gen = torch.Generator().manual_seed(7)
    rand = torch.rand(B, 40, 56, generator=gen) < 0.3
    rand[0, 5] = False  # a row that sees nothing
    rand[1, :, 9] = False  # a key nobody sees
    docs = _docs([5, 17, 1, 23], pad=2)  # odd lengths + padding rows/keys
    pos48, pos40 = torch.arange(48), torch.arange(40)
    batch_pos = torch.stack([pos48, pos48])
    batch_docs = torch.stack([_docs([11, 37]), _docs([30, 15], pad=3)])
    return {
        "full": MaskCase(40, 56),
        "causal_flag": MaskCase(48, 48, causal=True),
        "causal_flag_rect": MaskCase(40, 56, causal=True),
        "causal_offset": MaskCase(40, 56, token_mask(pos40 + 16, torch.arange(56))),
        "docs_odd_padded": MaskCase(48, 48, token_mask(pos48, pos48, MaskSpec(), docs, docs)),
        "window_causal": MaskCase(48, 48, token_mask(pos48, pos48, MaskSpec(window=7))),
        "window_noncausal": MaskCase(
            40, 56, token_mask(pos40 + 10, torch.arange(56), MaskSpec(causal=False, window=5))
        ),
        "batch_docs": MaskCase(48, 48, token_mask(batch_pos, batch_pos, MaskSpec(), batch_docs, batch_docs)),
        "random_empty_rows": MaskCase(40, 56, rand),
    }


MASK_CASES = _mask_cases()


def _inputs(
    sq: int, sk: int, h: int, hkv: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, sq, h, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, sk, hkv, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, sk, hkv, D, generator=gen, dtype=torch.float64)
    dout = torch.randn(B, sq, h, D, generator=gen, dtype=torch.float64)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v, dout))


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """fp64 (out, lse, dq, dk, dv) by autograd through the dense reference."""
    q64, k64, v64 = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
    out, lse = dense_attention_reference(q64, k64, v64, None if mask is None else mask.cpu())
    out.backward(dout.cpu().double())
    return out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def _max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs difference; -inf entries must match exactly."""
    got = got.detach().cpu().double()
    assert got.shape == want.shape
    assert not got.isnan().any()
    assert torch.equal(got == float("-inf"), want == float("-inf"))
    finite = want != float("-inf")
    return (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0


# ----------------------------------------------------------------------------------------------
# kernels vs dense reference


@pytest.mark.parametrize("case", KERNEL_CASES)
@pytest.mark.parametrize(("h", "hkv"), HEADS)
@pytest.mark.parametrize("mask_name", list(MASK_CASES))
def test_kernel_matches_dense_reference(case: KernelCase, h: int, hkv: int, mask_name: str) -> None:
    mc = MASK_CASES[mask_name]
    q, k, v, dout = _inputs(mc.sq, mc.sk, h, hkv, case.dtype, case.device)
    mask = None if mc.mask is None else mc.mask.to(case.device)
    kw = {"mask": mask, "causal": mc.causal, "kernel": case.kernel}

    out, lse = block_attn_forward(q, k, v, **kw)
    dq, dk, dv = block_attn_backward(dout, q, k, v, out, lse, **kw)

    acc = torch.float64 if case.dtype == torch.float64 else torch.float32
    assert out.dtype == lse.dtype == dq.dtype == dk.dtype == dv.dtype == acc
    want = _reference(q, k, v, dout, mc.dense_mask())
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), want):
        err = _max_err(got, ref)
        assert err <= case.tol, f"{name}: max abs error {err:.3g} > {case.tol}"


@pytest.mark.parametrize("case", KERNEL_CASES)
@pytest.mark.parametrize("mask_name", ["causal_offset", "docs_odd_padded", "random_empty_rows"])
def test_key_blocks_merge_and_backward_with_final_lse(case: KernelCase, mask_name: str) -> None:
    """The ring contract: per-key-block forwards merge to the full result, and per-block backwards
    fed the FINAL out/lse sum (dq) / concatenate (dk, dv) to the full gradients."""
    mc = MASK_CASES[mask_name]
    q, k, v, dout = _inputs(mc.sq, mc.sk, 4, 2, case.dtype, case.device, seed=1)
    mask = mc.mask.to(case.device)
    bounds = [0, 9, 10, 31, mc.sk]  # uneven blocks, one of a single key
    blocks = [(a, b, mask[..., a:b]) for a, b in itertools.pairwise(bounds)]

    out, lse = block_attn_forward(q, k[:, :0], v[:, :0], kernel=case.kernel)  # start from "saw nothing"
    for a, b, m in blocks:
        out, lse = merge_attn(
            out, lse, *block_attn_forward(q, k[:, a:b], v[:, a:b], mask=m, kernel=case.kernel)
        )
    dq = torch.zeros_like(out)
    dks, dvs = [], []
    for a, b, m in blocks:
        g = block_attn_backward(dout, q, k[:, a:b], v[:, a:b], out, lse, mask=m, kernel=case.kernel)
        dq += g[0]
        dks.append(g[1])
        dvs.append(g[2])

    want = _reference(q, k, v, dout, mask)
    for name, got, ref in zip(
        ("out", "lse", "dq", "dk", "dv"), (out, lse, dq, torch.cat(dks, 1), torch.cat(dvs, 1)), want
    ):
        err = _max_err(got, ref)
        assert err <= case.tol, f"{name}: max abs error {err:.3g} > {case.tol}"


@pytest.mark.parametrize("kernel", ["torch", "sdpa"])
@pytest.mark.parametrize(("sq", "sk"), [(0, 5), (5, 0), (0, 0)])
def test_zero_length_blocks(kernel: str, sq: int, sk: int) -> None:
    """Empty blocks never reach the kernel (the CPU flash op crashes the process on them)."""
    q, k, v, dout = _inputs(sq, sk, 4, 2, torch.float32)
    out, lse = block_attn_forward(q, k, v, kernel=kernel)
    assert out.shape == (B, sq, 4, D) and not out.any()
    assert lse.shape == (B, 4, sq) and (lse == float("-inf")).all()
    dq, dk, dv = block_attn_backward(dout, q, k, v, out, lse, kernel=kernel)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert not (dq.any() or dk.any() or dv.any())


@pytest.mark.parametrize("chunk", [1, 7, 13, 64])
def test_torch_chunks_that_do_not_divide_s(chunk: int) -> None:
    mc = MASK_CASES["docs_odd_padded"]
    q, k, v, dout = _inputs(mc.sq, mc.sk, 4, 1, torch.float64)
    kern = torch_chunked_kernel(chunk)
    out, lse = block_attn_forward(q, k, v, mask=mc.mask, kernel=kern)
    grads = block_attn_backward(dout, q, k, v, out, lse, mask=mc.mask, kernel=kern)
    for got, ref in zip((out, lse, *grads), _reference(q, k, v, dout, mc.mask)):
        assert _max_err(got, ref) <= 1e-10


def test_default_scale_and_explicit_scale() -> None:
    q, k, v, _ = _inputs(12, 12, 2, 2, torch.float64)
    out, lse = block_attn_forward(q, k, v, scale=0.3, kernel="sdpa")
    ref_out, ref_lse = dense_attention_reference(q, k, v, scale=0.3)
    assert _max_err(out, ref_out) <= 1e-12 and _max_err(lse, ref_lse) <= 1e-12
    out, _ = block_attn_forward(q, k, v, kernel="torch")
    assert _max_err(out, dense_attention_reference(q, k, v, scale=D**-0.5)[0]) <= 1e-12


# ----------------------------------------------------------------------------------------------
# kernel selection


def test_auto_picks_fastest_exact_kernel_on_cpu() -> None:
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        assert available_kernels("cpu", dtype) == ["sdpa", "torch"]
        assert resolve_kernel("auto", "cpu", dtype) == "sdpa"
    assert resolve_kernel("torch", torch.device("cpu"), torch.float64) == "torch"


def test_auto_on_cuda_device_type() -> None:
    """Selection only looks at (device type, dtype), so it is testable without a GPU."""
    assert "sdpa" not in available_kernels("cuda", torch.float32)
    assert resolve_kernel("auto", "cuda", torch.float32) == "cuda_sdpa"  # PyTorch's fused CUDA ops
    assert resolve_kernel("auto", "cuda", torch.float64) == "torch"
    has_pkg = importlib.util.find_spec("flash_attn") is not None
    assert resolve_kernel("auto", "cuda", torch.bfloat16) == ("flash_attn" if has_pkg else "cuda_sdpa")
    assert resolve_kernel("auto", "cuda", torch.bfloat16, softcap=30.0) == (
        "flash_attn" if has_pkg else "torch"
    )


def test_unknown_and_unavailable_kernel_errors() -> None:
    with pytest.raises(
        ValueError, match=r"kernel='bogus'.*valid names: auto, flash_attn, cuda_sdpa, sdpa, torch"
    ):
        resolve_kernel("bogus", "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"kernel='flash_attn' needs CUDA.*valid here .*: auto, sdpa, torch"):
        resolve_kernel("flash_attn", "cpu", torch.float32)
    with pytest.raises(
        ValueError, match=r"kernel='sdpa' needs CPU tensors.*valid here .*: auto, cuda_sdpa, torch"
    ):
        resolve_kernel("sdpa", "cuda", torch.float32)
    with pytest.raises(ValueError, match=r"chunk=0"):
        torch_chunked_kernel(0)


# ----------------------------------------------------------------------------------------------
# input validation


def _qkv(sq: int = 8, sk: int = 8, h: int = 4, hkv: int = 2, d: int = D) -> tuple[torch.Tensor, ...]:
    return torch.randn(1, sq, h, d), torch.randn(1, sk, hkv, d), torch.randn(1, sk, hkv, d)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: (*_qkv(h=6, hkv=4), {}), r"H=6 query heads is not a multiple of H_kv=4"),
        (lambda: (_qkv()[0], *_qkv(d=8)[1:], {}), r"head dim mismatch: q has D=16, k/v have D=8"),
        (lambda: (*_qkv()[:2], _qkv(sk=9)[2], {}), r"k \(1, 8, 2, 16\) and v \(1, 9, 2, 16\)"),
        (lambda: (_qkv()[0].double(), *_qkv()[1:], {}), r"got q torch.float64, k torch.float32"),
        (lambda: (_qkv()[0][0], *_qkv()[1:], {}), r"q must be \[B, Sq, H, D\].*got q \(8, 4, 16\)"),
        (
            lambda: (*_qkv(), {"mask": torch.ones(8, 9, dtype=torch.bool)}),
            r"mask shape \(8, 9\) does not fit Sq=8, Sk=8, B=1: use \[8, 8\] or \[1, 8, 8\]",
        ),
        (lambda: (*_qkv(), {"mask": torch.zeros(8, 8)}), r"mask must be bool.*got dtype torch.float32"),
        (
            lambda: (*_qkv(), {"mask": torch.ones(8, 8, dtype=torch.bool), "causal": True}),
            r"causal=True or an explicit mask, not both",
        ),
    ],
    ids=["gqa", "head_dim", "kv_shape", "dtype", "rank", "mask_shape", "mask_dtype", "mask_and_causal"],
)
def test_forward_validation_errors(make, match: str) -> None:
    q, k, v, kw = make()
    with pytest.raises(ValueError, match=match):
        block_attn_forward(q, k, v, **kw)


def test_backward_validation_error_names_lse_shape() -> None:
    q, k, v = _qkv()
    out, lse = block_attn_forward(q, k, v)
    with pytest.raises(ValueError, match=r"lse \(1, 8, 4\) must be \(1, 4, 8\)"):
        block_attn_backward(out, q, k, v, out, lse.transpose(1, 2))


# ----------------------------------------------------------------------------------------------
# merge


def _block_results(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, bounds: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        dense_attention_reference(q, k[:, a:b], v[:, a:b], mask[..., a:b])
        for a, b in itertools.pairwise(bounds)
    ]


def test_merge_any_order_reproduces_unsplit_result() -> None:
    """Blocks include rows that see nothing in some blocks, one block nobody sees, and rows that see
    nothing at all; every permutation merges to the unsplit fp64 result within 1e-12."""
    docs = _docs([9, 14, 20], pad=5)
    pos = torch.arange(48)
    mask = token_mask(pos, pos, MaskSpec(), docs, docs)
    mask[:, 30:34] = False  # block [30, 34) is EMPTY for every row
    q, k, v, _ = _inputs(48, 48, 4, 2, torch.float64, seed=3)
    want_out, want_lse = dense_attention_reference(q, k, v, mask)
    results = _block_results(q, k, v, mask, [0, 5, 9, 23, 30, 34, 41, 48])
    rng = random.Random(0)
    for _ in range(6):
        order = rng.sample(results, len(results))
        out, lse = order[0]
        for blk in order[1:]:
            out, lse = merge_attn(out, lse, *blk)
        assert _max_err(out, want_out) <= 1e-12
        assert _max_err(lse, want_lse) <= 1e-12


def test_merge_empty_row_rules_never_nan() -> None:
    ninf = float("-inf")
    out_a = torch.tensor([1.0, 0.0, 2.0, 0.0]).view(1, 4, 1, 1)
    lse_a = torch.tensor([0.5, ninf, 1.0, ninf]).view(1, 1, 4)
    out_b = torch.tensor([3.0, 4.0, 0.0, 0.0]).view(1, 4, 1, 1)
    lse_b = torch.tensor([0.5, 2.0, ninf, ninf]).view(1, 1, 4)
    out, lse = merge_attn(out_a, lse_a, out_b, lse_b)
    assert not out.isnan().any() and not lse.isnan().any()
    assert out.flatten().tolist() == [2.0, 4.0, 2.0, 0.0]  # mix; take block; keep acc; stays 0
    assert lse[0, 0, 0].item() == pytest.approx(0.5 + torch.log(torch.tensor(2.0)).item())
    assert lse.flatten()[1:].tolist() == [2.0, 1.0, ninf]


@pytest.mark.parametrize("rows", [slice(8, 20), torch.arange(8, 20), torch.arange(24) >= 12])
def test_merge_in_place_into_row_subset(rows: slice | torch.Tensor) -> None:
    """merge_attn_ with ``rows`` updates only those accumulator rows (e.g. half a zigzag shard)."""
    q, k, v, _ = _inputs(24, 30, 2, 1, torch.float64, seed=4)
    acc_out, acc_lse = dense_attention_reference(q, k[:, :10], v[:, :10])
    want_out, want_lse = acc_out.clone(), acc_lse.clone()
    blk = dense_attention_reference(q[:, rows], k[:, 10:], v[:, 10:])
    want_out[:, rows], want_lse[:, :, rows] = merge_attn(want_out[:, rows], want_lse[:, :, rows], *blk)
    merge_attn_(acc_out, acc_lse, *blk, rows=rows)
    assert torch.equal(acc_out, want_out) and torch.equal(acc_lse, want_lse)
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(
        acc_out[:, untouched], dense_attention_reference(q, k[:, :10], v[:, :10])[0][:, untouched]
    )


# ----------------------------------------------------------------------------------------------
# masks


def test_token_mask_rules() -> None:
    pos = torch.arange(10)
    assert torch.equal(token_mask(pos, pos), torch.ones(10, 10, dtype=torch.bool).tril())
    # HF/Mistral sliding window: a query sees the last `window` positions, itself included
    win = token_mask(pos, pos, MaskSpec(window=3))
    assert win[6].nonzero().flatten().tolist() == [4, 5, 6]
    assert win.sum(-1).tolist() == [1, 2, *[3] * 8]
    both = token_mask(pos, pos, MaskSpec(causal=False, window=3))
    assert both[6].nonzero().flatten().tolist() == [4, 5, 6, 7, 8]
    assert token_mask(pos, pos, MaskSpec(causal=False)).all()
    docs = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, -1, -1])
    m = token_mask(pos, pos, MaskSpec(), docs, docs)
    assert m[4].nonzero().flatten().tolist() == [3, 4]
    assert not m[8:].any() and not m[:, 8:].any()  # padding sees nothing and is seen by nothing


def test_token_mask_batched_shapes() -> None:
    q_pos = torch.stack([torch.arange(6), torch.arange(6) + 3])  # [B=2, Sq=6]
    k_pos = torch.arange(8)  # [Sk], shared by the batch
    m = token_mask(q_pos, k_pos)
    assert m.shape == (2, 6, 8)
    assert torch.equal(m[1], token_mask(q_pos[1], k_pos))
    docs = torch.stack([torch.zeros(6, dtype=torch.long), torch.tensor([0, 0, 1, 1, 1, -1])])
    mb = token_mask(q_pos, q_pos, MaskSpec(causal=False), docs, docs)
    assert mb.shape == (2, 6, 6) and mb[0].all() and not mb[1, 5].any() and not mb[1, 0, 2]


def _zigzag(rank: int, world: int, s: int) -> torch.Tensor:
    c = s // (2 * world)
    return torch.cat(
        [
            torch.arange(rank * c, (rank + 1) * c),
            torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c),
        ]
    )


def _check_consistent(
    kind: BlockKind, mask: torch.Tensor | None, q_pos, k_pos, spec, q_doc=None, k_doc=None
) -> None:
    want = token_mask(q_pos, k_pos, spec, q_doc, k_doc)
    if kind is BlockKind.EMPTY:
        assert mask is None and not want.any()
    elif kind is BlockKind.FULL:
        assert mask is None and want.all()
    elif kind is BlockKind.CAUSAL:
        tril = torch.ones(want.shape[-2:], dtype=torch.bool).tril()
        assert mask is None and bool((want == tril).all())
    else:
        assert mask is not None and torch.equal(mask, want) and want.any() and not want.all()


S16 = torch.arange(16)
STRIPE0, STRIPE1 = torch.arange(0, 16, 2), torch.arange(1, 16, 2)
DOCS16 = _docs([4, 4, 8])
CLASSIFY_CASES = {
    # contiguous causal ring: earlier shard FULL, later shard EMPTY, own shard CAUSAL
    "contig_past": (S16[8:12], S16[0:4], MaskSpec(), None, None, BlockKind.FULL),
    "contig_future": (S16[0:4], S16[8:12], MaskSpec(), None, None, BlockKind.EMPTY),
    "contig_diag": (S16[4:8], S16[4:8], MaskSpec(), None, None, BlockKind.CAUSAL),
    "contig_offset_diag": (S16[4:8], S16[2:6], MaskSpec(), None, None, BlockKind.PARTIAL),
    "noncausal": (S16[0:4], S16[8:12], MaskSpec(causal=False), None, None, BlockKind.FULL),
    # zigzag (P=2, chunks of 4): rank 0 = [0..3, 12..15], rank 1 = [4..11]
    "zigzag_diag": (_zigzag(0, 2, 16), _zigzag(0, 2, 16), MaskSpec(), None, None, BlockKind.CAUSAL),
    "zigzag_0_sees_1": (_zigzag(0, 2, 16), _zigzag(1, 2, 16), MaskSpec(), None, None, BlockKind.PARTIAL),
    "zigzag_1_sees_0": (_zigzag(1, 2, 16), _zigzag(0, 2, 16), MaskSpec(), None, None, BlockKind.PARTIAL),
    # token stripes: rank 1 over rank 0 keys is exactly lower-triangular, the reverse is strictly lower
    "stripe_1_sees_0": (STRIPE1, STRIPE0, MaskSpec(), None, None, BlockKind.CAUSAL),
    "stripe_0_sees_1": (STRIPE0, STRIPE1, MaskSpec(), None, None, BlockKind.PARTIAL),
    # documents
    "docs_disjoint": (S16[8:16], S16[0:4], MaskSpec(), DOCS16[8:16], DOCS16[0:4], BlockKind.EMPTY),
    "docs_same_past": (S16[12:16], S16[8:12], MaskSpec(), DOCS16[12:16], DOCS16[8:12], BlockKind.FULL),
    "docs_same_diag": (S16[8:12], S16[8:12], MaskSpec(), DOCS16[8:12], DOCS16[8:12], BlockKind.CAUSAL),
    "docs_mixed": (S16[0:8], S16[0:8], MaskSpec(), DOCS16[0:8], DOCS16[0:8], BlockKind.PARTIAL),
    "docs_padding": (
        S16[0:4],
        S16[0:4],
        MaskSpec(),
        torch.full((4,), -1),
        torch.full((4,), -1),
        BlockKind.EMPTY,
    ),
    "docs_noncausal_mixed": (
        S16[0:8],
        S16[0:8],
        MaskSpec(causal=False),
        DOCS16[0:8],
        DOCS16[0:8],
        BlockKind.PARTIAL,
    ),
    # sliding window
    "window_far": (S16[12:16], S16[0:4], MaskSpec(window=4), None, None, BlockKind.EMPTY),
    "window_near": (S16[4:8], S16[0:4], MaskSpec(window=4), None, None, BlockKind.PARTIAL),
    "window_wide": (S16[4:8], S16[0:4], MaskSpec(window=8), None, None, BlockKind.FULL),
    "window_diag_binds": (S16[0:8], S16[0:8], MaskSpec(window=3), None, None, BlockKind.PARTIAL),
    "window_diag_loose": (S16[0:8], S16[0:8], MaskSpec(window=8), None, None, BlockKind.CAUSAL),
    "window_noncausal_far": (
        S16[0:4],
        S16[9:13],
        MaskSpec(causal=False, window=6),
        None,
        None,
        BlockKind.EMPTY,
    ),
    "window_noncausal_near": (
        S16[0:4],
        S16[4:8],
        MaskSpec(causal=False, window=8),
        None,
        None,
        BlockKind.FULL,
    ),
    # positions per batch row
    "batched_diag": (
        torch.stack([S16[:4], S16[4:8]]),
        torch.stack([S16[:4], S16[4:8]]),
        MaskSpec(),
        None,
        None,
        BlockKind.CAUSAL,
    ),
}


@pytest.mark.parametrize("name", list(CLASSIFY_CASES))
def test_classify_block(name: str) -> None:
    q_pos, k_pos, spec, q_doc, k_doc, expected = CLASSIFY_CASES[name]
    kind, mask = classify_block(q_pos, k_pos, spec, q_doc, k_doc)
    assert kind is expected
    _check_consistent(kind, mask, q_pos, k_pos, spec, q_doc, k_doc)


def test_classify_block_random_layouts_agree_with_token_mask() -> None:
    gen = torch.Generator().manual_seed(11)
    specs = [MaskSpec(), MaskSpec(window=5), MaskSpec(causal=False), MaskSpec(causal=False, window=4)]
    for trial in range(200):
        perm = torch.randperm(32, generator=gen)
        q_pos, k_pos = perm[:8].sort().values, perm[8 + trial % 8 : 16 + trial % 8].sort().values
        docs = (torch.arange(32) // 11) if trial % 2 else None
        q_doc = None if docs is None else docs[q_pos]
        k_doc = None if docs is None else docs[k_pos]
        for spec in specs:
            kind, mask = classify_block(q_pos, k_pos, spec, q_doc, k_doc)
            _check_consistent(kind, mask, q_pos, k_pos, spec, q_doc, k_doc)


def test_classified_blocks_drive_the_kernel() -> None:
    """Zigzag diagonal block: CAUSAL -> kernel causal flag equals the explicit position mask."""
    pos = _zigzag(1, 2, 64)
    kind, _ = classify_block(pos, pos)
    assert kind is BlockKind.CAUSAL
    q, k, v, _ = _inputs(32, 32, 2, 1, torch.float64)
    want = dense_attention_reference(q, k, v, token_mask(pos, pos))
    for kernel in ("torch", "sdpa"):
        got = block_attn_forward(q, k, v, causal=True, kernel=kernel)
        assert _max_err(got[0], want[0]) <= 1e-12 and _max_err(got[1], want[1]) <= 1e-12


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: MaskSpec(window=0), r"MaskSpec.window=0 is invalid"),
        (lambda: MaskSpec(window=2.5), r"MaskSpec.window=2.5 is invalid"),
        (
            lambda: token_mask(torch.arange(4.0), torch.arange(4)),
            r"q_pos must hold integer positions.*float32",
        ),
        (
            lambda: token_mask(torch.zeros(1, 2, 3), torch.arange(4)),
            r"q_pos must be \[S\] or \[B, S\].*\(1, 2, 3\)",
        ),
        (
            lambda: token_mask(torch.arange(4), torch.arange(4), MaskSpec(), torch.zeros(3), torch.zeros(4)),
            r"q_doc has shape \(3,\) but q_pos has \(4,\)",
        ),
        (
            lambda: token_mask(torch.arange(4), torch.arange(4), MaskSpec(), torch.zeros(4), None),
            r"both q_doc and k_doc",
        ),
        (
            lambda: classify_block(torch.zeros(2, 4, dtype=torch.long), torch.zeros(3, 4, dtype=torch.long)),
            r"batch mismatch: q_pos is \(2, 4\) and k_pos is \(3, 4\)",
        ),
    ],
    ids=["window_0", "window_float", "float_pos", "pos_rank", "doc_shape", "one_doc", "batch"],
)
def test_mask_validation_errors(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# ----------------------------------------------------------------------------------------------
# layering


def test_ops_layer_has_no_process_group_imports() -> None:
    forbidden = ("torch.distributed", "ds_seqpar.comm", "ds_seqpar.parallel", "ds_seqpar.integrations")
    ops_dir = Path(__file__).resolve().parents[1] / "ds_seqpar" / "ops"
    for path in ops_dir.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            bad = [n for n in names if n.startswith(forbidden)]
            assert not bad, f"{path.name} imports {bad}: the ops layer must stay free of process groups"


@pytest.mark.parametrize("consume", [False, True])
def test_merge_in_place_lean_path_equals_merge_bitwise(consume: bool) -> None:
    """merge_attn_ on a slice (the ring's path) adds ``w · (blk - acc)`` in place: the same bits as
    merge_attn, empty rows included (acc empty: take the block; block empty: keep; both: stays)."""
    ninf = float("-inf")
    q, k, v, _ = _inputs(16, 20, 2, 1, torch.float32, seed=5)
    acc_out, acc_lse = dense_attention_reference(q, k[:, :8], v[:, :8])
    blk_out, blk_lse = dense_attention_reference(q[:, 4:12], k[:, 8:], v[:, 8:])
    acc_lse[:, :, 4:6] = ninf  # rows that saw no key yet (their out is garbage: NaN must not leak)
    acc_out[:, 4:6] = float("nan")
    blk_lse[:, :, 2:4] = ninf  # rows the block does not reach
    blk_out[:, 2:4] = float("nan")
    acc_lse[:, :, 10] = ninf  # both empty
    acc_out[:, 10] = 0.0
    blk_lse[:, :, 6] = ninf
    blk_out[:, 6] = float("nan")
    want_out, want_lse = merge_attn(acc_out[:, 4:12].nan_to_num(0.0), acc_lse[:, :, 4:12], blk_out, blk_lse)
    merge_attn_(acc_out, acc_lse, blk_out.clone() if not consume else blk_out, blk_lse, slice(4, 12), consume)
    got = acc_out[:, 4:12]
    assert not got.isnan().any()
    assert torch.equal(got, want_out.nan_to_num(0.0)) and torch.equal(acc_lse[:, :, 4:12], want_lse)


# ----------------------------------------------------------------------------------------------
# ALiBi (docs/kernels.md "ALiBi")

ALIBI_MASKS = [
    "full",
    "causal_flag",
    "causal_flag_rect",
    "docs_odd_padded",
    "batch_docs",
    "random_empty_rows",
]


@pytest.mark.parametrize("case", KERNEL_CASES[:-1])  # flash_attn refuses ALiBi (test below)
@pytest.mark.parametrize(("h", "hkv"), [HEADS[1], HEADS[3]])
@pytest.mark.parametrize("mask_name", ALIBI_MASKS)
def test_kernel_alibi_matches_dense_reference(case: KernelCase, h: int, hkv: int, mask_name: str) -> None:
    """slopes[h] · (k_pos - q_pos) from global positions (per-row key positions on one side) vs fp64."""
    from ds_seqpar.ops.attention import Alibi

    mc = MASK_CASES[mask_name]
    q, k, v, dout = _inputs(mc.sq, mc.sk, h, hkv, case.dtype, case.device, seed=3)
    q_pos = torch.arange(mc.sq) + 37
    k_pos = torch.stack([torch.arange(mc.sk) * 2, torch.arange(mc.sk) + 5])  # [B, Sk], non-consecutive
    slopes = 2.0 ** -torch.arange(1.0, h + 1)
    alibi = Alibi(slopes.to(case.device), q_pos.to(case.device), k_pos.to(case.device))
    mask = None if mc.mask is None else mc.mask.to(case.device)
    kw = {"mask": mask, "causal": mc.causal, "kernel": case.kernel, "alibi": alibi}
    out, lse = block_attn_forward(q, k, v, **kw)
    grads = block_attn_backward(dout, q, k, v, out, lse, **kw)
    leaves = [x.detach().cpu().double().requires_grad_() for x in (q, k, v)]
    ref, ref_lse = dense_attention_reference(
        *leaves, mc.dense_mask(), alibi=Alibi(slopes.double(), q_pos, k_pos)
    )
    ref.backward(dout.cpu().double())
    # native bf16 (sdpa): the bias sharpens rows, and bf16 probabilities before P @ V err up to ~6e-2
    tol = 2 * case.tol if case.dtype == torch.bfloat16 and case.kernel == "sdpa" else case.tol
    for name, got, want in zip(
        ("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (ref, ref_lse, *(x.grad for x in leaves))
    ):
        err = _max_err(got, want.detach())
        assert err <= tol, f"{name}: max abs error {err:.3g} > {tol}"


def test_alibi_auto_choice_and_refusals() -> None:
    """auto picks a kernel that applies ALiBi; a kernel without it is refused by name."""
    import dataclasses

    from ds_seqpar.ops.attention import Alibi, kernel_for

    assert available_kernels("cpu", torch.float32, alibi=True) == ["sdpa", "torch"]
    assert available_kernels("cuda", torch.bfloat16, alibi=True)[-2:] == ["cuda_sdpa", "torch"]
    plain = dataclasses.replace(torch_chunked_kernel(), name="plain", alibi=False)
    with pytest.raises(
        ValueError, match=r"kernel='plain' cannot apply ALiBi .*valid here .*: auto, sdpa, torch"
    ):
        kernel_for(plain, "cpu", torch.float32, alibi=True)
    q = torch.zeros(1, 4, 2, D)
    with pytest.raises(ValueError, match=r"alibi slopes \(3,\).*do not fit H=2"):
        block_attn_forward(q, q, q, alibi=Alibi(torch.ones(3), torch.arange(4), torch.arange(4)))
