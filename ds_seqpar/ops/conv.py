"""Causal depthwise conv1d over a contiguous run of tokens, with the inputs before the run given (the halo).

Legend: x ``[B, S, C]`` (tokens, channels), weight ``[C, K]`` (one kernel per channel, K taps; the
layout of ``nn.Conv1d(C, C, K, groups=C).weight.squeeze(1)``), history ``[B, K - 1, C]``: the K - 1
inputs just before x in sequence order (zeros at the sequence start; ``comm/halo.py`` fetches them
under sequence parallelism).

    y_t = bias + Σ_{j=0}^{K-1} weight[:, j] · x_{t - (K - 1) + j}

This is what HF's ``causal_conv1d_fn`` computes (a zero-padded depthwise conv cut to S outputs), in
the weight's dtype, then the activation (if any), then the cast back to x's dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    history: torch.Tensor | None = None,
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Depthwise causal conv of a run ``x [B, S, C]`` -> ``[B, S, C]`` in x's dtype; ``activation`` (e.g.
    SiLU) is applied in the weight's dtype before the cast back, as HF does."""
    if x.dim() != 3:
        raise ValueError(f"causal_conv1d takes x [B, S, C], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        raise ValueError(f"weight must be [C, K] with C = {x.shape[2]}, got shape {tuple(weight.shape)}")
    width = weight.shape[1] - 1
    if history is None:
        history = x.new_zeros(x.shape[0], width, x.shape[2])
    if tuple(history.shape) != (x.shape[0], width, x.shape[2]):
        raise ValueError(
            f"history must be [B, K - 1, C] = {(x.shape[0], width, x.shape[2])}, got shape {tuple(history.shape)}"
        )
    full = torch.cat([history, x], dim=1).transpose(1, 2).to(weight.dtype)  # [B, C, K - 1 + S]
    y = F.conv1d(full, weight.unsqueeze(1), bias, groups=x.shape[2])
    if activation is not None:
        y = activation(y)
    return y.transpose(1, 2).to(x.dtype)
