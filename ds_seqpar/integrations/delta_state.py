"""The decoding state of conv + delta-rule layers (gated DeltaNet) left by the sharded prefill, and one decoding
step from it (docs/inference_recurrent.md).

Legend: P SP ranks, B batch, n this rank's prompt rows, C conv channels (q, k, v packed), K the conv width,
H value heads, H_k key heads, d_k / d_v head dims, S0 prompt tokens.

Prefill (``keep_state``): the last K - 1 pre-conv rows of the prompt (global indices S0 - K + 1 .. S0 - 1, on
whichever ranks hold them) and the recurrent state after token S0 - 1 (on the ring rank of the chain's last
piece, each Ulysses rank its heads) reach every SP rank with ONE all-reduce of a zero-filled float32 buffer of
``B (C (K - 1) + H d_k d_v)`` elements. Decoding (``conv_step``, ``delta_step``): every rank steps its replica
with the layer's own per-token math, nothing communicated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_seqpar.integrations.sharded_cache import ShardedCache

__all__ = ["DeltaState", "conv_step", "delta_step", "keep_state", "neutral_padding"]


@dataclass
class DeltaState:
    """One layer's decoding state, the same on every SP rank: ``conv [B, C, K - 1]`` the last pre-conv rows (oldest
    first, the input's dtype), ``recurrent [B, H, d_k, d_v]`` float32."""

    conv: torch.Tensor
    recurrent: torch.Tensor

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))


def _conv_rows(mixed: torch.Tensor, cache: ShardedCache, width: int) -> torch.Tensor:
    """``[B, C, width]``: this rank's rows among the prompt's last ``width`` (global order), zeros elsewhere."""
    rows = mixed.new_zeros(mixed.shape[0], mixed.shape[2], width)
    first = cache.seq_len - width
    at = torch.nonzero(cache.kept & (cache.order >= first)).flatten()
    if at.numel():
        rows[:, :, (cache.order[at] - first).to(mixed.device)] = mixed[:, at.to(mixed.device)].transpose(1, 2)
    return rows


def keep_state(cache: ShardedCache, layer: int, mixed: torch.Tensor, width: int, share: torch.Tensor) -> None:
    """Prefill: store layer ``layer``'s ``DeltaState`` in ``cache.states`` from this rank's pre-conv rows
    ``mixed [B, n, C]`` (rows in ``cache.order``) and its share of the final state ``[B, H, d_k, d_v]``
    (``delta_rule_attention(final_state=True)``); one all-reduce over ``sp``."""
    if layer in cache.states:
        raise RuntimeError(
            f"ds_seqpar prefill: layer {layer} stored its recurrent state twice in one forward"
        )
    rows = _conv_rows(mixed, cache, width)
    buf = torch.cat([rows.float().flatten(), share.float().flatten()])
    if cache.mesh.sp_size > 1:
        dist.all_reduce(buf, group=cache.mesh.group("sp"))
    conv = buf[: rows.numel()].view(rows.shape).to(mixed.dtype)
    cache.states[layer] = DeltaState(conv, buf[rows.numel() :].view(share.shape).to(share.dtype))


def neutral_padding(
    cache: ShardedCache, beta: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill: ``beta [B, n, H]`` and ``g [B, n, H(, d_k)]`` zeroed at the padding rows past the prompt, which
    then leave the recurrent state as token S0 - 1 left it (their outputs are dropped)."""
    keep = cache.kept.to(beta.device)
    beta = beta * keep.view(1, -1, 1).to(beta.dtype)
    g = g * keep.view(1, -1, *([1] * (g.dim() - 2))).to(g.dtype)
    return beta, g


def conv_step(
    state: DeltaState,
    x: torch.Tensor,
    conv: torch.nn.Conv1d,
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """One token's causal depthwise conv: ``x [B, 1, C]`` after the kept rows -> ``activation(conv) [B, 1, C]``;
    the oldest row leaves the state, ``x`` joins it."""
    window = torch.cat([state.conv, x.transpose(1, 2).to(state.conv.dtype)], dim=2)
    weight = conv.weight
    out = F.conv1d(window.to(weight.dtype), weight, conv.bias, groups=window.shape[1])
    state.conv = window[:, :, 1:]
    return activation(out).transpose(1, 2).to(x.dtype)


def delta_step(
    state: DeltaState,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One token of the gated delta rule from the kept state: ``q, k [B, 1, H, d_k]`` (normalised, repeated to
    the value heads), ``v [B, 1, H, d_v]``, ``beta [B, 1, H]``, ``g [B, 1, H]`` (or per channel ``[B, 1, H,
    d_k]``) -> ``out [B, 1, H, d_v]`` float32; the state advances by one token."""
    q, k, v, beta, g = (x[:, 0].float() for x in (q, k, v, beta, g))
    decay = g.exp()
    s = state.recurrent * (decay[..., None] if decay.dim() == 3 else decay[..., None, None])
    delta = (v - (s * k[..., None]).sum(dim=-2)) * beta[..., None]
    s = s + k[..., None] * delta[..., None, :]
    state.recurrent = s
    return ((s * (q * scale)[..., None]).sum(dim=-2))[:, None]
