"""Input checks and layout helpers shared by the recurrent ops (linear attention, the delta rule)."""

from __future__ import annotations

import torch

from ds_seqpar.ops.precision import accumulation_dtype

__all__ = ["check_chunk_size", "check_qkv", "check_tensor", "heads_first", "initial_state", "log_decay_bh"]


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, S, H, d], got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if k.shape != q.shape:
        raise ValueError(
            f"k shape {tuple(k.shape)} must equal q shape {tuple(q.shape)} ([B, S, H, d_k] for both)"
        )
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"v shape {tuple(v.shape)} must match q in [B, S, H] = {tuple(q.shape[:3])}; only d_v may differ"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v dtypes must match, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def check_tensor(
    name: str, x: torch.Tensor, shape: tuple[int, ...], device: torch.device, ref: str = "q"
) -> None:
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} shape {tuple(x.shape)} must be {shape}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but {ref} is on {device}")


def check_chunk_size(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")


def log_decay_bh(q: torch.Tensor, log_decay: torch.Tensor | None) -> torch.Tensor | None:
    """Validated log decay as ``[B|1, H, S, d_k|1]`` in the acc dtype (None for no decay)."""
    if log_decay is None:
        return None
    b, s, h, d_k = q.shape
    if not isinstance(log_decay, torch.Tensor):
        raise ValueError(f"log_decay must be a tensor or None, got {type(log_decay).__name__}")
    if tuple(log_decay.shape) not in ((h,), (b, s, h), (b, s, h, d_k)):
        raise ValueError(
            f"log_decay shape {tuple(log_decay.shape)} must be [H] = {(h,)} (scalar per head), "
            f"[B, S, H] = {(b, s, h)} (scalar per token and head, Mamba2) "
            f"or [B, S, H, d_k] = {(b, s, h, d_k)} (per-token gate)"
        )
    if not log_decay.is_floating_point():
        raise ValueError(f"log_decay must be a floating-point tensor, got dtype {log_decay.dtype}")
    if log_decay.device != q.device:
        raise ValueError(f"log_decay is on {log_decay.device} but q is on {q.device}")
    bad = ~torch.isfinite(log_decay) | (log_decay > 0)
    if bool(bad.any()):
        worst = log_decay[bad].flatten()[0].item()
        raise ValueError(
            f"log_decay must be finite and <= 0 (log of a decay in (0, 1]), got an entry {worst:g}"
        )
    g = log_decay.to(accumulation_dtype(q.dtype))
    if g.dim() == 1:
        return g.view(1, h, 1, 1).expand(1, h, s, 1)
    if g.dim() == 3:
        return g.transpose(1, 2).unsqueeze(-1)
    return g.transpose(1, 2)


def heads_first(x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``[B, S, H, d]`` -> ``[B, H, S, d]`` in the acc dtype."""
    return x.to(acc).transpose(1, 2)


def initial_state(
    q: torch.Tensor, v: torch.Tensor, state: torch.Tensor | None, acc: torch.dtype
) -> torch.Tensor | None:
    """A given initial state ``[B, H, d_k, d_v]`` checked and in the acc dtype (None: zeros)."""
    if state is None:
        return None
    b, _, h, d_k = q.shape
    check_tensor("initial_state", state, (b, h, d_k, v.shape[-1]), q.device)
    return state.to(acc)
