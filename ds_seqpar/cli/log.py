"""``train.py``'s output: the rank-0 progress bar or lines, ``metrics.jsonl``, DeepSpeed's monitor events, and
the memory and sparse-attention columns of a step row."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from ds_seqpar.cli.health import finite_row

__all__ = ["EVENT_PREFIX", "RunLog", "memory_metrics", "sparse_metrics"]

EVENT_PREFIX = "ds_seqpar/"  # metrics.jsonl column X is the monitor event ds_seqpar/X


class RunLog:
    """Rank-0 progress bar / lines, the metrics file and the DeepSpeed monitor events.

    With a monitor section enabled (``engine.monitor.enabled``), every numeric column X of a metrics
    row (``step`` included) is also written as the event ``ds_seqpar/X`` through
    ``engine.monitor.write_events`` (TensorBoard, CSV, W&B, Comet; DeepSpeed writes on global rank 0
    only), at DeepSpeed's x-axis, ``engine.global_samples``, like its own ``Train/Samples/*`` events
    (W&B drops events at a step below one already logged; Comet's interval counts samples).
    """

    def __init__(self, args: argparse.Namespace, rank: int, start_step: int, engine: Any = None) -> None:
        self.rank = rank
        self.bar = None
        self.file = None
        self.engine = engine if getattr(getattr(engine, "monitor", None), "enabled", False) else None
        if rank != 0:
            return
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.file = open(out / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if not args.no_progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=args.max_steps, initial=start_step, desc="train", dynamic_ncols=True, file=sys.stdout
            )

    def record(self, row: dict[str, Any]) -> None:
        """Append ``row`` to metrics.jsonl and send its numbers to the monitor (rank 0)."""
        if self.file is not None:  # non-finite numbers as strings: every line stays valid JSON
            self.file.write(json.dumps(finite_row(row), allow_nan=False) + "\n")
            self.file.flush()
        if self.engine is not None and self.rank == 0:
            samples = int(self.engine.global_samples)  # step x train_batch_size (DeepSpeed keeps a float)
            events = [
                (EVENT_PREFIX + key, value, samples)
                for key, value in row.items()
                if isinstance(value, (int, float)) and not isinstance(value, bool)
            ]
            self.engine.monitor.write_events(events)

    def step(self, row: dict[str, Any]) -> None:
        self.record(row)
        if self.rank != 0:
            return
        text = f"loss {row['loss']:.4f} | {row['tokens_per_s']:.0f} tok/s | S {row['seq_len']} | comm {row['comm_MiB']:.1f} MiB"
        for key in ("peak_memory_MiB", "max_rss_MiB"):
            if key in row:
                text += f" | {'peak' if key == 'peak_memory_MiB' else 'max RSS'} {row[key]:.0f} MiB"
        if "sparse_rho_s_max" in row:
            text += f" | sparse density {row['sparse_density']:.3f}, rho_s {row['sparse_rho_s_max']:.2f}"
        if self.bar is not None:
            self.bar.set_postfix_str(text)
            self.bar.update(1)
        else:
            print(f"step {row['step']}: {text}", flush=True)

    def say(self, text: str) -> None:
        if self.rank == 0:
            (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()


def memory_metrics(device: torch.device) -> dict[str, float]:
    """This rank's memory for the step row: on CUDA ``peak_memory_MiB`` (``max_memory_allocated`` since
    the previous row, then reset; allocator counters, no device sync), elsewhere ``max_rss_MiB`` (the
    process's peak resident set so far, ``getrusage`` ``ru_maxrss``; it never goes down)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
        return {"peak_memory_MiB": peak}
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"max_rss_MiB": rss / (2**20 if sys.platform == "darwin" else 2**10)}


def sparse_metrics(mesh: Any) -> dict[str, float]:
    """Worst imbalance ratio and mean density over the sparse layers of the last step (sparse_ring only)."""
    import ds_seqpar

    stats = ds_seqpar.sparse_stats(mesh)
    if not stats:
        return {}
    values = list(stats.values())
    stats.clear()  # the next step reports its own layers (dense warm-up steps report none)
    return {
        "sparse_rho_s_max": max(v.rho_s for v in values),
        "sparse_density": sum(v.density for v in values) / len(values),
        "sparse_layers": len(values),
    }
