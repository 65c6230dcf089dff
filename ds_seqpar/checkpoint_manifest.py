"""Checkpoints that become visible only complete, and a resume that loads only a verified one.

DeepSpeed writes a tag's files rank by rank and rank 0 writes ``latest`` before the others have
finished, so a job killed during a save can leave ``latest`` pointing at a half-written tag, and a
damaged file loads without complaint. ``save_verified`` (a collective, every rank) instead:

1. saves the tag into ``<tag>.partial`` with DeepSpeed's ``save_checkpoint(save_latest=False)``;
2. hashes every file of it (SHA-256; the files are shared out over the ranks by size) and gathers
   the hashes;
3. on rank 0 writes ``ds_seqpar_manifest.json`` (tag, step, world size, each file's bytes and
   hash), renames ``<tag>.partial`` to ``<tag>`` (an older ``<tag>`` is moved to
   ``<tag>.replaced-<time>``, never deleted) and only then points ``latest`` at it (written to a
   temporary file and renamed, so ``latest`` is never half-written);
4. waits on a barrier, so no rank goes on before the tag is visible.

``resume_tag`` (a collective) lists the tags that have a manifest, newest step first, and checks
each (every file present, of its size and hash; the hashing again shared out over the ranks) until
one is complete; every skipped tag is reported with the file and what is wrong with it. It does not
need ``latest``. Tags without a manifest (saved by plain DeepSpeed or an older ds_seqpar) are used
only when no tag has one, the one ``latest`` names, unverified and said so.

The checkpoint directory must be one file system that every rank sees (as DeepSpeed's ``latest``
file already assumes).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds_seqpar.comm.step_watch import is_collective_error
from ds_seqpar.errors import SeqParConfigError

__all__ = ["MANIFEST", "CheckpointError", "ResumeChoice", "resume_tag", "save_verified", "verify_tag"]

MANIFEST = "ds_seqpar_manifest.json"
PARTIAL_SUFFIX = ".partial"
FORMAT = 1
_HASH_BLOCK = 16 * 2**20


class CheckpointError(SeqParConfigError):
    """A checkpoint cannot be written or read; the message names the tag, the file and the fix."""


def say_on_rank0(text: str) -> None:
    """Print on rank 0 (or without a process group)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(text, flush=True)


def object_device() -> torch.device | None:
    """NCCL moves objects through this rank's GPU (set here: resume runs before the engine exists)."""
    if dist.get_backend() != "nccl":
        return None
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def _gather(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (one all-gather of pickled objects)."""
    out: list[Any] = [None] * dist.get_world_size()
    object_device()
    dist.all_gather_object(out, obj)
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _my_share(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """The files this rank hashes: largest first, each to the least loaded rank (the same on every rank)."""
    load = [0] * world
    mine = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += sizes[name]
        if r == rank:
            mine.append(name)
    return mine


def _tag_step(tag: str) -> int | None:
    found = re.fullmatch(r"\D*(\d+)", tag)
    return int(found.group(1)) if found else None


def _no_space(exc: BaseException, free_mib: float) -> bool:
    """A full disk: ENOSPC, or torch's zip writer failing (``enforce fail at inline_container.cc``) with
    almost nothing left free."""
    text = str(exc)
    full = getattr(exc, "errno", None) == errno.ENOSPC or "No space left" in text
    return full or ("enforce fail" in text and free_mib < 64)


def _save_error(exc: BaseException, ckpt_dir: Path, tag: str) -> CheckpointError:
    """What went wrong writing ``tag`` (a full disk, an unwritable directory), with the fix."""
    probe = next((p for p in (ckpt_dir, *ckpt_dir.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(probe).free / 2**20
    if _no_space(exc, free):
        return CheckpointError(
            f"checkpoint {tag}: no space left on the device of {ckpt_dir} ({free:.0f} MiB free): free space "
            f"there or pass another --output-dir; the incomplete save stays in {ckpt_dir / (tag + PARTIAL_SUFFIX)} "
            f"and never becomes 'latest' ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        )
    if isinstance(exc, PermissionError) or not os.access(probe, os.W_OK):
        return CheckpointError(
            f"checkpoint {tag}: cannot write to {ckpt_dir} ({type(exc).__name__}: {exc}); make it writable or "
            "pass another --output-dir"
        )
    return CheckpointError(f"checkpoint {tag}: saving into {ckpt_dir} failed: {type(exc).__name__}: {exc}")


def _write_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` or its old content, never a part of it."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def save_verified(
    engine: Any, ckpt_dir: str | os.PathLike[str], tag: str, client_state: dict[str, Any], step: int
) -> Path:
    """Save ``tag`` so it becomes visible (and ``latest``) only complete and hashed (module docstring).

    A collective: call it on every rank. Returns the tag's directory.
    """
    ckpt_dir = Path(ckpt_dir)
    partial = ckpt_dir / f"{tag}{PARTIAL_SUFFIX}"
    rank = dist.get_rank()
    try:
        if rank == 0:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed: never complete
        dist.barrier()
        engine.save_checkpoint(str(ckpt_dir), tag=partial.name, client_state=client_state, save_latest=False)
        files = {
            str(p.relative_to(partial)): p.stat().st_size for p in sorted(partial.rglob("*")) if p.is_file()
        }
    except (OSError, RuntimeError) as exc:  # torch's zip writer reports a full disk as a RuntimeError
        if is_collective_error(exc):  # a peer's fault: StepWatch names it
            raise
        raise _save_error(exc, ckpt_dir, tag) from exc
    files = _gather(files)[0]  # rank 0's listing is the one every rank hashes from
    hashes: dict[str, str] = {}
    for part in _gather({n: _sha256(partial / n) for n in _my_share(files, rank, dist.get_world_size())}):
        hashes.update(part)
    final = ckpt_dir / tag
    if rank == 0:
        manifest = {
            "format": FORMAT,
            "tag": tag,
            "step": step,
            "world_size": dist.get_world_size(),
            "saved": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "files": {n: {"bytes": files[n], "sha256": hashes[n]} for n in sorted(files)},
        }
        _write_atomic(partial / MANIFEST, json.dumps(manifest, indent=1))
        if final.exists():
            final.rename(ckpt_dir / f"{tag}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(partial, final)
        _write_atomic(ckpt_dir / "latest", tag)
    dist.barrier()
    return final


@dataclass(frozen=True)
class ResumeChoice:
    """The tag ``--resume`` loads (None: no checkpoint at all) and the tags skipped on the way, with why."""

    tag: str | None
    step: int | None = None
    verified: bool = True
    skipped: tuple[str, ...] = field(default=())


def _read_manifest(tag_dir: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((tag_dir / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(manifest, dict) and manifest.get("tag") == tag_dir.name and "files" in manifest
    return manifest if ok else None


def _manifest_tags(ckpt_dir: Path) -> list[tuple[int, str]]:
    """``(step, tag)`` of every directory whose manifest names it, newest step first."""
    found = []
    for sub in ckpt_dir.iterdir() if ckpt_dir.is_dir() else ():
        manifest = _read_manifest(sub) if sub.is_dir() else None
        if manifest is not None:
            found.append((int(manifest.get("step", -1)), sub.name))
    return sorted(found, reverse=True)


def _problems_in_share(tag_dir: Path, rank: int, world: int) -> list[str]:
    """What is wrong with this rank's share of the tag's files (missing, wrong size, wrong hash)."""
    manifest = _read_manifest(tag_dir)
    if manifest is None:
        return [f"{MANIFEST} unreadable"]
    expected = manifest["files"]
    problems = []
    for name in _my_share({n: e["bytes"] for n, e in expected.items()}, rank, world):
        path, want = tag_dir / name, expected[name]
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != want["bytes"]:
            problems.append(f"{name} has {path.stat().st_size} bytes, the manifest says {want['bytes']}")
        elif _sha256(path) != want["sha256"]:
            problems.append(f"{name} does not match its SHA-256 (corrupted)")
    return problems


def verify_tag(tag_dir: str | os.PathLike[str]) -> list[str]:
    """What is wrong with the tag at ``tag_dir`` against its manifest (empty: complete); one process, no
    collective (e.g. to check a checkpoint before copying it)."""
    return _problems_in_share(Path(tag_dir), 0, 1)


def resume_tag(ckpt_dir: str | os.PathLike[str], say: Callable[[str], None] = say_on_rank0) -> ResumeChoice:
    """The newest complete checkpoint under ``ckpt_dir`` (module docstring). A collective: every rank."""
    ckpt_dir = Path(ckpt_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    skipped: list[str] = []
    for step, tag in _manifest_tags(ckpt_dir):
        problems = sorted(
            {p for part in _gather(_problems_in_share(ckpt_dir / tag, rank, world)) for p in part}
        )
        if not problems:
            if skipped:
                say(
                    f"resume: using checkpoint {tag} (step {step}), the newest complete one; skipped: "
                    + "; ".join(skipped)
                )
            return ResumeChoice(tag, step, True, tuple(skipped))
        skipped.append(f"{tag}: {', '.join(problems)}")
    if skipped:
        raise CheckpointError(
            f"--resume: no complete checkpoint under {ckpt_dir}: "
            + "; ".join(skipped)
            + ". Restore the files, or "
            "start over with --overwrite (the old run is moved aside, not deleted)"
        )
    return _legacy_tag(ckpt_dir, say)


def _legacy_tag(ckpt_dir: Path, say: Callable[[str], None]) -> ResumeChoice:
    """Without any manifest: the tag ``latest`` names (saved by plain DeepSpeed or an older ds_seqpar)."""
    latest = ckpt_dir / "latest"
    tag = latest.read_text().strip() if latest.is_file() else ""
    if not tag:
        return ResumeChoice(None)
    if not (ckpt_dir / tag).is_dir():
        raise CheckpointError(
            f"--resume: {latest} names checkpoint {tag!r}, but {ckpt_dir / tag} does not exist; put the name of an "
            f"existing tag directory in it ({', '.join(sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir())) or 'none'})"
        )
    say(
        f"resume: checkpoint {tag} has no {MANIFEST} (saved without ds_seqpar's verified save): loading it unverified"
    )
    return ResumeChoice(tag, _tag_step(tag), False)
