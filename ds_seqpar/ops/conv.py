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

from collections.abc import Callable, Sequence

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


def causal_conv1d_runs(
    x: torch.Tensor,
    runs: Sequence[tuple[int, int]],
    halo: torch.Tensor,
    conv: torch.nn.Conv1d | tuple[torch.Tensor, torch.Tensor | None],
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The causal conv of several runs of ``x [B, n, C]`` (row ranges ``runs``) in ONE conv call.

    ``halo [B, len(runs) · (K - 1), C]``: the K - 1 inputs before each run. The runs are laid out as
    ``[halo_0 | run_0 | halo_1 | run_1 | ...]``, so each output window sees only its own run and halo.
    ``conv``: the model's depthwise ``nn.Conv1d`` (any zero padding p; called as a module, so hooks
    such as ZeRO-3's parameter gathering run once per call on every rank, whatever its number of runs)
    or ``(weight [C, K], bias)``. Returns ``[B, n, C]`` in x's dtype.
    """
    module = isinstance(conv, torch.nn.Conv1d)
    weight = conv.weight if module else conv[0]
    width = (conv.kernel_size[0] if module else weight.shape[-1]) - 1
    parts, starts = [], []
    for j, (a, e) in enumerate(runs):
        parts += [halo[:, j * width : (j + 1) * width], x[:, a:e]]
        starts.append(sum(p.shape[1] for p in parts[:-1]))  # where run j begins in the layout
    if not parts:
        return x.new_zeros(x.shape[0], 0, x.shape[2])
    full = torch.cat(parts, dim=1).transpose(1, 2).to(weight.dtype)  # [B, C, L]
    if module:
        y, pad = conv(full), conv.padding[0]
    else:
        y, pad = F.conv1d(full, weight.unsqueeze(1), conv[1], groups=x.shape[2]), 0
    if activation is not None:
        y = activation(y)
    # the window ending at layout index i is output i + pad - width
    outs = [
        y[..., s + pad - width : s + pad - width + (e - a)] for s, (a, e) in zip(starts, runs, strict=True)
    ]
    return torch.cat(outs, dim=-1).transpose(1, 2).to(x.dtype)
