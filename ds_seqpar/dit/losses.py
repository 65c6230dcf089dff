"""Training targets of the two denoising objectives (docs/dit.md "Training").

``flow_matching(latents, noise, sigmas)``: rectified flow (SD3, Flux): x_t = (1 - σ)·x_0 + σ·noise, the model
predicts the velocity noise - x_0. ``epsilon(scheduler, latents, noise, timesteps)``: DDPM-style noise
prediction (PixArt, DiT): x_t from the scheduler's ``add_noise``, the model predicts the noise. Both return
``(noisy, target)`` shaped like ``latents``; shapes ``[B, C, H, W]`` or Flux's packed ``[B, N, C]``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["epsilon", "flow_matching"]


def _per_row(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    values = values.to(like.dtype).reshape(-1)
    if values.numel() != like.shape[0]:
        raise ValueError(
            f"one sigma / timestep per batch row is needed: got {values.numel()} for batch {like.shape[0]}"
        )
    return values.view(-1, *([1] * (like.dim() - 1)))


def flow_matching(
    latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, noise - latents)`` with ``x_t = (1 - σ)·latents + σ·noise``; ``sigmas [B]`` in [0, 1]."""
    sigma = _per_row(sigmas, latents)
    return (1 - sigma) * latents + sigma * noise, noise - latents


def epsilon(
    scheduler: Any, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scheduler.add_noise(latents, noise, timesteps), noise)``; ``timesteps [B]`` integers."""
    return scheduler.add_noise(latents, noise, timesteps), noise
