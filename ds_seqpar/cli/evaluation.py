"""``train.py``'s evaluations: the held-out split of the training data, and ``--eval-data``.

Both run through ``ds_seqpar.evaluation``: the set split over the dp replicas with every sample counted
once (``EvenShares``), loss and accuracy token-weighted over the SP group and the replicas
(``evaluate_shards``), so dp = 2 gives the dp = 1 figures.
"""

from __future__ import annotations

import math
from typing import Any

from ds_seqpar.evaluation import evaluate_shards

__all__ = ["evaluate", "evaluate_heldout"]


def _run(engine: Any, loader: Any, mesh: Any) -> dict[str, float]:
    engine.eval()
    try:
        return evaluate_shards(engine.module.evaluate, loader, mesh, engine.device)
    finally:
        engine.train()


def evaluate(engine: Any, loader: Any, mesh: Any) -> dict[str, float]:
    """Token-weighted eval loss and accuracy over ``loader`` (``EvenShares``) and every dp replica;
    the engine is back in train mode after."""
    res = _run(engine, loader, mesh)
    return {"eval_loss": res["loss"], "eval_accuracy": res["accuracy"]}


def evaluate_heldout(engine: Any, loader: Any, mesh: Any) -> dict[str, float]:
    """``--eval-data``: held-out loss, perplexity (exp of the token-weighted loss) and accuracy, and the
    number of tokens they cover."""
    res = _run(engine, loader, mesh)
    loss = res["loss"]
    return {
        "heldout_loss": loss,
        "heldout_ppl": float("inf") if loss > 709.0 else math.exp(loss),  # NaN stays NaN
        "heldout_accuracy": res["accuracy"],
        "heldout_tokens": res["tokens"],
    }
