"""Exact block attention with log-sum-exp: the single-device kernel under every ring / Ulysses schedule.

Legend:
    B, Sq, Sk  batch, query tokens, key tokens of this block
    H, H_kv    query heads, key/value heads; g = H // H_kv (GQA: query head h uses kv head h // g)
    D          head dim
    acc dtype  float64 for float64 inputs, else float32: outputs, lse and gradients use it so that
               ring merges and gradient sums stay exact; cast ``out`` to the model dtype at the end

Contract (docs/kernels.md "Contract"):
    forward   (q, k, v, mask) -> out [B, Sq, H, D] (acc), lse [B, H, Sq] (acc);
              a row that sees no key gets out 0, lse -inf
    backward  (dout, q, k, v, out, lse, mask) -> dq [B, Sq, H, D], dk, dv [B, Sk, H_kv, D] (acc),
              where out / lse are the FINAL (merged over all key blocks) results of these rows,
              so blocks contribute independently; rows with lse = -inf contribute nothing
    mask      None (all visible), ``causal=True`` (top-left: key j visible iff j <= i, as for
              :attr:`BlockKind.CAUSAL`), or bool [Sq, Sk] / [B, Sq, Sk], True = visible
    softcap   None, or c > 0: every score s = scale · q·k becomes c · tanh(s / c) before the softmax
              (Gemma 2 attention logit soft-capping); lse is that of the capped scores, and the
              backward multiplies the score gradient by 1 - tanh²(s / c)

Kernels (one registry, chosen by name or ``"auto"``):
    torch       pure PyTorch, chunked over query and key blocks (memory O(chunk²)); the reference;
                softcap
    sdpa        PyTorch's CPU flash op (``_scaled_dot_product_flash_attention_for_cpu`` + backward);
                bf16/fp16 run natively (fp32 accumulation inside the op, as flash-attn does); no softcap
    cuda_sdpa   PyTorch's fused CUDA ops (flash for FULL/CAUSAL fp16/bf16, efficient attention with an
                additive bias otherwise), forward and backward with the final out/lse (``ops/cuda_sdpa.py``);
                no softcap
    flash_attn  flash-attn on CUDA for fp16/bf16 (``ops/flash_kernel.py``): FULL and square causal blocks
                forward and backward through flash-attn's own block functions (softcap natively),
                packed documents through its varlen pair, sliding-window bands through its
                ``window_size``; other masks, rectangular causal and other head dims on cuda_sdpa (the
                torch kernel with a softcap)
    auto        the first available of flash_attn, cuda_sdpa, sdpa, torch (with softcap: the first that
                applies it)
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ds_seqpar.ops import cuda_sdpa, flash_kernel
from ds_seqpar.ops.merge import inert_empty_rows

__all__ = [
    "KERNELS",
    "AttentionKernel",
    "Band",
    "Varlen",
    "available_kernels",
    "block_attn_backward",
    "block_attn_forward",
    "check_softcap",
    "flash_attn_kernel",
    "kernel_for",
    "resolve_kernel",
    "torch_chunked_kernel",
]

NEG_INF = float("-inf")
DEFAULT_CHUNK = 512
logger = logging.getLogger("ds_seqpar")

# forward(q, k, v, scale, mask, causal, softcap) -> (out, lse); mask is None or bool [B|1, Sq, Sk];
# softcap is None or c > 0 (only passed to kernels with ``softcap=True``)
ForwardFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor | None, bool, float | None],
    tuple[torch.Tensor, torch.Tensor],
]
# backward(dout, q, k, v, out, lse, scale, mask, causal, softcap) -> (dq, dk, dv); lse finite here
BackwardFn = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        float,
        torch.Tensor | None,
        bool,
        float | None,
    ],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]


@dataclass(frozen=True)
class AttentionKernel:
    """One exact block-attention backend.

    ``forward`` / ``backward`` receive validated inputs (Sq, Sk >= 1; mask bool ``[B|1, Sq, Sk]``;
    backward gets lse with -inf rows replaced by 0 and their dout zeroed). ``unavailable`` returns
    why the kernel cannot run for ``(device, dtype)``, or None when it can. ``softcap``: whether the
    kernel applies score soft-capping (kernels without it always receive ``softcap=None``).
    """

    name: str
    forward: ForwardFn
    backward: BackwardFn
    unavailable: Callable[[torch.device, torch.dtype], str | None]
    softcap: bool = False
    varlen: Varlen | None = None
    band: Band | None = None


@dataclass(frozen=True)
class Band:
    """A kernel's sliding-window mode: blocks whose mask is a diagonal band, run without a mask.

    ``forward(q, k, v, scale, band, softcap) -> (out, lse)`` and ``backward(dout, q, k, v, out, lse, scale,
    band, softcap) -> (dq, dk, dv)`` (FINAL out / lse, finite), shapes as in the block contract; ``band``
    = ``(left, right)`` >= 0: key j visible to query i iff i + Sk - Sq - left <= j <= i + Sk - Sq + right
    (flash-attn's ``window_size``); ``takes(q)``: whether these inputs fit.
    """

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    takes: Callable[[torch.Tensor], bool]


@dataclass(frozen=True)
class Varlen:
    """A kernel's packed-sequence entry points (flash-attn's varlen functions).

    ``forward(q [T, H, D], k, v [Tk, H_kv, D], cu_q, cu_k [n + 1] int32, max_q, max_k, scale, causal,
    softcap) -> (out [T, H, D], lse [H, T] fp32)``; ``backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q,
    max_k, scale, causal, softcap) -> (dq, dk, dv)`` given the FINAL out / lse; ``takes(q)``: whether
    these inputs fit (else the engine calls ``forward`` per sequence).
    """

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    takes: Callable[[torch.Tensor], bool]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------
# torch: chunked reference


def _mask_chunk(
    mask: torch.Tensor | None, causal: bool, qs: int, qe: int, ks: int, ke: int, device: torch.device
) -> torch.Tensor | None:
    """Visibility of query rows [qs, qe) x keys [ks, ke) as bool [B|1, 1, cq, ck]; None = all visible."""
    if mask is not None:
        return mask[:, qs:qe, ks:ke].unsqueeze(1)
    if causal and ke - 1 > qs:
        rows = torch.arange(qs, qe, device=device).unsqueeze(-1)
        return (rows >= torch.arange(ks, ke, device=device)).view(1, 1, qe - qs, ke - ks)
    return None


def _key_chunks(
    mask: torch.Tensor | None, causal: bool, qs: int, qe: int, sk: int, chunk: int, device: torch.device
) -> Iterator[tuple[int, int, torch.Tensor | None]]:
    """Yield ``(ks, ke, visible)`` for the key chunks that causality does not rule out. A chunk the mask
    hides entirely is still computed (its probabilities are 0): testing for it would be a host sync."""
    for ks in range(0, sk, chunk):
        if causal and ks > qe - 1:
            return
        ke = min(ks + chunk, sk)
        yield ks, ke, _mask_chunk(mask, causal, qs, qe, ks, ke, device)


def _masked_scores(
    q_c: torch.Tensor,
    k_c: torch.Tensor,
    scale: float,
    visible: torch.Tensor | None,
    g: int,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores ``[B, H_kv, g*cq, ck]`` for grouped queries ``[B, H_kv, g*cq, D]`` and keys ``[B, H_kv, ck, D]``.

    Returns ``(scores, tanh)``: with ``softcap`` c the scores are c·tanh(s/c) and ``tanh`` is tanh(s/c)
    (for the backward's chain factor 1 - tanh²), else ``tanh`` is None.
    """
    s = (q_c @ k_c.transpose(-1, -2)).mul_(scale)
    t = None
    if softcap is not None:
        t = torch.tanh(s.div_(softcap))
        s = t * softcap
    if visible is not None:
        b, hkv, _, ck = s.shape
        s.view(b, hkv, g, -1, ck).masked_fill_(~visible.unsqueeze(1), NEG_INF)
    return s, t


def _grouped(x: torch.Tensor, hkv: int, qs: int, qe: int, acc: torch.dtype) -> torch.Tensor:
    """Rows [qs, qe) of ``[B, S, H, D]`` as ``[B, H_kv, g*cq, D]`` (head h = kv_head * g + j)."""
    b, _, h, d = x.shape
    chunk = x[:, qs:qe].to(acc).reshape(b, qe - qs, hkv, h // hkv, d)
    return chunk.permute(0, 2, 3, 1, 4).reshape(b, hkv, -1, d)


def _ungroup(x: torch.Tensor, g: int) -> torch.Tensor:
    """Inverse of :func:`_grouped` for one chunk: ``[B, H_kv, g*cq, D]`` -> ``[B, cq, H, D]``."""
    b, hkv, _, d = x.shape
    return x.view(b, hkv, g, -1, d).permute(0, 3, 1, 2, 4).reshape(b, -1, hkv * g, d)


def _torch_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    causal: bool,
    softcap: float | None = None,
    *,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    acc = _acc_dtype(q.dtype)
    k_h = k.transpose(1, 2)  # [B, H_kv, Sk, D]
    v_h = v.transpose(1, 2)
    out = torch.empty(b, sq, h, d, dtype=acc, device=q.device)
    lse = torch.empty(b, h, sq, dtype=acc, device=q.device)
    for qs in range(0, sq, chunk):
        qe = min(qs + chunk, sq)
        q_c = _grouped(q, hkv, qs, qe, acc)
        row_max = torch.full(q_c.shape[:-1], NEG_INF, dtype=acc, device=q.device)  # [B, H_kv, g*cq]
        row_sum = torch.zeros_like(row_max)
        o_c = torch.zeros_like(q_c)
        for ks, ke, visible in _key_chunks(mask, causal, qs, qe, sk, chunk, q.device):
            s, _ = _masked_scores(q_c, k_h[:, :, ks:ke].to(acc), scale, visible, g, softcap)
            new_max = torch.maximum(row_max, s.amax(dim=-1))
            safe_max = new_max.masked_fill(new_max == NEG_INF, 0.0)  # row still empty: avoid -inf - -inf
            p = torch.exp(s - safe_max.unsqueeze(-1))
            rescale = torch.exp(row_max - safe_max)
            row_sum = row_sum * rescale + p.sum(dim=-1)
            o_c = o_c * rescale.unsqueeze(-1) + p @ v_h[:, :, ks:ke].to(acc)
            row_max = new_max
        nonempty = row_sum > 0
        o_c = o_c / torch.where(nonempty, row_sum, 1.0).unsqueeze(-1)
        lse_c = torch.where(nonempty, row_max + torch.log(row_sum), NEG_INF)
        out[:, qs:qe] = _ungroup(o_c, g)
        lse[:, :, qs:qe] = lse_c.view(b, h, qe - qs)
    return out, lse


def _torch_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    causal: bool,
    softcap: float | None = None,
    *,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    acc = _acc_dtype(q.dtype)
    k_h = k.transpose(1, 2)  # [B, H_kv, Sk, D]
    v_h = v.transpose(1, 2)
    delta = (dout.to(acc) * out.to(acc)).sum(dim=-1, keepdim=True)  # [B, Sq, H, 1], Δ = rowsum(dO·O)
    lse_rows = lse.to(acc).transpose(1, 2).unsqueeze(-1)  # [B, Sq, H, 1]
    dq = torch.zeros(b, sq, h, d, dtype=acc, device=q.device)
    dk = torch.zeros(b, hkv, sk, d, dtype=acc, device=q.device)
    dv = torch.zeros_like(dk)
    for qs in range(0, sq, chunk):
        qe = min(qs + chunk, sq)
        q_c = _grouped(q, hkv, qs, qe, acc)
        do_c = _grouped(dout, hkv, qs, qe, acc)
        lse_c = _grouped(lse_rows, hkv, qs, qe, acc)  # [B, H_kv, g*cq, 1]
        delta_c = _grouped(delta, hkv, qs, qe, acc)
        dq_c = torch.zeros_like(q_c)
        for ks, ke, visible in _key_chunks(mask, causal, qs, qe, sk, chunk, q.device):
            k_c = k_h[:, :, ks:ke].to(acc)
            v_c = v_h[:, :, ks:ke].to(acc)
            s, t = _masked_scores(q_c, k_c, scale, visible, g, softcap)
            p = torch.exp(s - lse_c)  # [B, H_kv, g*cq, ck]
            dv[:, :, ks:ke] += p.transpose(-1, -2) @ do_c
            dz = p * (do_c @ v_c.transpose(-1, -2) - delta_c)
            if t is not None:  # d(c·tanh(s/c))/ds = 1 - tanh²(s/c)
                dz = dz * (1.0 - t * t)
            dq_c += dz @ k_c
            dk[:, :, ks:ke] += dz.transpose(-1, -2) @ q_c
        dq[:, qs:qe] = _ungroup(dq_c, g) * scale
    return dq, (dk * scale).transpose(1, 2).contiguous(), dv.transpose(1, 2).contiguous()


def _always_available(device: torch.device, dtype: torch.dtype) -> str | None:
    return None


def torch_chunked_kernel(chunk: int = DEFAULT_CHUNK) -> AttentionKernel:
    """The pure-PyTorch kernel with ``chunk`` query rows x ``chunk`` keys per step (any device)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} is invalid: use an int >= 1 (e.g. {DEFAULT_CHUNK})")
    return AttentionKernel(
        name="torch",
        forward=functools.partial(_torch_forward, chunk=chunk),
        backward=functools.partial(_torch_backward, chunk=chunk),
        unavailable=_always_available,
        softcap=True,
    )


# ----------------------------------------------------------------------------------------------
# sdpa: PyTorch's CPU flash op (q/k/v [B, H, S, D]; GQA native; causal is top-left aligned;
# bool masks rejected, additive float masks of the query dtype accepted; an all-masked row
# returns lse 0; Sq = 0 or Sk = 0 crashes the process, so the dispatcher never calls it then)

_SDPA_OP = "_scaled_dot_product_flash_attention_for_cpu"


def _sdpa_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return f"needs CPU tensors (got device {device.type!r})"
    if not hasattr(torch.ops.aten, _SDPA_OP):
        return f"needs torch.ops.aten.{_SDPA_OP} (PyTorch >= 2.2)"
    return None


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool ``[B|1, Sq, Sk]`` -> additive ``[B|1, 1, Sq, Sk]`` (0 visible, -inf hidden)."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, NEG_INF).unsqueeze(1)


def _sdpa_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    causal: bool,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    cuda_sdpa.refuse_softcap("sdpa", softcap)
    # the op takes fp32, fp64 and bf16 / fp16 natively (fp32 accumulation inside, fp32 lse), like flash-attn
    q_t, k_t, v_t = (x.transpose(1, 2) for x in (q, k, v))
    attn_mask = None if mask is None else _additive(mask, q.dtype)
    out, lse = getattr(torch.ops.aten, _SDPA_OP)(q_t, k_t, v_t, 0.0, causal, attn_mask=attn_mask, scale=scale)
    out = out.transpose(1, 2)
    if mask is not None:
        empty = ~mask.any(dim=-1)  # [B|1, Sq]; the op reports lse 0 for these rows
        lse = lse.masked_fill(empty.unsqueeze(1), NEG_INF)
        out = out.masked_fill(empty[:, :, None, None], 0.0)
    return out, lse


def _sdpa_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    causal: bool,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cuda_sdpa.refuse_softcap("sdpa", softcap)
    do_t, q_t, k_t, v_t, o_t = (x.to(q.dtype).transpose(1, 2) for x in (dout, q, k, v, out))
    attn_mask = None if mask is None else _additive(mask, q.dtype)
    grads = getattr(torch.ops.aten, _SDPA_OP + "_backward")(
        do_t, q_t, k_t, v_t, o_t, lse.to(_acc_dtype(q.dtype)), 0.0, causal, attn_mask=attn_mask, scale=scale
    )
    dq, dk, dv = (x.transpose(1, 2) for x in grads)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# flash_attn: flash-attn's own forward / backward functions (ops/flash_kernel.py); blocks it cannot
# take (explicit masks, rectangular causal, head dims other than multiples of 8 up to 256) go to a
# fallback kernel, cuda_sdpa in the registry (the torch kernel when a softcap is set)


def _flash_takes(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> bool:
    """Whether a block runs on flash-attn: no mask, square if causal (flash-attn aligns causal
    bottom-right, the engine top-left), D % 8 == 0 and D <= 256."""
    d = q.shape[-1]
    return mask is None and (not causal or q.shape[1] == k.shape[1]) and d % 8 == 0 and d <= 256


def _other(fallback: AttentionKernel, capped: AttentionKernel, softcap: float | None) -> AttentionKernel:
    return fallback if softcap is None or fallback.softcap else capped


def _flash_forward(q, k, v, scale, mask, causal, softcap=None, *, fallback, capped):
    if _flash_takes(q, k, mask, causal):
        return flash_kernel.flash_forward(q, k, v, scale, causal, softcap)
    return _other(fallback, capped, softcap).forward(q, k, v, scale, mask, causal, softcap)


def _flash_backward(dout, q, k, v, out, lse, scale, mask, causal, softcap=None, *, fallback, capped):
    if _flash_takes(q, k, mask, causal):
        return flash_kernel.flash_backward(dout, q, k, v, out, lse, scale, causal, softcap)
    return _other(fallback, capped, softcap).backward(dout, q, k, v, out, lse, scale, mask, causal, softcap)


def _flash_head_dim(q: torch.Tensor) -> bool:
    d = q.shape[-1]
    return d % 8 == 0 and d <= 256


def _flash_varlen_takes(q: torch.Tensor) -> bool:
    return flash_kernel.has_varlen() and _flash_head_dim(q)


def _flash_band_forward(q, k, v, scale, band, softcap):
    return flash_kernel.flash_forward(q, k, v, scale, False, softcap, window=band)


def _flash_band_backward(dout, q, k, v, out, lse, scale, band, softcap):
    return flash_kernel.flash_backward(dout, q, k, v, out, lse, scale, False, softcap, window=band)


def flash_attn_kernel(
    fallback: AttentionKernel,
    capped: AttentionKernel,
    unavailable: Callable[[torch.device, torch.dtype], str | None] = flash_kernel.flash_unavailable,
) -> AttentionKernel:
    """The ``flash_attn`` kernel with ``fallback`` for the blocks flash-attn cannot take (``capped`` for
    those with a softcap when ``fallback`` has none). Tests build it with CPU kernels and the CPU
    stand-in of flash-attn."""
    extra = dict(fallback=fallback, capped=capped)
    return AttentionKernel(
        name="flash_attn",
        forward=functools.partial(_flash_forward, **extra),
        backward=functools.partial(_flash_backward, **extra),
        unavailable=unavailable,
        softcap=True,
        varlen=Varlen(
            flash_kernel.flash_varlen_forward, flash_kernel.flash_varlen_backward, _flash_varlen_takes
        ),
        band=Band(_flash_band_forward, _flash_band_backward, _flash_head_dim),
    )


_CUDA_SDPA = AttentionKernel(
    name="cuda_sdpa",
    forward=cuda_sdpa.forward,
    backward=cuda_sdpa.backward,
    unavailable=cuda_sdpa.unavailable,
)
_TORCH = torch_chunked_kernel()

KERNELS: dict[str, AttentionKernel] = {
    "flash_attn": flash_attn_kernel(_CUDA_SDPA, _TORCH),
    "cuda_sdpa": _CUDA_SDPA,
    "sdpa": AttentionKernel(
        name="sdpa", forward=_sdpa_forward, backward=_sdpa_backward, unavailable=_sdpa_unavailable
    ),
    "torch": _TORCH,
}
"""Registered kernels, in ``auto`` preference order (fastest exact first)."""


# ----------------------------------------------------------------------------------------------
# dispatch


def available_kernels(device: torch.device | str, dtype: torch.dtype, softcap: bool = False) -> list[str]:
    """Kernel names that can run for ``(device, dtype)`` (and apply a softcap, if asked), in ``auto`` order."""
    device = torch.device(device)
    return [
        name
        for name, kern in KERNELS.items()
        if kern.unavailable(device, dtype) is None and (kern.softcap or not softcap)
    ]


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


@functools.cache
def _log_auto(device_type: str, dtype: torch.dtype, capped: bool, name: str) -> None:
    """Say once per (device type, dtype, softcap) which kernel ``auto`` runs as."""
    logger.info(
        "ds_seqpar: kernel 'auto' runs as %r on %s %s%s (set sequence_parallel.kernel to choose)",
        name, device_type, dtype, " with softcap" if capped else "",
    )  # fmt: skip


def _resolve(
    kernel: str | AttentionKernel, device: torch.device, dtype: torch.dtype, softcap: float | None = None
) -> AttentionKernel:
    capped = softcap is not None
    if isinstance(kernel, AttentionKernel):
        kern = kernel
    elif kernel == "auto":
        chosen = available_kernels(device, dtype, capped)[0]
        _log_auto(device.type, dtype, capped, chosen)
        return KERNELS[chosen]
    elif kernel in KERNELS:
        kern = KERNELS[kernel]
    else:
        raise ValueError(f"unknown kernel={kernel!r}; valid names: auto, {', '.join(KERNELS)}")
    reason = kern.unavailable(device, dtype)
    if reason is None and capped and not kern.softcap:
        reason = f"cannot apply softcap={softcap} (attention logit soft-capping)"
    if reason is not None:
        valid = ", ".join(["auto", *available_kernels(device, dtype, capped)])
        raise ValueError(f"kernel={kern.name!r} {reason}; valid here ({device.type}, {dtype}): {valid}")
    return kern


def kernel_for(
    kernel: str | AttentionKernel,
    device: torch.device | str,
    dtype: torch.dtype,
    softcap: float | None = None,
) -> AttentionKernel:
    """The kernel object ``kernel`` (a name, ``"auto"`` or an :class:`AttentionKernel`) runs as; ValueError
    if it cannot run (resolve once per call, then pass the object to the block functions)."""
    return _resolve(kernel, torch.device(device), dtype, check_softcap(softcap))


def resolve_kernel(
    name: str, device: torch.device | str, dtype: torch.dtype, softcap: float | None = None
) -> str:
    """The concrete kernel ``name`` runs as (``"auto"`` -> fastest available that applies ``softcap``);
    ValueError if it cannot run."""
    return _resolve(name, torch.device(device), dtype, check_softcap(softcap)).name


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

    Returns:
        ``(out [B, Sq, H, D], lse [B, H, Sq])``: out in ``out_dtype``, lse in the acc dtype (fp64 for
        fp64 inputs, else fp32); rows that see no key have out 0 and lse -inf.
    """
    mask = _validate(q, k, v, mask, causal)
    softcap = check_softcap(softcap)
    kern = _resolve(kernel, q.device, q.dtype, softcap)
    (b, sq, h, d), sk = q.shape, k.shape[1]
    acc = _acc_dtype(q.dtype)
    if sq == 0 or sk == 0:
        return q.new_zeros(b, sq, h, d, dtype=out_dtype or acc), q.new_full((b, h, sq), NEG_INF, dtype=acc)
    out, lse = kern.forward(q, k, v, d**-0.5 if scale is None else scale, mask, causal, softcap)
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one (query block, key block) pair given the FINAL out / lse of the query rows.

    Args:
        dout, out: ``[B, Sq, H, D]`` (any float dtype); lse: ``[B, H, Sq]``; q, k, v, scale, mask,
            causal, kernel, softcap: as in :func:`block_attn_forward`.
        grad_dtype: dtype of the gradients (default: the acc dtype, for summing over blocks).
        inert: the caller guarantees that no row has lse = -inf (or made such rows inert with
            ``ops.merge.inert_empty_rows``): the masked copy of ``dout`` is skipped.

    Returns:
        ``dq [B, Sq, H, D]``, ``dk, dv [B, Sk, H_kv, D]`` (summed over each GQA group) in
        ``grad_dtype``. Summing them over all key blocks (dq) / query blocks (dk, dv) gives the full
        gradient.
    """
    mask = _validate(q, k, v, mask, causal)
    softcap = check_softcap(softcap)
    kern = _resolve(kernel, q.device, q.dtype, softcap)
    (b, sq, h, d), (_, sk, hkv, _) = q.shape, k.shape
    if dout.shape != q.shape or out.shape != q.shape or lse.shape != (b, h, sq):
        raise ValueError(
            f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must be {tuple(q.shape)} and lse "
            f"{tuple(lse.shape)} must be {(b, h, sq)} ([B, H, Sq])"
        )
    acc = grad_dtype or _acc_dtype(q.dtype)
    if sq == 0 or sk == 0:
        return (
            q.new_zeros(b, sq, h, d, dtype=acc),
            k.new_zeros(b, sk, hkv, d, dtype=acc),
            k.new_zeros(b, sk, hkv, d, dtype=acc),
        )
    if not inert:  # rows that saw no key anywhere: inert instead of NaN (unconditionally: no host sync)
        dout, lse = inert_empty_rows(dout, lse)
    grads = kern.backward(dout, q, k, v, out, lse, d**-0.5 if scale is None else scale, mask, causal, softcap)
    return tuple(g.to(acc) for g in grads)
