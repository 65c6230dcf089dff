"""Resume ``train.py`` from a DeepSpeed checkpoint saved by another number of ranks.

ZeRO partitions parameters and optimizer state over the whole world (dp x sp with ds_seqpar's
mpu), so a ZeRO checkpoint only loads on the world size that wrote it; DeepSpeed refuses any other
("The checkpoint being loaded used a DP world size of 4 but the current world size is 2"). Its
answer is the *universal checkpoint*: ``deepspeed.checkpoint.ds_to_universal`` merges every rank's
fp32 weights and Adam moments into one full tensor per parameter, and an engine configured with
``"checkpoint": {"load_universal": true}`` re-partitions them over its own world when it loads.

``prepare_resume`` (a collective; call it on every rank before ``ds_seqpar.initialize``, with the tag
``checkpoint_manifest.resume_tag`` chose) reads the
saved world size from DeepSpeed's own file layout (one ``*_optim_states.pt`` per ZeRO partition),
and when it differs from this run's, rank 0 converts the checkpoint with DeepSpeed's converter into
``<tag>_universal`` next to it while the other ranks wait; ``ResumePoint.configure`` then turns on
``load_universal`` in the DeepSpeed config. Nothing of the conversion itself is ds_seqpar's.
DeepSpeed 0.19.8 converts ds_seqpar's ZeRO-3 checkpoints; its ZeRO-1/2 path rejects them, because the
engine records the SP size as ``tp_degree`` next to a single model-state file (docs/train.md).

The data position is kept in samples: each checkpoint's client state records the run's samples per
step over its history (``SampleHistory``), so a run resumed with another data-parallel size skips
exactly the samples already trained on (``SampleHistory.skip``).

Manual conversion (what ``prepare_resume`` runs in-process)::

    python -m deepspeed.checkpoint.ds_to_universal --input_folder OUT/checkpoints/step2 \\
        --output_folder OUT/checkpoints/step2_universal
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_seqpar.checkpoint_manifest import object_device, say_on_rank0
from ds_seqpar.config import SeqParConfigError

UNIVERSAL_SUFFIX = "_universal"


def _conversion_is_current(source: Path, target: Path) -> bool:
    """A complete conversion of ``source`` made after its newest file (a later save into the same tag,
    e.g. a new run in the same --output-dir, makes it stale and it is converted again)."""
    if not ((target / "zero" / "optimizer_state.pt").is_file() and any(target.glob("*_model_states.pt"))):
        return False
    newest_source = max((f.stat().st_mtime for f in source.rglob("*") if f.is_file()), default=0.0)
    return (target / "zero" / "optimizer_state.pt").stat().st_mtime >= newest_source


CLIENT_KEY = "ds_seqpar"


@dataclass(frozen=True)
class SampleHistory:
    """Samples per step over a run's history: ``((first_step, samples_per_step), ...)`` by step.

    Step ``s`` (0-based: the step that ends at ``s + 1``) trained on the samples-per-step of the last
    segment whose ``first_step <= s``.
    """

    segments: tuple[tuple[int, int], ...]

    @classmethod
    def fresh(cls, samples_per_step: int) -> SampleHistory:
        """A run that starts at step 0."""
        return cls(((0, samples_per_step),))

    @classmethod
    def from_state(cls, value: Sequence[Sequence[int]]) -> SampleHistory:
        """The history stored in a checkpoint's client state."""
        return cls(tuple((int(a), int(b)) for a, b in value))

    def to_state(self) -> list[list[int]]:
        """The JSON-friendly form stored in the client state."""
        return [list(seg) for seg in self.segments]

    def continued(self, step: int, samples_per_step: int) -> SampleHistory:
        """This history up to ``step``, then ``samples_per_step`` from ``step`` on (a resumed run)."""
        kept = tuple(seg for seg in self.segments if seg[0] < step)
        if kept and kept[-1][1] == samples_per_step:
            return SampleHistory(kept)
        return SampleHistory((*kept, (step, samples_per_step)))

    def rate(self, step: int) -> int:
        """Samples per step at ``step``."""
        return [b for a, b in self.segments if a <= step][-1]

    def samples(self, start: int, stop: int) -> int:
        """Samples trained on by steps ``start .. stop - 1``."""
        total = 0
        for i, (first, rate) in enumerate(self.segments):
            end = self.segments[i + 1][0] if i + 1 < len(self.segments) else stop
            total += rate * max(0, min(end, stop) - max(first, start))
        return total

    def skip(self, phase_start: int, step: int, samples_per_step: int) -> int:
        """Batches of a loader with ``samples_per_step`` to drop so that a phase (curriculum stage,
        its own dataset) that began at ``phase_start`` continues at ``step`` after the samples already
        trained on; rounded up, so a sample is never trained on twice."""
        return -(-self.samples(phase_start, step) // samples_per_step)


@dataclass(frozen=True)
class ResumePoint:
    """Which checkpoint ``--resume`` loads, and how."""

    tag: str | None
    source_tag: str | None = None
    saved_world_size: int | None = None
    universal: bool = False

    def configure(self, ds_config: dict[str, Any]) -> dict[str, Any]:
        """``ds_config`` with ``checkpoint.load_universal`` on when this point is a universal checkpoint."""
        if not self.universal:
            return ds_config
        return {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}


def saved_world_size(tag_dir: str | os.PathLike[str]) -> int | None:
    """The number of ZeRO partitions a checkpoint was saved with (DeepSpeed writes one
    ``*_optim_states.pt`` per partition; ds_seqpar's mpu partitions over every rank), or None
    without ZeRO (stage 0 keeps the whole optimizer in one file and loads on any world size)."""
    files = [p for p in Path(tag_dir).glob("*_optim_states.pt") if not p.name.startswith("layer_")]
    return len(files) or None


def convert_to_universal(
    tag_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    num_extract_workers: int = 1,
    num_merge_workers: int = 1,
) -> float:
    """Convert a ZeRO checkpoint folder to a universal one with DeepSpeed's ``ds_to_universal.main``;
    returns the seconds it took. Written to ``<output_dir>.partial`` first, then renamed, so
    ``output_dir`` exists only complete. Also writes ``latest_universal`` next to it, as the
    command does. The converter's own output is kept for the error message when it fails."""
    from deepspeed.checkpoint import ds_to_universal

    output_dir = Path(output_dir)
    partial = output_dir.with_name(output_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    args = argparse.Namespace(
        input_folder=str(tag_dir),
        output_folder=str(partial),
        num_extract_workers=num_extract_workers,  # 1: in this process (no fork next to live comm threads)
        num_merge_workers=num_merge_workers,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            ds_to_universal.main(args)
    except Exception as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise RuntimeError(
            f"DeepSpeed's ds_to_universal failed on {tag_dir}: {type(exc).__name__}: {exc}\n"
            f"its output:\n{log.getvalue()[-4000:]}"
        ) from exc
    os.replace(partial, output_dir)
    (output_dir.parent / "latest_universal").write_text(output_dir.name)
    return time.perf_counter() - t0


def prepare_resume(
    ckpt_dir: str | os.PathLike[str], tag: str, say: Callable[[str], None] = say_on_rank0
) -> ResumePoint:
    """How to load checkpoint ``tag`` (``checkpoint_manifest.resume_tag`` picks it); converted to universal
    when the world size changed.

    A collective (call it on every rank, with the process group up): rank 0 converts while the
    others wait for its result, so a failed conversion raises on every rank instead of hanging.
    An existing ``<tag>_universal`` is reused.
    """
    import torch.distributed as dist

    saved = saved_world_size(Path(ckpt_dir) / tag)
    world = dist.get_world_size()
    if saved is None or saved == world:
        return ResumePoint(tag=tag, source_tag=tag, saved_world_size=saved)
    target = Path(ckpt_dir) / f"{tag}{UNIVERSAL_SUFFIX}"
    outcome: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            if _conversion_is_current(Path(ckpt_dir) / tag, target):
                outcome[0] = ("reused", 0.0)
            else:
                outcome[0] = ("converted", convert_to_universal(Path(ckpt_dir) / tag, target))
        except Exception as exc:  # reported on every rank below
            outcome[0] = ("error", f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(outcome, src=0, device=object_device())
    kind, detail = outcome[0]
    if kind == "error":
        raise SeqParConfigError(
            f"--resume: {Path(ckpt_dir) / tag} was saved by {saved} ranks, this run has {world}, and "
            f"converting it to a universal checkpoint failed: {detail}\nResume on {saved} ranks to load it "
            "as saved (docs/train.md, 'Resuming on a different number of ranks')"
        )
    how = (
        f"converted it with DeepSpeed's ds_to_universal in {detail:.1f} s"
        if kind == "converted"
        else "reusing the conversion already there"
    )
    say(
        f"resume: checkpoint {tag} was saved by {saved} ranks, this run has {world}: {how} "
        f"({target}); loading it with checkpoint.load_universal"
    )
    return ResumePoint(tag=target.name, source_tag=tag, saved_world_size=saved, universal=True)


def client_state(
    step: int, history: SampleHistory, *, world_size: int, dp_size: int, sp_size: int, micro_batch: int
) -> dict[str, Any]:
    """What ``train.py`` stores in every checkpoint: the step, the run's shape and its sample history."""
    return {
        "step": step,
        CLIENT_KEY: {
            "world_size": world_size,
            "dp_size": dp_size,
            "sp_size": sp_size,
            "micro_batch": micro_batch,
            "samples_per_step": history.to_state(),
        },
    }


def resumed_history(
    client: dict[str, Any], step: int, samples_per_step: int, say: Callable[[str], None] = say_on_rank0
) -> SampleHistory:
    """The sample history of a run resumed at ``step`` from ``client`` (a loaded client state),
    continued with this run's ``samples_per_step``. Checkpoints of older ``train.py`` versions carry no
    history; they are taken to have run at this run's samples per step throughout."""
    saved = client.get(CLIENT_KEY)
    if saved is None:
        return SampleHistory.fresh(samples_per_step)
    history = SampleHistory.from_state(saved["samples_per_step"])
    before = history.rate(max(step - 1, 0))
    if before != samples_per_step:
        say(
            f"resume: {before} samples per step before step {step} (dp {saved['dp_size']} x micro batch "
            f"{saved['micro_batch']}), {samples_per_step} from now on; the data continues after the "
            f"{history.samples(0, step)} samples already trained on"
        )
    return history.continued(step, samples_per_step)
