"""Sequence-parallel forwards of the diagonal recurrent layers of HF models (registered in ``recurrent_layers.py``).

Each forward mirrors the HF layer's training path (no cache) and keeps every weight of the module;
what spans the sequence goes to ``parallel/diagonal_scan.py`` (docs/delta.md "Diagonal recurrences"):

    RecurrentGemmaRecurrentBlock   the causal conv1d gets its K - 1 halo rows (``sharded_causal_conv1d``)
    RecurrentGemmaRglru            h_t = a_t ⊙ h_{t-1} + sqrt(1 - a_t²) ⊙ (i_t ⊙ x_t), a_t = 0 and the
                                   multiplier 1 where position_ids == 0 (HF's reset): ``diagonal_recurrence``
    RwkvSelfAttention              token shift (one halo row) + RWKV-4's WKV: ``wkv`` (numerator and
                                   denominator as one exclusive diagonal recurrence, exponents shifted by
                                   the sequence's max key: one all-reduce)
    RwkvFeedForward                token shift (one halo row); the rest is per token
    xLSTMLayer                     the mLSTM (``parallel/mlstm_scan.mlstm_attention``: the max-stabiliser
                                   and the C / n state scanned over the ring); gates, norms, output per token
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

from ds_seqpar.integrations.hf_model import UnsupportedModelError
from ds_seqpar.integrations.recurrent_adapters import _context
from ds_seqpar.parallel.delta_scan import sharded_causal_conv1d
from ds_seqpar.parallel.diagonal_scan import diagonal_recurrence, sequence_extremes, token_shift, wkv
from ds_seqpar.parallel.mlstm_scan import mlstm_attention

# -- RecurrentGemma (Griffin): the recurrent block and its RG-LRU ----------------------------------


def recurrent_gemma_block_forward(
    self: torch.nn.Module,
    input_states: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: Any = None,
    use_cache: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``RecurrentGemmaRecurrentBlock.forward`` without a cache: y = act(linear_y(x)); the causal conv1d
    of linear_x(x) with its halo; the (routed) RG-LRU; linear_out(lru * y). ``[B, n, E]`` -> ``[B, n, E]``."""
    ctx = _context(self, {**kwargs, "use_cache": use_cache}, kwargs.get("cache"))
    y_branch = self.act_fn(self.linear_y(input_states))
    x_branch = sharded_causal_conv1d(self.linear_x(input_states), self.conv_1d, mesh=ctx.mesh)
    x_branch = self.rg_lru(x_branch, position_ids)
    return self.linear_out(x_branch * y_branch), None


def _gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """sigmoid of the block-diagonal gate: ``x [B, n, H, W]`` per head ``x_h W_h + b_h`` -> ``[B, n, H·W]``."""
    return torch.sigmoid(torch.einsum("bnhi,hij->bnhj", x, weight) + bias).flatten(2)


def rglru_forward(
    self: torch.nn.Module, activations: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """``RecurrentGemmaRglru.forward``: gates from the block-diagonal projections, log a_t = -8 r_t softplus(Λ),
    the input scaled by sqrt(1 - a_t²) (HF's bounded-gradient sqrt) except at resets; the recurrence over
    the whole sequence in float32 (``diagonal_recurrence``), cast back. ``[B, n, W]`` -> ``[B, n, W]``."""
    ctx = _context(self, {}, None)
    b, n, _ = activations.shape
    heads = activations.reshape(b, n, self.num_attention_heads, self.block_width)
    input_gate = _gate(heads, self.input_gate_weight, self.input_gate_bias)
    recurrent_gate = _gate(heads, self.recurrent_gate_weight, self.recurrent_gate_bias)
    log_a = -8.0 * recurrent_gate * F.softplus(self.recurrent_param)
    reset = position_ids[:, :, None] == 0
    bounded_sqrt = sys.modules[type(self).__module__].SqrtBoundDerivative.apply
    multiplier = bounded_sqrt(1 - torch.exp(2 * log_a))
    multiplier = reset + ~reset * multiplier
    normalized = activations * input_gate * multiplier.type(activations.dtype)
    a = torch.exp(log_a) * ~reset
    out = diagonal_recurrence(normalized.float(), a.float(), mesh=ctx.mesh)
    ctx.record(self)
    return out.to(activations.dtype)


# -- RWKV (v4): time mixing (WKV) and channel mixing, each after a token shift ------------------------

# float64 exponents below this underflow: a key this far below the sequence's max would lose the token
WKV_EXPONENT_FLOOR = -700.0


def _mix(hidden: torch.Tensor, shifted: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """RWKV's time mix ``hidden · ratio + shifted · (1 - ratio)``, ``[B, n, E]``."""
    return hidden * ratio + shifted * (1 - ratio)


def rwkv_attention_forward(
    self: torch.nn.Module, hidden: torch.Tensor, state: Any = None, use_cache: bool = False
) -> tuple[torch.Tensor, None]:
    """``RwkvSelfAttention.forward`` without a state: key / value / receptance from the token-shifted mix,
    the WKV over the whole sequence, ``output(sigmoid(r) · wkv)``. ``[B, n, E]`` -> ``[B, n, E]``.
    Refused (identically on every rank, after the all-reduce of the key range) when a key lies more than
    700 nats below the sequence's max key plus time_first: float64 could not represent its weight."""
    ctx = _context(self, {"use_cache": use_cache}, state)
    shifted = token_shift(hidden, mesh=ctx.mesh)
    key = self.key(_mix(hidden, shifted, self.time_mix_key))
    value = self.value(_mix(hidden, shifted, self.time_mix_value))
    receptance = torch.sigmoid(self.receptance(_mix(hidden, shifted, self.time_mix_receptance)))
    top, low = sequence_extremes(key.float(), mesh=ctx.mesh)
    floor = (low - top + self.time_first.detach().double().clamp(max=0)).min().item()
    if floor < WKV_EXPONENT_FLOOR:
        raise UnsupportedModelError(
            f"{type(self).__name__} (layer {self.layer_id}): its keys span {-floor:.0f} nats over the sequence; "
            f"ds_seqpar's WKV shifts every exponent by the sequence's max key and computes in float64, which "
            f"holds {-WKV_EXPONENT_FLOOR:.0f}: this batch cannot run under ds_seqpar"
        )
    out = wkv(self.time_decay, self.time_first, key.float(), value, shift=top, mesh=ctx.mesh)
    ctx.record(self)
    return self.output(receptance * out.to(value.dtype)), None


def rwkv_feed_forward_forward(
    self: torch.nn.Module, hidden: torch.Tensor, state: Any = None
) -> tuple[torch.Tensor, None]:
    """``RwkvFeedForward.forward`` without a state: sigmoid(r) · value(relu(key(mix))²) with the token shift
    from the previous rank. ``[B, n, E]`` -> ``[B, n, E]``."""
    ctx = _context(self, {}, state)
    shifted = token_shift(hidden, mesh=ctx.mesh)
    key = torch.square(torch.relu(self.key(_mix(hidden, shifted, self.time_mix_key))))
    receptance = torch.sigmoid(self.receptance(_mix(hidden, shifted, self.time_mix_receptance)))
    return receptance * self.value(key), None


# -- xLSTM (mLSTM blocks) -------------------------------------------------------------------------


def _xlstm_inputs(self: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v, the output-gate and the soft-capped input / forget gate pre-activations of ``x [B, n, E]``."""
    cfg, soft_cap = self.config, sys.modules[type(self).__module__].soft_cap
    if cfg.weight_mode == "single":
        q, k, v, o = self.q(x), self.k(x), self.v(x), self.ogate_preact(x)
        i = soft_cap(self.igate_preact(x), cap_value=cfg.gate_soft_cap)
        f = soft_cap(self.fgate_preact(x), cap_value=cfg.gate_soft_cap)
        return q, k, v, o, i, f
    q, k, v, o = torch.tensor_split(
        self.qkv_opreact(x), (self.qk_dim, 2 * self.qk_dim, 2 * self.qk_dim + self.v_dim), dim=-1
    )
    i, f = torch.tensor_split(
        soft_cap(self.ifgate_preact(x), cap_value=cfg.gate_soft_cap), (cfg.num_heads,), dim=-1
    )
    return q, k, v, o, i, f


def xlstm_layer_forward(
    self: torch.nn.Module, x: torch.Tensor, state: Any = None
) -> tuple[torch.Tensor, None]:
    """``xLSTMLayer.forward`` without a state: projections and soft-capped gates per token, the mLSTM over the
    whole sequence (``mlstm_attention``), the multi-head norm, sigmoid output gate, out_proj. ``[B, n, E]``."""
    ctx = _context(self, {}, state)
    b, n, _ = x.shape
    heads = self.config.num_heads
    q, k, v, o, i, f = _xlstm_inputs(self, x)
    q, k, v = (t.reshape(b, n, heads, -1) for t in (q, k, v))
    h = mlstm_attention(q, k, v, i, f, mesh=ctx.mesh, eps=self.config.eps).to(x.dtype)
    ctx.record(self)
    h = self.multihead_norm(h).reshape(b, n, -1)
    return self.out_proj(self.ogate_act_fn(o) * h), None


_XLSTM = "transformers.models.xlstm.modeling_xlstm"
_RWKV = "transformers.models.rwkv.modeling_rwkv"
_GEMMA = "transformers.models.recurrent_gemma.modeling_recurrent_gemma"
# (transformers module, class name) -> adapter forward: ``recurrent_layers.BUILTIN_ADAPTERS`` takes these
ADAPTERS = {
    (_GEMMA, "RecurrentGemmaRecurrentBlock"): recurrent_gemma_block_forward,
    (_GEMMA, "RecurrentGemmaRglru"): rglru_forward,
    (_RWKV, "RwkvSelfAttention"): rwkv_attention_forward,
    (_RWKV, "RwkvFeedForward"): rwkv_feed_forward_forward,
    (_XLSTM, "xLSTMLayer"): xlstm_layer_forward,
}
