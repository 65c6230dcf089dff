"""Sequence-parallel forwards of the diagonal recurrent layers of HF models (registered in ``recurrent_layers.py``).

Each forward mirrors the HF layer's training path (no cache) and keeps every weight of the module;
what spans the sequence goes to ``parallel/diagonal_scan.py`` (docs/delta.md "Diagonal recurrences"):

    RecurrentGemmaRecurrentBlock   the causal conv1d gets its K - 1 halo rows (``sharded_causal_conv1d``)
    RecurrentGemmaRglru            h_t = a_t ⊙ h_{t-1} + sqrt(1 - a_t²) ⊙ (i_t ⊙ x_t), a_t = 0 and the
                                   multiplier 1 where position_ids == 0 (HF's reset): ``diagonal_recurrence``
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

from ds_seqpar.integrations.recurrent_adapters import _context
from ds_seqpar.parallel.delta_scan import sharded_causal_conv1d
from ds_seqpar.parallel.diagonal_scan import diagonal_recurrence

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


_GEMMA = "transformers.models.recurrent_gemma.modeling_recurrent_gemma"
# (transformers module, class name) -> adapter forward: ``recurrent_layers.BUILTIN_ADAPTERS`` takes these
ADAPTERS = {
    (_GEMMA, "RecurrentGemmaRecurrentBlock"): recurrent_gemma_block_forward,
    (_GEMMA, "RecurrentGemmaRglru"): rglru_forward,
}
