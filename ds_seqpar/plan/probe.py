"""The token-wise part of a Llama-style decoder as plain tensor ops, for the local profile
(``plan/profile.py``): one layer without its attention core, and the LM head with its loss.

Shapes: x ``[1, n, E]``; q ``[1, n, H·D]``, k / v ``[1, n, H_kv·D]``; the MLP ``[1, n, I]``; logits in
chunks of 1024 tokens ``[1024, V]`` (fp32, as ``ds_seqpar.loss`` computes them). The attention core is
replaced by an elementwise stand-in of the same output shape, so the layer's projections, norms, RoPE,
MLP and residuals run forward and backward as in the model, without the part the attention probe times.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ds_seqpar.plan.compute import ModelDims

__all__ = ["decoder_layer_step", "head_step"]

LOSS_CHUNK = 1024


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """HF Llama's RMSNorm: in fp32, scaled by the weight."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, d: int) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin per head of ``d``: x ``[1, n, h·d]``."""
    shaped = x.unflatten(-1, (-1, d))
    half = shaped.shape[-1] // 2
    rotated = torch.cat((-shaped[..., half:], shaped[..., :half]), dim=-1)
    return (shaped * cos[:, :, None] + rotated * sin[:, :, None]).flatten(-2)


def decoder_layer_step(dims: ModelDims, tokens: int, dtype: Any, device: str) -> Callable[[], None]:
    """A closure that runs one layer (attention core excluded) forward and backward on ``tokens`` tokens."""
    e, d, i = dims.hidden, dims.head_dim, dims.intermediate
    h, kv = dims.heads, dims.kv_heads

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, dtype=dtype, device=device) * shape[0] ** -0.5).requires_grad_()

    wq, wk, wv, wo = weight(e, h * d), weight(e, kv * d), weight(e, kv * d), weight(h * d, e)
    wg, wu, wd = weight(e, i), weight(e, i), weight(i, e)
    n1, n2 = (torch.ones(e, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    x = torch.randn(1, tokens, e, dtype=dtype, device=device, requires_grad=True)
    angle = torch.arange(tokens, device=device)[:, None] * torch.ones(d, device=device)
    cos, sin = (f(angle).to(dtype)[None] for f in (torch.cos, torch.sin))

    def step() -> None:
        a = _rms(x, n1)
        q, k, v = _rope(a @ wq, cos, sin, d), _rope(a @ wk, cos, sin, d), a @ wv
        core = q + (k + v).unflatten(-1, (kv, d)).repeat_interleave(h // kv, dim=-2).flatten(-2)
        y = x + core @ wo
        b = _rms(y, n2)
        out = y + (F.silu(b @ wg) * (b @ wu)) @ wd
        out.backward(torch.ones_like(out))

    return step


def head_step(dims: ModelDims, tokens: int, dtype: Any, device: str) -> Callable[[], None]:
    """A closure that runs the final norm, the LM head and the token loss over ``tokens`` tokens (chunks of
    1024, fp32 logits), forward and backward."""
    e, v = dims.hidden, dims.vocab
    w = (torch.randn(e, v, dtype=dtype, device=device) * e**-0.5).requires_grad_()
    norm = torch.ones(e, dtype=dtype, device=device, requires_grad=True)
    x = torch.randn(tokens, e, dtype=dtype, device=device, requires_grad=True)
    labels = torch.randint(0, v, (tokens,), device=device)

    def step() -> None:
        hidden = _rms(x, norm)
        total = sum(
            F.cross_entropy(
                (hidden[s : s + LOSS_CHUNK] @ w).float(), labels[s : s + LOSS_CHUNK], reduction="sum"
            )
            for s in range(0, tokens, LOSS_CHUNK)
        )
        total.backward()

    return step
