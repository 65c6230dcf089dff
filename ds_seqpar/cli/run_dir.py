"""``train.py``'s output directory: a run is never overwritten, and a resumed run continues the one it names.

* ``check_output_dir`` (before any process group, every rank): an ``--output-dir`` that holds a run
  (``metrics.jsonl``, ``checkpoints/`` with anything in it, ``hf_model/``) is refused without
  ``--resume`` or ``--overwrite``; ``--resume`` without a run is refused; a directory that cannot be
  written is refused, naming it.
* ``move_aside`` (``--overwrite``, rank 0, after the process group starts): the old run is renamed to
  ``OUTPUT_DIR.old-<time>``, never deleted.
* ``training_flags`` / ``check_resumed_flags``: what a checkpoint records of the flags that decide the
  data stream, and the refusal, by name, of a resume that changes one of them (``--lr`` is honoured
  instead: see ``cli/run.py``).
* ``truncate_metrics``: on resume, ``metrics.jsonl`` keeps only the rows up to the resumed step (the
  steps after it are trained again), so it describes one run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from ds_seqpar.cli.args import PASSKEY_TASK
from ds_seqpar.errors import SeqParConfigError

__all__ = ["check_output_dir", "check_resumed_flags", "move_aside", "training_flags", "truncate_metrics"]

RUN_MARKERS = ("metrics.jsonl", "checkpoints", "hf_model")


def _run_contents(out_dir: Path) -> list[str]:
    """What of a run ``out_dir`` holds (empty: no run)."""
    found = []
    for name in RUN_MARKERS:
        path = out_dir / name
        if path.is_file() or (path.is_dir() and any(path.iterdir())):
            found.append(name)
    return found


def _writable_dir(out_dir: Path) -> str | None:
    """None when ``out_dir`` is (or can be made) a writable directory, else why not."""
    existing = next((p for p in (out_dir, *out_dir.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user"
    for sub in ("checkpoints", "hf_model"):
        path = out_dir / sub
        if path.exists() and not os.access(path, os.W_OK | os.X_OK):
            return f"{path} is not writable by this user"
    return None


def check_output_dir(args: argparse.Namespace) -> None:
    """Refuse an output directory that holds a run (module docstring), before any process group."""
    out_dir = Path(args.output_dir)
    if args.resume and args.overwrite:
        raise SeqParConfigError("--resume and --overwrite contradict each other: pass one of them")
    problem = _writable_dir(out_dir)
    if problem is not None:
        raise SeqParConfigError(
            f"--output-dir {out_dir}: {problem}; fix the permissions or choose another directory"
        )
    found = _run_contents(out_dir)
    if found and not (args.resume or args.overwrite):
        raise SeqParConfigError(
            f"--output-dir {out_dir} holds a run ({', '.join(found)}): pass --resume to continue it, --overwrite to "
            f"start a new one (the old run is moved to {out_dir}.old-<time>, not deleted), or another --output-dir"
        )
    if args.resume and "checkpoints" not in found:
        raise SeqParConfigError(
            f"--resume: {out_dir / 'checkpoints'} holds no checkpoint; run without --resume to start the run"
        )


def move_aside(out_dir: Path) -> Path | None:
    """``--overwrite``: rename the run in ``out_dir`` to ``<out_dir>.old-<time>``; returns the new name."""
    if not _run_contents(out_dir):
        return None
    target = out_dir.with_name(f"{out_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while target.exists():
        target, n = target.with_name(f"{out_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}-{n}"), n + 1
    out_dir.rename(target)
    return target


# flags that decide which samples the run trains on, in what order: a resume must keep them
DATA_FLAGS = ("model", "data", "text_field", "objective", "seed", "seq_len", "curriculum")
LABELS = {"scheduler": "the scheduler section", "task": "the embedded task"}  # names in the refusal
# the embedded task of checkpoints that recorded none (before PASSKEY_TASK was recorded)
OLDER_PASSKEY_TASK = "passkey retrieval, 16 passkeys drawn at random per row"


def training_flags(args: argparse.Namespace, scheduler: dict[str, Any] | None) -> dict[str, Any]:
    """What a checkpoint records of the run's flags (``DATA_FLAGS``, the lr schedule section) and, for the
    embedded task, which version of the task it trained on (``PASSKEY_TASK``)."""
    flags = {name: getattr(args, name) for name in DATA_FLAGS}  # --curriculum as given (None: the default)
    flags["scheduler"] = scheduler
    flags["task"] = PASSKEY_TASK if args.data is None else None
    # balanced rows group documents for the SP degree: another degree packs other rows
    flags["packing"] = (
        args.packing if args.packing == "fixed" else f"{args.packing} for SP degree {args.settings.size}"
    )
    return flags


def check_resumed_flags(saved: dict[str, Any] | None, now: dict[str, Any], tag: str) -> None:
    """Refuse a resume whose flags change the data stream or the lr schedule (``saved``: the checkpoint's
    ``training_flags``; None for checkpoints of older versions, which recorded none)."""
    if saved is None:
        return
    saved = {"task": OLDER_PASSKEY_TASK if saved.get("data", 1) is None else None, **saved}
    changed = [
        f"{LABELS.get(name, '--' + name.replace('_', '-'))}: {saved.get(name)!r} -> {now[name]!r}"
        for name in now
        if name in saved and saved[name] != now[name]
    ]
    if changed:
        raise SeqParConfigError(
            f"--resume from {tag}: this run changes what the checkpoint trained with ({'; '.join(changed)}). These decide "
            "the data order and the schedule of the resumed run: resume with the checkpoint's values, or start a new "
            "run with --overwrite"
        )


def truncate_metrics(path: Path, step: int) -> int:
    """Keep the rows of ``path`` up to ``step`` (rank 0, on resume); returns how many rows were dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short by a kill
            dropped += 1
            continue
        if isinstance(row, dict) and int(row.get("step", 0)) <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)
    return dropped
