"""``python -m ds_seqpar.plot RUN_DIR [--out PNG]``: draw a ``train.py`` run's ``metrics.jsonl``.

Three panels over optimizer steps: the training loss (with the held-out ``eval_loss`` as points),
tokens/s, and memory (``peak_memory_MiB`` on CUDA, ``max_rss_MiB`` on CPU). Curriculum switches
(changes of ``seq_len``) are marked by dotted vertical lines. Writes ``RUN_DIR/metrics.png`` unless
``--out`` says otherwise and prints the path. A resumed run appends rows for steps it repeats; the
last row of each step wins.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

MEMORY_COLUMNS = {  # metrics.jsonl column -> axis label
    "peak_memory_MiB": "peak memory per step (MiB, CUDA max_memory_allocated, rank 0)",
    "max_rss_MiB": "max RSS so far (MiB, rank 0)",
}


class PlotError(Exception):
    """A run directory or metrics file that cannot be plotted; the message is the one-line reason."""


def load_rows(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train_rows, eval_rows)`` of a ``metrics.jsonl``, each sorted by step (last row per step wins)."""
    if not path.is_file():
        raise PlotError(f"{path} does not exist; point RUN_DIR at a train.py --output-dir")
    train: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PlotError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
            if not isinstance(row, dict) or "step" not in row:
                raise PlotError(f"{path}:{number}: a metrics row needs a 'step' field")
            if "loss" in row:
                train[int(row["step"])] = row
            if "eval_loss" in row:
                evals[int(row["step"])] = row
    if not train and not evals:
        raise PlotError(f"{path} has no step or eval rows (empty file or a run that has not stepped yet)")
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


def plot_metrics(
    train: list[dict[str, Any]], evals: list[dict[str, Any]], out: Path, title: str = ""
) -> Path:
    """Draw loss (+ eval loss), tokens/s and memory over steps to the PNG ``out``; returns ``out``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 9), layout="constrained")
    FigureCanvasAgg(fig)  # Agg, whatever backend pyplot would pick: no display needed
    ax_loss, ax_tps, ax_mem = fig.subplots(3, 1, sharex=True)
    steps = [r["step"] for r in train]
    ax_loss.plot(steps, [r["loss"] for r in train], lw=1, label="train loss")
    if evals:
        ax_loss.plot(
            [r["step"] for r in evals], [r["eval_loss"] for r in evals], "o", color="C3", label="eval loss"
        )
    ax_loss.set_ylabel("loss")
    ax_loss.legend(loc="upper right")
    ax_tps.plot(steps, [r["tokens_per_s"] for r in train], lw=1, color="C1")
    ax_tps.set_ylabel("tokens/s")
    column = next((c for c in MEMORY_COLUMNS if any(c in r for r in train)), None)
    if column is None:
        ax_mem.text(0.5, 0.5, "no memory column in metrics.jsonl", ha="center", va="center",
                    transform=ax_mem.transAxes)  # fmt: skip
    else:
        rows = [r for r in train if column in r]
        ax_mem.plot([r["step"] for r in rows], [r[column] for r in rows], lw=1, color="C2")
    ax_mem.set_ylabel(MEMORY_COLUMNS[column] if column else "memory (MiB)")
    ax_mem.set_xlabel("step")
    switches = [
        after for before, after in itertools.pairwise(train) if before.get("seq_len") != after.get("seq_len")
    ]
    for row in train[:1] + switches:  # the sequence length of each curriculum phase, at its first step
        if row is not train[0]:
            for ax in (ax_loss, ax_tps, ax_mem):
                ax.axvline(row["step"], ls=":", color="gray", lw=1)
        ax_tps.annotate(f"S={row.get('seq_len')}", (row["step"], 0), xycoords=("data", "axes fraction"),
                        xytext=(3, 4), textcoords="offset points", fontsize=8, color="gray")  # fmt: skip
    for ax in (ax_loss, ax_tps, ax_mem):
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def main(argv: list[str] | None = None) -> int:
    """The command line; returns 0, or 2 after a one-line error on stderr."""
    parser = argparse.ArgumentParser(
        prog="python -m ds_seqpar.plot",
        description="Plot a train.py run's metrics.jsonl (loss, tokens/s, memory over steps) to PNG.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a train.py --output-dir holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/metrics.png)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    try:
        if not run_dir.is_dir():
            raise PlotError(f"RUN_DIR {run_dir} is not a directory")
        train, evals = load_rows(run_dir / "metrics.jsonl")
        out = plot_metrics(
            train, evals, Path(args.out) if args.out else run_dir / "metrics.png", str(run_dir)
        )
    except PlotError as exc:
        print(f"ds_seqpar.plot: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
