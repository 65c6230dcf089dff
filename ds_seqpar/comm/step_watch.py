"""Name the rank and the step when a distributed step fails, instead of hanging or failing anonymously.

A rank that raises inside a step, dies or is stopped (SIGSTOP, a debugger, a frozen host) leaves the
other ranks blocked in a collective. Every process group's timeout (``sequence_parallel.fault_timeout_s``:
the default group's from ``init_distributed``, the mesh's from ``new_group``) bounds that wait; a dead
peer usually fails the collective at once ("connection closed"). Either way the collective's own error
says nothing about who failed. :class:`StepWatch` records, in the rendezvous key-value store every
rank already shares (no extra connections):

    ``<prefix>/beat/<rank>``    the step this rank is in, with its phase (``"4 (checkpoint save)"``)
    ``<prefix>/alive/<rank>``   a wall-clock heartbeat, refreshed by a background thread every second
    ``<prefix>/proc/<rank>``    "host | boot id | pid" of the rank's process
    ``<prefix>/failed/<rank>``  "step | error" of a rank whose step raised (its own error)
    ``<prefix>/collective/<rank>``  the same for a rank whose collective failed (a peer's fault)

and, when a step fails on this rank, raises :class:`StepFailed` naming every rank that recorded an
error, stopped its heartbeat (killed, out of memory, stopped: a process on this host is looked up in
``/proc`` to tell which) or never reached this step (hangs). Store reads never wait for a missing key
(``check`` before ``get``). An unreachable store means its host, rank 0, is gone; a store that does not
answer (a stopped or frozen rank 0 keeps its sockets open, and a read would then wait forever) is given
up after ``STORE_S`` seconds: the diagnosis runs in a helper thread the step waits for.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

PREFIX = "ds_seqpar/watch"
HEARTBEAT_S = 1.0
STALE_S = 5.0  # a heartbeat older than this means the process is gone or frozen
STORE_S = 5.0  # a store that has not answered for this long: its host (rank 0) is stopped or frozen


class StepFailed(RuntimeError):
    """A training step failed on this rank; the message names the rank(s) and step(s) at fault."""


class StoreUnresponsive(RuntimeError):
    """The rendezvous store did not answer within ``STORE_S`` seconds."""


def _this_host() -> str:
    """``"hostname|boot id"``: processes with the same value can be looked up in this ``/proc``."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}|{boot}"


def process_state(pid: int) -> str:
    """What ``/proc`` says about a process of this host, as a clause: exited, stopped, traced or running."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        state = "X"
    if state in ("X", "x", "Z"):
        return f"its process {pid} on this host has exited (killed, out of memory or crashed)"
    if state == "T":
        return f"its process {pid} on this host is stopped (SIGSTOP or job control; SIGCONT resumes it)"
    if state == "t":
        return f"its process {pid} on this host is stopped by a debugger"
    return (
        f"its process {pid} on this host still runs but its heartbeat thread is stuck (native code "
        "holding the GIL, or the machine is swapping)"
    )


def _step_of(beat: str) -> int:
    """The step number of a ``beat`` record (``"4"`` or ``"4 (checkpoint save)"``)."""
    return int(beat.split(" ", 1)[0])


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
        self._host = _this_host()
        self._last_answer = time.time()  # when the store last answered a read (the bounded diagnosis)
        self._store_lost: str | None = None  # set once the store stopped answering: no store use after
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.store.set(self._key("proc", self.rank), f"{self._host}|{os.getpid()}")
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
        value = self.store.get(key).decode() if self.store.check([key]) else None
        self._last_answer = time.time()
        return value

    @contextmanager
    def step(self, step: int, what: str = "") -> Iterator[None]:
        """Run one training step (``what``: a phase of it to name, e.g. ``"checkpoint save"``); on any
        exception raise :class:`StepFailed` with the diagnosis."""
        phase = f" ({what})" if what else ""
        if self._store_lost is not None:  # a thread may still wait on the store: do not touch it
            raise StepFailed(f"step {step}{phase} not started on rank {self.rank}: {self._store_lost}")
        self.store.set(self._key("beat", self.rank), f"{step}{phase}")  # a set never waits for an answer
        try:
            yield
        except StepFailed:
            raise
        except Exception as exc:
            first_line = (str(exc).splitlines() or [""])[0][:300]
            kind = "collective" if is_collective_error(exc) else "failed"
            record = f"{step}{phase}|{type(exc).__name__}: {first_line}"
            report = self._report(step, kind, record)
            raise StepFailed(
                f"step {step}{phase} failed on rank {self.rank} ({type(exc).__name__}: {first_line}); {report}"
            ) from exc

    def _report(self, step: int, kind: str, record: str) -> str:
        """Record this rank's failure and diagnose the others, within a bound when the store stops answering."""

        def work() -> str:
            self.store.set(self._key(kind, self.rank), record)
            if kind == "failed":  # this rank's own error: report at once, do not wait for peers
                found, _ = self._scan(step)
                report = "; ".join(found) or "no other rank recorded a failure"
            else:
                report = self.diagnose(step)
            if self.rank == 0:
                self._linger_for_peers()
            return report

        try:
            return self._bounded(work)
        except StoreUnresponsive:
            self._store_lost = (
                f"rank 0 stopped responding while this rank was in step {step}: the rendezvous store it "
                f"hosts has not answered for {STORE_S:.0f} s (rank 0 is stopped, frozen or its host is down)"
            )
            return self._store_lost
        except Exception as store_exc:
            return (
                f"the rendezvous store is unreachable ({type(store_exc).__name__}), so its host, "
                "rank 0, has most likely died"
            )

    def _bounded(self, work: Callable[[], str]) -> str:
        """``work()`` in a helper thread; :class:`StoreUnresponsive` once no store read has answered for
        ``STORE_S`` seconds (the thread is left waiting: a store read cannot be interrupted)."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = work()
            except BaseException as exc:  # re-raised in the caller's thread
                box["error"] = exc

        self._last_answer = time.time()
        thread = threading.Thread(target=run, name="ds_seqpar-step-watch-diagnosis", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(HEARTBEAT_S / 10)
            if thread.is_alive() and time.time() - self._last_answer > STORE_S:
                raise StoreUnresponsive(f"no answer from the rendezvous store for {STORE_S:.0f} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def diagnose(self, step: int, settle_s: float = STALE_S + HEARTBEAT_S) -> str:
        """Which other ranks failed, died, stopped or fell behind, as one sentence.

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
                found.append(f"rank {r} stopped responding {where}: {self._silence(r, alive, now)}")
            elif beat is None or _step_of(beat) < step:
                found.append(
                    f"rank {r} has not reached step {step} (last step {beat}): it hangs or runs slower"
                )
        return found, collective

    def _silence(self, rank: int, alive: str | None, now: float) -> str:
        """Why a rank's heartbeat stopped: ``/proc`` for a process of this host, else the possible causes."""
        since = "no heartbeat yet" if alive is None else f"no heartbeat for {now - float(alive):.0f} s"
        host, _, pid = (self._read("proc", rank) or "").rpartition("|")
        if host == self._host and pid.isdigit() and Path("/proc/self/stat").exists():
            return f"{since} and no error recorded; {process_state(int(pid))}"
        return (
            f"{since} and no error recorded (killed, out of memory, crashed, stopped by SIGSTOP or a "
            "debugger, or its host is down)"
        )

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
