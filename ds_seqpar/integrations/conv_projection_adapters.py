"""Attention projections that mix neighbouring tokens, under sequence parallelism (ZAYA's CCA).

ZAYA's ``ZayaCCAProjection`` mixes q and k over the sequence with two chained causal convolutions
(kernels K0 and K1, so each output needs the K0 + K1 - 2 projected rows before it) and builds half of each
value head from the PREVIOUS token (a one-token shift). On a shard, the rows before each run of a rank's
tokens live on other ranks: both get them with a halo exchange (``comm/halo.py``: the last rows of each
run sent to the rank whose run follows, zeros before position 0, as the model's own zero padding and
its zero previous state). Everything else (projections, residual paths, norms) is per token and stays
local. Registered as a recurrent layer (``integrations/recurrent_layers.py``): a sequence mixer that is
not attention.

Bytes per rank and layer (forward; the backward returns as many): ``(K0 + K1 - 2) · (H + H_kv) · d`` for the
q/k halo plus ``E`` (one hidden row) for the value shift, per run whose predecessor is on another rank.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_seqpar.comm.halo import halo_exchange
from ds_seqpar.integrations.recurrent_adapters import _context, _real_tokens, _zero_padding
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.parallel.agree import check_same_inputs
from ds_seqpar.parallel.delta_scan import conv_halo_plan
from ds_seqpar.parallel.linear_scan import SAME_SCAN_SHARDS


def runs_with_halo(
    x: torch.Tensor, width: int, mesh: SeqParMesh
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """This rank's rows ``x [B, n, C]`` laid out as ``[halo_0 | run_0 | halo_1 | run_1 | ...]`` (``width`` rows
    before each run; zeros before position 0), and where each run sits in that layout ``(start, length)``.
    One tensor, so a module applied to it runs ONCE per call on every rank, whatever its number of runs
    (ZeRO-3 gathers a module's weights per call: a count that differs between ranks would hang)."""
    plan = conv_halo_plan(mesh, x.shape[1], width)
    check_same_inputs(mesh, "runs_with_halo", ("x",), (x,), (width,), SAME_SCAN_SHARDS, ("halo",))
    halo = halo_exchange(x, plan, mesh.group("sp"), mesh.members["sp"], mesh.coords.sp_rank, mesh.comm_stats)
    parts, spans, at = [], [], 0
    for j, (a, e) in enumerate(plan.runs):
        parts += [halo[:, j * width : (j + 1) * width], x[:, a:e]]
        spans.append((at + width, e - a))
        at += width + e - a
    return torch.cat(parts, dim=1), spans


def _rows(y: torch.Tensor, spans: list[tuple[int, int]], shift: int) -> torch.Tensor:
    """The runs' rows of ``y [B, L, C]`` computed on the halo layout, each taken ``shift`` rows earlier."""
    return torch.cat([y[:, a - shift : a - shift + n] for a, n in spans], dim=1)


def zaya_cca_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: Any = None,
    conv_mask: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ZayaCCAProjection.forward`` (no cache): q/k projections, their two causal convolutions over the
    whole sequence, the residual paths, and values half from this token, half from the previous one.
    Returns q, k, v ``[B, n, heads, d]`` as the module does."""
    ctx = _context(self, kwargs, cache)
    mesh = ctx.mesh
    hidden_states = _zero_padding(_real_tokens(ctx, hidden_states.shape[0]), hidden_states)
    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    queries, keys = self.q_proj(hidden_states), self.k_proj(hidden_states)
    query_residual = queries.view(shape)
    key_residual = keys.view(shape).repeat_interleave(self.num_key_value_groups, dim=2)
    query_residual = (query_residual + key_residual) * 0.5
    key_residual = query_residual.view(*shape[:-2], -1, self.num_key_value_groups, self.head_dim).mean(dim=-2)
    width = self.conv_kernel_size  # two valid convolutions: output o sees inputs o .. o + width
    laid, spans = runs_with_halo(torch.cat([queries, keys], dim=-1), width, mesh)
    mixed = _rows(
        self.conv_qk_grouped(self.conv_qk_depthwise(laid.transpose(1, 2))).transpose(1, 2), spans, width
    )
    split = query_residual.shape[-2] * query_residual.shape[-1]
    query = mixed[..., :split].view(shape) + query_residual
    key = mixed[..., split:].view(shape) + key_residual
    laid, spans = runs_with_halo(hidden_states, 1, mesh)
    delayed = _rows(self.v_proj_delayed(laid), spans, 1)  # each token takes its predecessor's projection
    value = torch.cat([self.v_proj_current(hidden_states), delayed], dim=-1).view(shape)
    return query, key, value
