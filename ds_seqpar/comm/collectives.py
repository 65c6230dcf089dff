"""The single-tensor all-gather and reduce-scatter under their torch >= 2.11 names (older releases only
have the ``*_tensor`` spellings, with the same arguments)."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
