"""Name the rank and the step when a distributed step fails, instead of hanging or failing anonymously.

A rank that raises inside a step, or dies, leaves the other ranks blocked in a collective. The
process group's timeout (``sequence_parallel.fault_timeout_s``, passed to ``init_process_group``)
bounds that wait; a dead peer usually fails the collective at once ("connection closed"). Either
way the collective's own error says nothing about who failed. :class:`StepWatch` records, in the
rendezvous key-value store every rank already shares (no extra connections):

    ``<prefix>/beat/<rank>``    the step this rank is in
    ``<prefix>/alive/<rank>``   a wall-clock heartbeat, refreshed by a background thread every second
    ``<prefix>/failed/<rank>``  "step | error" of a rank whose step raised (its own error)
    ``<prefix>/collective/<rank>``  the same for a rank whose collective failed (a peer's fault)

and, when a step fails on this rank, raises :class:`StepFailed` naming every rank that recorded an
error, stopped its heartbeat (killed, out of memory) or never reached this step (hangs). Store
reads never block (``check`` before ``get``); an unreachable store means its host, rank 0, is gone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

PREFIX = "ds_seqpar/watch"
HEARTBEAT_S = 1.0
STALE_S = 5.0  # a heartbeat older than this means the process is gone


class StepFailed(RuntimeError):
    """A training step failed on this rank; the message names the rank(s) and step(s) at fault."""


class StepWatch:
    """Per-rank watch over training steps (see the module docstring).

    Args:
        store: the rendezvous store (default: the default process group's store).
        rank, world: this rank and the number of ranks (default: the default group's).
        heartbeat: run the heartbeat thread (tests of the diagnosis turn it off).
    """

    def __init__(
        self, store: Any = None, rank: int | None = None, world: int | None = None, heartbeat: bool = True
    ) -> None:
        self.store = store if store is not None else dist.distributed_c10d._get_default_store()
        self.rank = dist.get_rank() if rank is None else rank
        self.world = dist.get_world_size() if world is None else world
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat_alive()
        if heartbeat:
            self._thread = threading.Thread(target=self._heartbeat, name="ds_seqpar-step-watch", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * HEARTBEAT_S)

    def _key(self, kind: str, rank: int) -> str:
        return f"{PREFIX}/{kind}/{rank}"

    def _beat_alive(self) -> None:
        self.store.set(self._key("alive", self.rank), f"{time.time():.3f}")

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat_alive()
            except Exception:  # the store is gone: the diagnosis reports it
                return

    def _read(self, kind: str, rank: int) -> str | None:
        key = self._key(kind, rank)
        return self.store.get(key).decode() if self.store.check([key]) else None

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run one training step; on any exception raise :class:`StepFailed` with the diagnosis."""
        self.store.set(self._key("beat", self.rank), str(step))
        try:
            yield
        except StepFailed:
            raise
        except Exception as exc:
            first_line = (str(exc).splitlines() or [""])[0][:300]
            kind = "collective" if is_collective_error(exc) else "failed"
            try:
                self.store.set(self._key(kind, self.rank), f"{step}|{type(exc).__name__}: {first_line}")
                if kind == "failed":  # this rank's own error: report at once, do not wait for peers
                    found, _ = self._scan(step)
                    report = "; ".join(found) or "no other rank recorded a failure"
                else:
                    report = self.diagnose(step)
                if self.rank == 0:
                    self._linger_for_peers()
            except Exception as store_exc:
                report = (
                    f"the rendezvous store is unreachable ({type(store_exc).__name__}), so its host, "
                    "rank 0, has most likely died"
                )
            raise StepFailed(
                f"step {step} failed on rank {self.rank} ({type(exc).__name__}: {first_line}); {report}"
            ) from exc

    def diagnose(self, step: int, settle_s: float = STALE_S + HEARTBEAT_S) -> str:
        """Which other ranks failed, died or fell behind, as one sentence.

        A rank that died a moment ago still has a fresh heartbeat, so when nothing is found the scan
        repeats for up to ``settle_s`` seconds before concluding.
        """
        deadline = time.time() + settle_s
        while True:
            found, collective = self._scan(step)
            if found or time.time() >= deadline:
                break
            time.sleep(HEARTBEAT_S / 2)
        if found:
            return "; ".join(found)
        if collective:
            return "; ".join(collective) + " (no rank recorded any other error)"
        return (
            f"every other rank is alive in step {step} and recorded no error: one of them hangs inside the "
            "step, or the network failed (the wait is bounded by sequence_parallel.fault_timeout_s)"
        )

    def _scan(self, step: int) -> tuple[list[str], list[str]]:
        now = time.time()
        found, collective = [], []
        for r in range(self.world):
            if r == self.rank:
                continue
            record = self._read("failed", r)
            if record is not None:
                at, _, error = record.partition("|")
                found.append(f"rank {r} raised at step {at}: {error}")
                continue
            record = self._read("collective", r)
            if record is not None:  # a victim like this rank (it may have exited since)
                at, _, error = record.partition("|")
                collective.append(f"rank {r} also lost a collective at step {at} ({error})")
                continue
            alive = self._read("alive", r)
            beat = self._read("beat", r)
            if alive is None or now - float(alive) > STALE_S:
                where = f"in step {beat}" if beat is not None else "before its first step"
                found.append(
                    f"rank {r} stopped responding {where} (no error recorded: killed, out of memory or crashed)"
                )
            elif beat is None or int(beat) < step:
                found.append(
                    f"rank {r} has not reached step {step} (last step {beat}): it hangs or runs slower"
                )
        return found, collective

    def _linger_for_peers(self, limit_s: float = STALE_S + 2 * HEARTBEAT_S) -> None:
        """Rank 0 hosts the store: keep it up until every other rank has recorded its side (or is gone),
        so their diagnoses do not blame rank 0 for the store vanishing."""
        deadline = time.time() + limit_s
        while time.time() < deadline:
            now = time.time()
            pending = [
                r
                for r in range(1, self.world)
                if self._read("failed", r) is None
                and self._read("collective", r) is None
                and now - float(self._read("alive", r) or 0.0) <= STALE_S
            ]
            if not pending:
                return
            time.sleep(HEARTBEAT_S / 4)


def is_collective_error(exc: BaseException) -> bool:
    """A communication failure (a peer died, a timeout), as opposed to an error of this rank's own work."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return any(
        sign in text for sign in ("gloo", "Connection closed", "Connection reset", "Timed out", "NCCL")
    )
