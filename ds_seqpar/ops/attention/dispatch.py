"""Dispatch of one block of attention to a kernel of the registry ``KERNELS`` (docs/kernels.md).

Kernels (one registry, ``ops/backends.py``; registration order is the ``auto`` order, fastest exact first):
    flash_attn  flash-attn on CUDA for fp16/bf16 (``flash.py``): FULL and square causal blocks through its
                own block functions (softcap natively), packed documents through its varlen pair,
                sliding-window bands through ``window_size``; other blocks, and every ALiBi block, on cuda_sdpa
                (torch with a softcap)
    cuda_sdpa   PyTorch's fused CUDA ops (``cuda_sdpa.py``); no softcap; ALiBi (float32 efficient op)
    sdpa        PyTorch's CPU flash op (``cpu_sdpa.py``); no softcap; ALiBi
    torch       pure PyTorch, chunked (``torch_kernel.py``); the reference; softcap; ALiBi
    auto        the first available (with a softcap / ALiBi: the first that applies it)

A new kernel is an ``AttentionKernel`` (``contract.py``) given to :func:`register_kernel`;
``sequence_parallel.kernel`` then accepts its name (docs/architecture.md, "How to add a kernel").
"""

from __future__ import annotations

import torch

from ds_seqpar.ops.attention.contract import Alibi, AttentionKernel
from ds_seqpar.ops.attention.cpu_sdpa import SDPA
from ds_seqpar.ops.attention.cuda_sdpa import CUDA_SDPA
from ds_seqpar.ops.attention.flash import flash_attn_kernel
from ds_seqpar.ops.attention.torch_kernel import torch_chunked_kernel
from ds_seqpar.ops.backends import AUTO, Backend, Registry
from ds_seqpar.ops.merge import inert_empty_rows
from ds_seqpar.ops.precision import accumulation_dtype

__all__ = [
    "KERNELS",
    "available_kernels",
    "block_attn_backward",
    "block_attn_forward",
    "check_softcap",
    "kernel_for",
    "register_kernel",
    "resolve_kernel",
]

NEG_INF = float("-inf")

KERNELS = Registry("kernel", config_key="kernel")
"""Registered kernels, in ``auto`` preference order (fastest exact first)."""


def register_kernel(kernel: AttentionKernel) -> AttentionKernel:
    """Make ``kernel`` configurable as ``sequence_parallel.kernel = kernel.name`` (last in the auto order)."""
    if not isinstance(kernel, AttentionKernel):
        raise TypeError(f"register_kernel takes an AttentionKernel, got {kernel!r}")
    KERNELS.register(Backend(kernel.name, kernel, kernel.unavailable, kernel.summary))
    return kernel


_TORCH = torch_chunked_kernel()
for _kernel in (flash_attn_kernel(CUDA_SDPA, _TORCH), CUDA_SDPA, SDPA, _TORCH):
    register_kernel(_kernel)
del _kernel


def _accepts(softcap: float | None, alibi: bool = False):
    """The registry's ``accepts``: kernels that apply the softcap and ALiBi asked for (None: any)."""
    if softcap is None and not alibi:
        return None
    return lambda kernel: (softcap is None or kernel.softcap) and (not alibi or kernel.alibi)


def available_kernels(
    device: torch.device | str, dtype: torch.dtype, softcap: bool = False, alibi: bool = False
) -> list[str]:
    """Kernel names that can run for ``(device, dtype)`` (and apply a softcap / ALiBi, if asked), in ``auto`` order."""
    return KERNELS.available(device, dtype, _accepts(1.0 if softcap else None, alibi))


def check_softcap(softcap: float | None) -> float | None:
    """``softcap`` as a float (None = off); a ValueError naming the value unless it is a number > 0."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, int | float) or not softcap > 0:
        raise ValueError(
            f"softcap={softcap!r} is invalid: use a number > 0 (scores become softcap · tanh(score / softcap)) "
            "or None for no soft-capping"
        )
    return float(softcap)


def _refusal(softcap: float | None, alibi: bool) -> str:
    wants = [f"softcap={softcap} (attention logit soft-capping)"] if softcap is not None else []
    wants += ["ALiBi (alibi_slopes, a per-head linear position bias)"] if alibi else []
    return "cannot apply " + " and ".join(wants)


def _resolve(
    kernel: str | AttentionKernel,
    device: torch.device,
    dtype: torch.dtype,
    softcap: float | None = None,
    alibi: bool = False,
) -> AttentionKernel:
    refusal, accepts = _refusal(softcap, alibi), _accepts(softcap, alibi)
    if not isinstance(kernel, AttentionKernel):
        detail = (" with softcap" if softcap is not None else "") + (" with alibi" if alibi else "")
        return KERNELS.resolve(kernel, device, dtype, accepts, refusal, detail)
    reason = kernel.unavailable(device, dtype)
    if reason is None and accepts is not None and not accepts(kernel):
        reason = refusal
    if reason is not None:
        valid = ", ".join([AUTO, *available_kernels(device, dtype, softcap is not None, alibi)])
        raise ValueError(f"kernel={kernel.name!r} {reason}; valid here ({device.type}, {dtype}): {valid}")
    return kernel


def kernel_for(
    kernel: str | AttentionKernel,
    device: torch.device | str,
    dtype: torch.dtype,
    softcap: float | None = None,
    alibi: bool = False,
) -> AttentionKernel:
    """The kernel object ``kernel`` (a name, ``"auto"`` or an :class:`AttentionKernel`) runs as; ValueError
    if it cannot run (resolve once per call, then pass the object to the block functions)."""
    return _resolve(kernel, torch.device(device), dtype, check_softcap(softcap), alibi)


def resolve_kernel(
    name: str,
    device: torch.device | str,
    dtype: torch.dtype,
    softcap: float | None = None,
    alibi: bool = False,
) -> str:
    """The concrete kernel ``name`` runs as (``"auto"`` -> fastest available that applies ``softcap`` and
    ALiBi when asked); ValueError if it cannot run."""
    return _resolve(name, torch.device(device), dtype, check_softcap(softcap), alibi).name


def _check_alibi(alibi: Alibi | None, q: torch.Tensor, k: torch.Tensor) -> dict:
    """The kernel keyword for ``alibi`` (empty without one); a ValueError unless its shapes fit q / k."""
    if alibi is None:
        return {}
    (b, sq, h, _), sk = q.shape, k.shape[1]
    fits = alibi.slopes.shape == (h,) and alibi.q_pos.shape in ((sq,), (b, sq))
    if not fits or alibi.k_pos.shape not in ((sk,), (b, sk)):
        raise ValueError(
            f"alibi slopes {tuple(alibi.slopes.shape)}, q_pos {tuple(alibi.q_pos.shape)}, k_pos "
            f"{tuple(alibi.k_pos.shape)} do not fit H={h}, Sq={sq}, Sk={sk}, B={b}: use [H], [Sq] | [B, Sq], [Sk] | [B, Sk]"
        )
    return {"alibi": alibi}


def _validate(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
) -> torch.Tensor | None:
    """Check shapes / dtypes; return the mask as bool ``[B|1, Sq, Sk]`` (or None)."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"q must be [B, Sq, H, D] and k, v [B, Sk, H_kv, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape [B, Sk, H_kv, D]"
        )
    (b, sq, h, d), (bk, sk, hkv, dk) = q.shape, k.shape
    if b != bk:
        raise ValueError(f"batch mismatch: q has B={b}, k/v have B={bk}")
    if d != dk:
        raise ValueError(f"head dim mismatch: q has D={d}, k/v have D={dk}; project them to one head dim")
    if hkv == 0 or h % hkv:
        raise ValueError(
            f"H={h} query heads is not a multiple of H_kv={hkv} kv heads; GQA needs H % H_kv == 0"
        )
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(
            f"q, k, v need one floating dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}: cast them to one"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if mask is None:
        return None
    if causal:
        raise ValueError(
            "pass causal=True or an explicit mask, not both; fold causality into the mask (token_mask)"
        )
    if mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be bool (True = visible), got dtype {mask.dtype}; for an additive float mask pass `mask == 0`"
        )
    if mask.shape not in ((sq, sk), (b, sq, sk)):
        raise ValueError(
            f"mask shape {tuple(mask.shape)} does not fit Sq={sq}, Sk={sk}, B={b}: use [{sq}, {sk}] or [{b}, {sq}, {sk}]"
        )
    if mask.device != q.device:
        raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
    return mask if mask.dim() == 3 else mask.unsqueeze(0)


def block_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    kernel: str | AttentionKernel = "auto",
    out_dtype: torch.dtype | None = None,
    softcap: float | None = None,
    alibi: Alibi | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query block over one key/value block, with its log-sum-exp.

    Args:
        q: ``[B, Sq, H, D]``; k, v: ``[B, Sk, H_kv, D]`` (same dtype and device, H % H_kv == 0).
        scale: softmax scale, default ``D ** -0.5``.
        mask: None or bool ``[Sq, Sk]`` / ``[B, Sq, Sk]`` (True = visible), shared by all heads.
        causal: top-left causal by local index (key j visible iff j <= i); exclusive with ``mask``.
        kernel: ``"auto"``, a name in :data:`KERNELS`, or an :class:`AttentionKernel`.

        out_dtype: dtype of ``out`` (default: the acc dtype). A caller that merges nothing (one block
            covers the whole attention) passes q.dtype and skips two conversions.
        softcap: None, or c > 0: scores become c·tanh(score / c) before the softmax (``auto`` then
            picks a kernel that applies it; a named kernel that cannot raises).
        alibi: None, or an :class:`Alibi` (slopes ``[H]``, global positions of the rows and keys): score
            (i, j) of head h gains ``slopes[h] · (k_pos[j] - q_pos[i])`` (``auto`` picks a kernel that applies it).

    Returns:
        ``(out [B, Sq, H, D], lse [B, H, Sq])``: out in ``out_dtype``, lse in the acc dtype (fp64 for
        fp64 inputs, else fp32); rows that see no key have out 0 and lse -inf.
    """
    mask = _validate(q, k, v, mask, causal)
    softcap, bias = check_softcap(softcap), _check_alibi(alibi, q, k)
    kern = _resolve(kernel, q.device, q.dtype, softcap, alibi is not None)
    (b, sq, h, d), sk = q.shape, k.shape[1]
    acc = accumulation_dtype(q.dtype)
    if sq == 0 or sk == 0:
        return q.new_zeros(b, sq, h, d, dtype=out_dtype or acc), q.new_full((b, h, sq), NEG_INF, dtype=acc)
    out, lse = kern.forward(q, k, v, d**-0.5 if scale is None else scale, mask, causal, softcap, **bias)
    return out.to(out_dtype or acc), lse.to(acc)


def block_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    kernel: str | AttentionKernel = "auto",
    grad_dtype: torch.dtype | None = None,
    softcap: float | None = None,
    inert: bool = False,
    alibi: Alibi | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one (query block, key block) pair given the FINAL out / lse of the query rows.

    Args:
        dout, out: ``[B, Sq, H, D]`` (any float dtype); lse: ``[B, H, Sq]``; q, k, v, scale, mask,
            causal, kernel, softcap, alibi: as in :func:`block_attn_forward`.
        grad_dtype: dtype of the gradients (default: the acc dtype, for summing over blocks).
        inert: the caller guarantees that no row has lse = -inf (or made such rows inert with
            ``ops.merge.inert_empty_rows``): the masked copy of ``dout`` is skipped.

    Returns:
        ``dq [B, Sq, H, D]``, ``dk, dv [B, Sk, H_kv, D]`` (summed over each GQA group) in
        ``grad_dtype``. Summing them over all key blocks (dq) / query blocks (dk, dv) gives the full
        gradient.
    """
    mask = _validate(q, k, v, mask, causal)
    softcap, bias = check_softcap(softcap), _check_alibi(alibi, q, k)
    kern = _resolve(kernel, q.device, q.dtype, softcap, alibi is not None)
    (b, sq, h, d), (_, sk, hkv, _) = q.shape, k.shape
    if dout.shape != q.shape or out.shape != q.shape or lse.shape != (b, h, sq):
        raise ValueError(
            f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must be {tuple(q.shape)} and lse "
            f"{tuple(lse.shape)} must be {(b, h, sq)} ([B, H, Sq])"
        )
    acc = grad_dtype or accumulation_dtype(q.dtype)
    if sq == 0 or sk == 0:
        return (
            q.new_zeros(b, sq, h, d, dtype=acc),
            k.new_zeros(b, sk, hkv, d, dtype=acc),
            k.new_zeros(b, sk, hkv, d, dtype=acc),
        )
    if not inert:  # rows that saw no key anywhere: inert instead of NaN (unconditionally: no host sync)
        dout, lse = inert_empty_rows(dout, lse)
    grads = kern.backward(
        dout, q, k, v, out, lse, d**-0.5 if scale is None else scale, mask, causal, softcap, **bias
    )
    return tuple(g.to(acc) for g in grads)
