"""Which layers run sparse attention, and when (``sequence_parallel.sparse.layers`` / ``dense_warmup_steps``)."""

from __future__ import annotations

from typing import Any


def sparse_layer_active(sparse_cfg: Any, layer: int | None, step: int) -> bool:
    """Whether ``layer`` runs sparse at training ``step``; the other layers stay dense.

    A call without a layer index counts as sparse only when ``layers`` is ``"all"``.
    """
    if step < sparse_cfg.dense_warmup_steps:
        return False
    return sparse_cfg.layers == "all" or (layer is not None and layer in sparse_cfg.layers)
