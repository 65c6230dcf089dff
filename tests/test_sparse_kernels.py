"""Every sparse kernel of the registry (``ops/sparse/kernels.py``) against the fp64 reference.

The ``blocks`` kernel is covered at length by ``test_ops_sparse.py``; here the ``masked`` kernel (fp64,
any device) and the ``triton`` kernel (fp32 under Triton's CPU interpreter, ``TRITON_INTERPRET=1`` set
by ``conftest.py``) run the same sharded recipe: every (query shard, key shard) pair of a layout,
merged, forward and backward, then compared with ``sparse_attention_reference``. Also: the registry's
choice and refusals, and the config field ``sparse.kernel``.
"""

from __future__ import annotations

import pytest
import torch

from ds_seqpar import SeqParConfigError, SequenceParallelConfig
from ds_seqpar.config import parse_section
from ds_seqpar.layout import RingLayout, doc_ids_from_cu_seqlens, ring_layout
from ds_seqpar.ops.masks import MaskSpec
from ds_seqpar.ops.sparse import estimate_pattern
from ds_seqpar.ops.sparse.kernels import (
    SPARSE_KERNELS,
    available_sparse_kernels,
    resolve_sparse_kernel,
    visible_pairs,
)
from tests.helpers.sparse import sharded_sparse, small_budget, sparse_qkv, sparse_reference

pytest.importorskip("triton")
from ds_seqpar.ops.sparse import triton_kernel as sparse_triton  # after the skip: the module imports triton

needs_interpreter = pytest.mark.skipif(
    not sparse_triton.interpreted(), reason="the triton kernel runs on CPU only under TRITON_INTERPRET=1"
)
TOL = {"masked": (torch.float64, 1e-10), "triton": (torch.float32, 1e-5)}
LAYOUTS = [ring_layout("stripe", 2, 8), ring_layout("zigzag", 2), ring_layout("stripe", 3, 1)]


def _compare(got, ref, tol: float, what: object) -> None:
    """``got`` and ``ref``: the same leading entries of (out, lse, dq, dk, dv), at least one."""
    assert 0 < len(got) == len(ref), what
    names = ("out", "lse", "dq", "dk", "dv")[: len(got)]
    for name, g, r in zip(names, got, ref, strict=True):
        finite = torch.isfinite(r)
        assert torch.equal(torch.isfinite(g), finite), (name, what)
        assert (g[finite] - r[finite]).abs().max().item() <= tol, (name, what)


def _case(kernel: str, layout: RingLayout, h_kv: int, d: int, seed: int = 0):
    dtype, tol = TOL[kernel]
    s = 48 * layout.world
    q, k, v, dout = sparse_qkv(2, s, 4, h_kv, d, dtype, seed)
    pos = torch.arange(s)
    return (q, k, v, dout, estimate_pattern(q, k, pos, pos, s, small_budget(8))), tol


@pytest.mark.parametrize("kernel", ["masked", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize(
    ("layout", "h_kv", "d"), [(LAYOUTS[0], 4, 8), (LAYOUTS[1], 1, 40), (LAYOUTS[2], 2, 16)]
)
def test_kernel_matches_reference(kernel, layout, h_kv, d):
    args, tol = _case(kernel, layout, h_kv, d)
    got = sharded_sparse(*args, layout, kernel=kernel).tensors()
    _compare(got, sparse_reference(*args), tol, (kernel, layout))


@pytest.mark.parametrize("kernel", ["masked", pytest.param("triton", marks=needs_interpreter)])
def test_kernel_with_window_documents_padding_and_softcap(kernel):
    layout = LAYOUTS[0]
    args, tol = _case(kernel, layout, 2, 16, seed=5)
    s = args[0].shape[1]
    docs = torch.stack(
        [doc_ids_from_cu_seqlens([0, 17, 60, 90], s), doc_ids_from_cu_seqlens([0, 48, 96], s)]
    )  # row 0 ends in 6 padding tokens (doc -1): their rows see nothing (out 0, lse -inf)
    spec = MaskSpec(window=30)
    got = sharded_sparse(*args, layout, spec, docs, kernel=kernel, softcap=4.0)
    _compare(got.tensors(), sparse_reference(*args, spec, docs, softcap=4.0), tol, kernel)
    assert torch.isinf(got.lse[0, :, -6:]).all()


@needs_interpreter
def test_triton_fp16_is_close():
    args, _ = _case("masked", LAYOUTS[0], 2, 16)
    half = [t.half() for t in args[:4]]
    got = sharded_sparse(*half, args[4], LAYOUTS[0], kernel="triton")
    _compare(got.tensors()[:1], sparse_reference(*args)[:1], 2e-2, "fp16 out")


def test_masked_pairs_count_the_token_mask():
    q, k, _, _ = sparse_qkv(2, 64, 4, 2, 8, torch.float64)
    pos = torch.arange(64)
    pattern = estimate_pattern(q, k, pos, pos, 64, small_budget(8))
    want = int(pattern.visible(pos, pos).sum())
    assert visible_pairs(pos, pos, pattern, batch=2) == want
    half = visible_pairs(pos, pos, pattern, MaskSpec(window=8), batch=2)
    assert 0 < half < want


def test_registry_choice_and_refusals():
    assert resolve_sparse_kernel("auto", "cpu", torch.float64).name == "blocks"
    assert resolve_sparse_kernel("masked", "cpu", torch.float32).name == "masked"
    assert "blocks" in available_sparse_kernels("cpu", torch.float32)
    with pytest.raises(
        ValueError, match=r"unknown sparse kernel='flex'.*valid names: auto, triton, blocks, masked"
    ):
        resolve_sparse_kernel("flex", "cpu", torch.float32)
    assert SPARSE_KERNELS["triton"].unavailable(torch.device("cpu"), torch.float64) is not None
    with pytest.raises(
        ValueError, match=r"sparse kernel='triton' needs .*valid here \(cpu, torch.float64\): auto, blocks"
    ):
        resolve_sparse_kernel("triton", "cpu", torch.float64)
    assert set(SPARSE_KERNELS) == {"triton", "blocks", "masked"}
    assert SPARSE_KERNELS["blocks"].host_sync and not SPARSE_KERNELS["triton"].host_sync


def test_config_names_the_sparse_kernel():
    cfg = SequenceParallelConfig(size=2, attention="sparse_ring", sparse={"kernel": "masked"})
    assert cfg.sparse.kernel == "masked"
    with pytest.raises(
        SeqParConfigError, match=r"sparse.kernel='flex' is not valid; valid: auto, triton, blocks, masked"
    ):
        parse_section({"size": 2, "attention": "sparse_ring", "sparse": {"kernel": "flex"}})
