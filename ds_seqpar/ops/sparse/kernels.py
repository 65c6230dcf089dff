"""Sparse block kernels: the registry behind the sparse ring's (query shard, key shard) step.

docs/sparse.md "Sparse kernels". One registry (``ops/backends.py``), registration order = ``auto`` order.
Every kernel computes the same thing, the vertical-slash pattern's
visibility (``SparsePattern.visible``) with the window / document rules of ``MaskSpec`` and the doc
ids, and follows the block-kernel contract of ``ops/attention/contract.py``:

    forward   (q [B, Sq, H, D], k, v [B, Sk, H_kv, D], q_pos [Sq], k_pos [Sk], pattern, ...)
              -> out [B, Sq, H, D], lse [B, H, Sq] (fp32; fp64 for fp64 inputs), pairs (int, or None
              when the kernel does not count them without a host sync)
    backward  given the FINAL out / lse of the rows -> dq [B, Sq, H, D], dk, dv [B, Sk, H_kv, D]

Kernels (``sequence_parallel.sparse.kernel``):
    triton   a block-sparse Triton kernel (``triton_kernel.py``): CUDA (or the Triton CPU
             interpreter, ``TRITON_INTERPRET=1``), fp16 / bf16 / fp32; the pattern stays on the
             device, no host sync
    blocks   the tile planner (``tiles.py``): batched calls of the dense block kernel over
             gathered key tiles; any device and dtype, reads the pattern on the host (syncs)
    masked   the dense block kernel under the pattern's token mask, heads as batch rows: any device
             and dtype, no host sync, but O(Sq·Sk) work and mask memory (a reference / fallback)
    auto     triton where it runs, else blocks (masked runs everywhere, last)
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ds_seqpar.ops.attention import block_attn_backward, block_attn_forward
from ds_seqpar.ops.backends import Backend, Registry, always_available
from ds_seqpar.ops.masks import MaskSpec, token_mask
from ds_seqpar.ops.sparse.pattern import SparsePattern
from ds_seqpar.ops.sparse.tiles import check_pair_shapes, sparse_attn_backward, sparse_attn_forward

__all__ = [
    "SPARSE_AUTO_SUMMARY",
    "SPARSE_KERNELS",
    "SparseKernel",
    "available_sparse_kernels",
    "register_sparse_kernel",
    "resolve_sparse_kernel",
    "visible_pairs",
]

CAUSAL = MaskSpec()


@dataclass(frozen=True)
class SparseKernel:
    """One sparse block kernel. ``forward(q, k, v, q_pos, k_pos, pattern, *, scale, spec, q_doc, k_doc,
    softcap) -> (out, lse, pairs | None)``; ``backward(dout, q, k, v, out, lse, q_pos, k_pos, pattern, *,
    ...) -> (dq, dk, dv)``; ``unavailable(device, dtype)`` says why it cannot run, or None;
    ``host_sync``: whether it reads the pattern on the host."""

    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor, int | None]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    unavailable: Callable[[torch.device, torch.dtype], str | None]
    host_sync: bool
    summary: str = ""


def _visible(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    pattern: SparsePattern,
    spec: MaskSpec,
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
) -> torch.Tensor:
    """Bool ``[B|1, H, Sq, Sk]``: the pattern's visibility with the window / document rules (no host sync)."""
    vis = pattern.visible(q_pos, k_pos)
    if spec.window is None and q_doc is None:
        return vis
    if q_doc is not None and q_doc.dim() == 2:
        base = token_mask(q_pos.expand(q_doc.shape), k_pos.expand(k_doc.shape), spec, q_doc, k_doc)
    else:
        base = token_mask(q_pos, k_pos, spec, q_doc, k_doc)
    return vis & (base if base.dim() == 3 else base[None])[:, None]


def visible_pairs(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    pattern: SparsePattern,
    spec: MaskSpec = CAUSAL,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
    batch: int = 1,
) -> int:
    """Score pairs a token-exact kernel computes for one pair, over ``batch`` rows and every head
    (a host sync: for work counters only)."""
    vis = _visible(q_pos, k_pos, pattern, spec, q_doc, k_doc)
    return int(vis.sum()) * (batch if vis.shape[0] == 1 else 1)


# ---------------------------------------------------------------------------------------------- masked


def _as_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``q [B, Sq, H, D]``, ``k, v [B, Sk, H_kv, D]`` -> ``[B·H, S, 1, D]`` each (K/V repeated per query head)."""
    b, _, h, d = q.shape
    group = h // k.shape[2]
    rows = [q, k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)]
    return tuple(x.transpose(1, 2).reshape(b * h, -1, 1, d) for x in rows)


def _masked_forward(
    q, k, v, q_pos, k_pos, pattern, *, scale, spec=CAUSAL, q_doc=None, k_doc=None, softcap=None
) -> tuple[torch.Tensor, torch.Tensor, None]:
    check_pair_shapes(q, k, q_pos, k_pos, pattern, spec)
    b, sq, h, d = q.shape
    mask = _visible(q_pos, k_pos, pattern, spec, q_doc, k_doc).expand(b, h, sq, -1).reshape(b * h, sq, -1)
    out, lse = block_attn_forward(*_as_rows(q, k, v), scale=scale, mask=mask, softcap=softcap)
    return out.view(b, h, sq, d).transpose(1, 2), lse.view(b, h, sq), None


# the contract's arguments on two lines
# fmt: off
def _masked_backward(
    dout, q, k, v, out, lse, q_pos, k_pos, pattern,
    *, scale, spec=CAUSAL, q_doc=None, k_doc=None, softcap=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # fmt: on
    check_pair_shapes(q, k, q_pos, k_pos, pattern, spec)
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    mask = _visible(q_pos, k_pos, pattern, spec, q_doc, k_doc).expand(b, h, sq, sk).reshape(b * h, sq, sk)
    q_r, k_r, v_r = _as_rows(q, k, v)
    do_r, o_r = (x.transpose(1, 2).reshape(b * h, sq, 1, d) for x in (dout, out))
    dq, dk, dv = block_attn_backward(
        do_r, q_r, k_r, v_r, o_r, lse.reshape(b * h, 1, sq), scale=scale, mask=mask, softcap=softcap
    )
    dq = dq.view(b, h, sq, d).transpose(1, 2)
    dk, dv = (x.view(b, hkv, h // hkv, sk, d).sum(2).transpose(1, 2) for x in (dk, dv))
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------- triton


def _triton_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "needs the triton package (pip install triton)"
    from ds_seqpar.ops.sparse import triton_kernel

    if device.type != "cuda" and not (device.type == "cpu" and triton_kernel.interpreted()):
        return f"needs CUDA tensors (got device {device.type!r}; CPU only under TRITON_INTERPRET=1)"
    if dtype not in triton_kernel.DTYPES:
        return f"needs float16, bfloat16 or float32 inputs (got {dtype})"
    return None


def _triton_forward(
    q, k, v, q_pos, k_pos, pattern, *, scale, spec=CAUSAL, q_doc=None, k_doc=None, softcap=None
) -> tuple[torch.Tensor, torch.Tensor, None]:
    from ds_seqpar.ops.sparse.triton_kernel import sparse_triton_forward

    check_pair_shapes(q, k, q_pos, k_pos, pattern, spec)
    out, lse = sparse_triton_forward(
        q, k, v, q_pos, k_pos, pattern.vertical, pattern.slash, pattern.block_size,
        scale=scale, window=spec.window, q_doc=q_doc, k_doc=k_doc, softcap=softcap,
    )  # fmt: skip
    return out, lse, None


# the contract's arguments on two lines
# fmt: off
def _triton_backward(
    dout, q, k, v, out, lse, q_pos, k_pos, pattern,
    *, scale, spec=CAUSAL, q_doc=None, k_doc=None, softcap=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # fmt: on
    from ds_seqpar.ops.sparse.triton_kernel import sparse_triton_backward

    check_pair_shapes(q, k, q_pos, k_pos, pattern, spec)
    return sparse_triton_backward(
        dout, q, k, v, out, lse, q_pos, k_pos, pattern.vertical, pattern.slash, pattern.block_size,
        scale=scale, window=spec.window, q_doc=q_doc, k_doc=k_doc, softcap=softcap,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------- registry


SPARSE_KERNELS = Registry("sparse kernel", config_key="sparse.kernel")
"""Registered sparse kernels; ``auto`` takes the first available in registration order."""
SPARSE_AUTO_SUMMARY = "triton where it runs, else blocks"


def register_sparse_kernel(kernel: SparseKernel) -> SparseKernel:
    """Make ``kernel`` configurable as ``sequence_parallel.sparse.kernel = kernel.name`` (last in auto order)."""
    if not isinstance(kernel, SparseKernel):
        raise TypeError(f"register_sparse_kernel takes a SparseKernel, got {kernel!r}")
    SPARSE_KERNELS.register(Backend(kernel.name, kernel, kernel.unavailable, kernel.summary))
    return kernel


for _kernel in (
    SparseKernel(
        "triton", _triton_forward, _triton_backward, _triton_unavailable, host_sync=False,
        summary="block-sparse Triton kernel, CUDA, no host sync",
    ),
    SparseKernel(
        "blocks", sparse_attn_forward, sparse_attn_backward, always_available, host_sync=True,
        summary="tile planner over the dense kernel, any device",
    ),
    SparseKernel(
        "masked", _masked_forward, _masked_backward, always_available, host_sync=False,
        summary="dense kernel under the token mask, any device, no host sync, O(S^2) work",
    ),
):  # fmt: skip
    register_sparse_kernel(_kernel)
del _kernel


def available_sparse_kernels(device: torch.device | str, dtype: torch.dtype) -> list[str]:
    """Names of the sparse kernels that can run for ``(device, dtype)``, in auto order."""
    return SPARSE_KERNELS.available(device, dtype)


def resolve_sparse_kernel(name: str, device: torch.device | str, dtype: torch.dtype) -> SparseKernel:
    """The sparse kernel ``name`` (``"auto"`` or a registered name) runs as on ``(device, dtype)``; a
    ValueError naming the valid choices if it cannot run."""
    return SPARSE_KERNELS.resolve(name, device, dtype)
