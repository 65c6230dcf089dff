"""Sequence-parallel forward of gated short-convolution layers (LFM2 family; registered in ``recurrent_layers.py``).

Such a layer carries no state beyond its K - 1 previous inputs, so it needs no scan: only the causal
depthwise conv spans the sequence, and it gets the previous rank's last K - 1 inputs as a halo
(``parallel/delta_scan.sharded_causal_conv1d``, ``comm/halo.py``). Everything else is per token.
Conventions: docs/delta.md ("Conventions of each family").
"""

from __future__ import annotations

from typing import Any

import torch

from ds_seqpar.integrations.recurrent_adapters import _context, _real_tokens, _zero_padding
from ds_seqpar.parallel.delta_scan import sharded_causal_conv1d


def short_conv_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``Lfm2ShortConv.forward`` on this rank's rows ``[B, n, hidden]``: (B, C, x) = in_proj(h);
    y = C · conv(B · x) with the conv's halo (K - 1 rows of ``[B, ·, hidden]`` from the previous rank);
    out_proj(y)."""
    ctx = _context(self, kwargs, cache)
    hidden_states = _zero_padding(_real_tokens(ctx, hidden_states.shape[0]), hidden_states)
    b_gate, c_gate, x = self.in_proj(hidden_states).chunk(3, dim=-1)
    y = c_gate * sharded_causal_conv1d(b_gate * x, self.conv, mesh=ctx.mesh)
    ctx.record(self)
    return self.out_proj(y)
