"""Input checks of the delta rule's gates (on top of ``ops/linear/checks.py``), and its heads-first layout."""

from __future__ import annotations

import torch

from ds_seqpar.ops.linear.checks import check_tensor

__all__ = ["check_gates", "gate_heads_first"]


def check_gates(q: torch.Tensor, beta: torch.Tensor, log_decay: torch.Tensor | None) -> None:
    """beta ``[B, S, H]`` and a log decay None / ``[B, S, H]`` / ``[B, S, H, d_k]``, finite and <= 0."""
    b, s, h, d_k = q.shape
    if not isinstance(beta, torch.Tensor):
        raise ValueError(f"beta must be a [B, S, H] tensor, got {type(beta).__name__}")
    check_tensor("beta", beta, (b, s, h), q.device)
    if log_decay is None:
        return
    if not isinstance(log_decay, torch.Tensor):
        raise ValueError(f"log_decay must be a tensor or None, got {type(log_decay).__name__}")
    if tuple(log_decay.shape) not in ((b, s, h), (b, s, h, d_k)):
        raise ValueError(
            f"log_decay shape {tuple(log_decay.shape)} must be [B, S, H] = {(b, s, h)} (gated DeltaNet) "
            f"or [B, S, H, d_k] = {(b, s, h, d_k)} (KDA, per key channel)"
        )
    check_tensor("log_decay", log_decay, tuple(log_decay.shape), q.device)
    bad = ~torch.isfinite(log_decay) | (log_decay > 0)
    if bool(bad.any()):
        raise ValueError(
            f"log_decay must be finite and <= 0 (log of a decay in (0, 1]), got an entry {log_decay[bad][0].item():g}"
        )


def gate_heads_first(x: torch.Tensor | None, acc: torch.dtype) -> torch.Tensor | None:
    """``[B, S, H, ...]`` -> ``[B, H, S, ...]`` in the acc dtype; a ``[B, S, H]`` gate gets a trailing 1."""
    if x is None:
        return None
    if x.dim() == 3:
        x = x.unsqueeze(-1)
    return x.to(acc).transpose(1, 2)
