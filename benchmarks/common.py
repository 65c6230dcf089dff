"""Shared by the distributed benchmark scripts: synchronized timing and result files."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.measure import slowest_rank_times

RESULTS = Path(__file__).resolve().parent / "results"


def slowest_rank_median(step: Callable[[], None], reps: int) -> float:
    """Median over ``reps`` (after one warm-up) of the slowest rank's time for ``step()``."""
    return statistics.median(slowest_rank_times(step, reps))


def sum_grads(model: torch.nn.Module) -> None:
    """All-reduce (sum) every parameter gradient over the world, in one flat message."""
    if dist.get_world_size() == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def gather_floats(value: float) -> list[float]:
    """``value`` from every rank, in rank order."""
    out = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([float(value)]))
    return [t.item() for t in out]


def save_results(
    name: str, title: str, meta: dict, rows: list[dict], columns: list[tuple[str, str, str]]
) -> str:
    """Write ``results/<name>.json`` and ``results/<name>.md``; return the markdown table.

    ``columns``: (header, row key, format spec) triples.
    """
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [title, "", "| " + " | ".join(c[0] for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(format(r[key], spec) for _, key, spec in columns) + " |" for r in rows]
    table = "\n".join(lines) + "\n"
    (RESULTS / f"{name}.md").write_text(table)
    return table


def random_llama(vocab: int, width: int, layers: int, heads: int) -> torch.nn.Module:
    """A random-init fp32 Llama (seed 0, sdpa): ``width`` E, ``layers`` layers, ``heads`` heads (half as many K/V
    heads), an untied head ``[V, E]``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=1 << 20,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    model.set_attn_implementation("sdpa")
    return model
