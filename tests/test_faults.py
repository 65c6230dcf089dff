"""Faults: a rank that raises, dies, hangs or is stopped makes every other rank fail within a bounded
time with a ``StepFailed`` that names that rank and step (``ds_seqpar.comm.step_watch``).

Ranks are plain processes (no launcher that would kill the survivors first), so what each survivor
says is observable. The first cases (``tests/fault_worker.py``: all-reduce steps) must each end within
60 s. The stall cases (``tests/stall_worker.py``: a tiny HF model through ``ds_seqpar.initialize`` with
ZeRO-3) SIGSTOP one rank at a chosen communication call, in the forward, the backward, the optimizer
step or the checkpoint save; every survivor must raise ``StepFailed`` naming it within
``fault_timeout_s + 10`` s of the stall, and exit. Several worlds run at once (the wait after a stall is
mostly idle).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ds_seqpar.comm import step_watch

ROOT = Path(__file__).resolve().parents[1]
WORLD, CULPRIT, TIMEOUT_S = 4, 2, 8.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(mode: str, tmp_path: Path) -> tuple[dict[int, int | None], dict[int, str], float]:
    port = _free_port()
    procs, logs = {}, {}
    start = time.time()
    for rank in range(WORLD):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "LOCAL_RANK": str(rank),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
        }
        logs[rank] = tmp_path / f"rank{rank}.log"
        procs[rank] = subprocess.Popen(
            [sys.executable, "-m", "tests.fault_worker", mode, str(CULPRIT), str(TIMEOUT_S)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=logs[rank].open("w"),
        )
    codes: dict[int, int | None] = {}
    for rank, proc in procs.items():
        if rank == CULPRIT and mode == "hang":
            continue
        try:
            codes[rank] = proc.wait(timeout=max(1.0, 60 - (time.time() - start)))
        except subprocess.TimeoutExpired:
            codes[rank] = None
    elapsed = time.time() - start
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return codes, {r: p.read_text() for r, p in logs.items()}, elapsed


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("raise", f"rank {CULPRIT} raised at step 3: ValueError: injected fault"),
        ("die", f"rank {CULPRIT} stopped responding in step 3: no heartbeat for"),
        ("hang", f"rank {CULPRIT} has not reached step 3 (last step 2)"),
    ],
)
def test_survivors_name_the_failed_rank_and_step(tmp_path: Path, mode: str, says: str) -> None:
    codes, logs, elapsed = _run_ranks(mode, tmp_path)
    assert elapsed < 60, f"{mode}: the ranks took {elapsed:.0f} s"
    for rank in range(WORLD):
        if rank == CULPRIT:
            continue
        assert codes[rank] not in (None, 0), (
            f"{mode}: rank {rank} exit code {codes[rank]}\n{logs[rank][-2000:]}"
        )
        assert "StepFailed: step 3 failed on rank" in logs[rank], logs[rank][-2000:]
        assert says in logs[rank], f"{mode}: rank {rank} does not say {says!r}:\n{logs[rank][-2000:]}"
        if mode == "die":  # a process of this host: /proc tells that it is gone
            assert "on this host has exited (killed, out of memory or crashed)" in logs[rank], logs[rank][
                -2000:
            ]
    if mode == "raise":
        assert f"StepFailed: step 3 failed on rank {CULPRIT} (ValueError: injected fault)" in logs[CULPRIT]


# --- the diagnosis on a store of this process -------------------------------------------------------
class _DictStore:
    """The three store calls StepWatch makes; ``frozen`` makes reads wait forever, as a stopped host's do."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.frozen = threading.Event()

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        if self.frozen.is_set():
            threading.Event().wait()
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]


def test_a_stopped_process_and_a_phase_are_named() -> None:
    """A peer on this host whose heartbeat is stale is looked up in /proc (stopped, exited); the phase label
    of ``watch.step(step, what=...)`` is in this rank's message and in the peers' view of its record."""
    store = _DictStore()
    watch = step_watch.StepWatch(store, rank=0, world=3, heartbeat=False)
    peer = step_watch.StepWatch(store, rank=1, world=3, heartbeat=False)
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        time.sleep(0.2)
        host = store.get(f"{step_watch.PREFIX}/proc/0").decode().rpartition("|")[0]
        store.set(f"{step_watch.PREFIX}/proc/2", f"{host}|{stopped.pid}")
        store.set(f"{step_watch.PREFIX}/alive/2", f"{time.time() - 30:.3f}")
        store.set(f"{step_watch.PREFIX}/beat/2", "4 (checkpoint save)")
        with pytest.raises(step_watch.StepFailed) as failed, peer.step(4, what="checkpoint save"):
            raise ValueError("disk full")
        assert str(failed.value).startswith(
            "step 4 (checkpoint save) failed on rank 1 (ValueError: disk full)"
        )
        found, _ = watch._scan(4)
        assert found[0] == "rank 1 raised at step 4 (checkpoint save): ValueError: disk full", found
        assert found[1].startswith(
            "rank 2 stopped responding in step 4 (checkpoint save): no heartbeat for 30 s"
        )
        assert f"its process {stopped.pid} on this host is stopped (SIGSTOP" in found[1], found
    finally:
        stopped.kill()
        stopped.wait()
    assert "has exited" in step_watch.process_state(stopped.pid)
    assert "still runs" in step_watch.process_state(os.getpid())


def test_a_silent_store_is_given_up_within_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopped rank 0 keeps the store's sockets open and a read waits forever: the diagnosis gives up
    after STORE_S, names rank 0, and the watch never touches the store again."""
    monkeypatch.setattr(step_watch, "STORE_S", 0.5)
    store = _DictStore()
    watch = step_watch.StepWatch(store, rank=1, world=2, heartbeat=False)
    store.frozen.set()
    start = time.time()
    with pytest.raises(step_watch.StepFailed) as failed, watch.step(7):
        raise RuntimeError("Timed out waiting 8000ms for recv operation to complete")
    assert time.time() - start < 2.0
    assert "rank 0 stopped responding while this rank was in step 7" in str(failed.value), failed.value
    with (
        pytest.raises(step_watch.StepFailed, match="step 8 not started on rank 1: rank 0 stopped responding"),
        watch.step(8),
    ):
        pass


# --- a rank stopped (SIGSTOP) at a communication call -------------------------------------------------
STALL_TIMEOUT_S = 8.0  # sequence_parallel.fault_timeout_s of the stall worlds
BOUND_S = STALL_TIMEOUT_S + 10  # a survivor's StepFailed comes at most this long after the stall
EXIT_S = 30.0  # ... and its process has exited this long after the stall at the latest
START_LIMIT_S = 900.0  # imports, ZeRO-3 initialisation and the steps before the stall (a loaded machine)
MAX_PROCS = 8  # rank processes alive at once


@dataclass(frozen=True)
class Stall:
    """A world and its stall point: ``model`` (``usp``: llama with U = 2, ``ring``: llama with U = 1, or a
    hybrid: ``qwen3_next`` = delta scan, ``bamba`` = linear scan), ``point`` = STEP:PHASE:FUNCTION:K
    (tests/stall_worker.py)."""

    name: str
    model: str
    sp: int
    culprit: int
    point: str

    def spec(self, out: Path) -> dict:
        kind, u = {"usp": ("llama", 2), "ring": ("llama", 1)}.get(self.model, (self.model, 1))
        if self.model == "qwen3_next" and self.sp == 4:
            u = 2
        return dict(model=kind, sp=self.sp, u=u, timeout=STALL_TIMEOUT_S, culprit=self.culprit,
                    point=self.point, steps=3, save_at=2, seq_len=32, out=str(out))  # fmt: skip

    def expected(self, rank: int) -> list[str]:
        """What survivor ``rank``'s ``StepFailed`` must say: its step (and phase), and who stopped."""
        step, phase = self.point.split(":")[:2]
        label = " (checkpoint save)" if phase == "save" else ""
        says = [f"step {step}{label} failed on rank {rank}"]
        if self.culprit == 0:  # rank 0 hosts the store: a stopped rank 0 leaves it silent
            return [*says, f"rank 0 stopped responding while this rank was in step {step}"]
        return [
            *says,
            f"rank {self.culprit} stopped responding in step {step}{label}: ",
            "is stopped (SIGSTOP",
        ]


@dataclass
class _World:
    stall: Stall
    out: Path
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    start: float = field(default_factory=time.time)
    codes: dict[int, int | None] = field(default_factory=dict)
    problem: str = ""

    def launch(self) -> None:
        self.out.mkdir(parents=True)
        spec, port = json.dumps(self.stall.spec(self.out)), _free_port()
        for rank in range(self.stall.sp):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                   "WORLD_SIZE": str(self.stall.sp), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": str(ROOT)}  # fmt: skip
            self.procs[rank] = subprocess.Popen(
                [sys.executable, "-m", "tests.stall_worker", spec], cwd=ROOT, env=env,
                stdout=subprocess.DEVNULL, stderr=(self.out / f"rank{rank}.log").open("w"),
            )  # fmt: skip

    def stall_time(self) -> float | None:
        path = self.out / "stall.json"
        return json.loads(path.read_text())["time"] if path.exists() else None

    def poll(self) -> bool:
        """Whether the world is over: every survivor exited, or a limit passed (then ``problem`` says which)."""
        survivors = [r for r in self.procs if r != self.stall.culprit]
        self.codes = {r: self.procs[r].poll() for r in survivors}
        stalled = self.stall_time()
        if all(code is not None for code in self.codes.values()):
            self.problem = "" if stalled is not None else "the ranks ended without the stall"
            return True
        if stalled is None and time.time() - self.start > START_LIMIT_S:
            self.problem = f"no stall within {START_LIMIT_S:.0f} s"
        elif stalled is not None and time.time() - stalled > EXIT_S:
            self.problem = f"survivors still running {EXIT_S:.0f} s after the stall: {self.codes}"
        return bool(self.problem)

    def kill(self) -> None:
        for proc in self.procs.values():  # SIGKILL ends a stopped process too
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def failures(self) -> tuple[list[str], dict[int, float]]:
        """What is wrong with this world's survivors, and each one's seconds from the stall to StepFailed."""
        wrong, seconds = ([self.problem] if self.problem else []), {}
        stalled = self.stall_time()
        for path in sorted(self.out.glob("groups*.json")):  # every group waits fault_timeout_s, no longer
            groups = json.loads(path.read_text())
            if any(g["timeout_s"] != STALL_TIMEOUT_S for g in groups):
                wrong.append(
                    f"{path.stem}: a process group without fault_timeout_s={STALL_TIMEOUT_S:g}: {groups}"
                )
        for rank, code in self.codes.items():
            log = (self.out / f"rank{rank}.log").read_text()[-3000:]
            path = self.out / f"fail{rank}.json"
            if code != 3 or not path.exists() or stalled is None:
                wrong.append(f"rank {rank}: exit code {code}, no StepFailed recorded:\n{log}")
                continue
            fail = json.loads(path.read_text())
            seconds[rank] = fail["time"] - stalled
            missing = [text for text in self.stall.expected(rank) if text not in fail["message"]]
            if missing or seconds[rank] > BOUND_S:
                wrong.append(f"rank {rank} after {seconds[rank]:.1f} s (bound {BOUND_S:.0f} s), missing {missing}: "
                             f"{fail['message']}")  # fmt: skip
        return wrong, seconds


def _run_stalls(stalls: list[Stall], tmp_path: Path) -> None:
    """Run every world (at most ``MAX_PROCS`` rank processes at once) and assert on all of them."""
    waiting, running, done = list(stalls), [], []
    try:
        while waiting or running:
            while waiting and sum(w.stall.sp for w in running) + waiting[0].sp <= MAX_PROCS:
                stall = waiting.pop(0)
                running.append(_World(stall, tmp_path / f"{stall.name}-P{stall.sp}"))
                running[-1].launch()
            time.sleep(0.2)
            for world in [w for w in running if w.poll()]:
                world.kill()
                running.remove(world)
                done.append(world)
    finally:  # an interrupted test leaves no rank behind, stopped or not
        for world in running:
            world.kill()
    report, wrong = [], []
    for world in done:
        problems, seconds = world.failures()
        times = ", ".join(f"rank {r} {t:.1f} s" for r, t in sorted(seconds.items()))
        report.append(f"{world.stall.name} (P={world.stall.sp}, culprit {world.stall.culprit}): {times}")
        wrong += [f"{world.stall.name}: {p}" for p in problems]
    print("seconds from the stall to StepFailed:\n" + "\n".join(report))
    assert not wrong, "\n".join(wrong) + "\n\n" + "\n".join(report)


# (name, model, culprit at P = 2, culprit at P = 4, point): every path's communication, in the forward,
# the backward, DeepSpeed's optimizer step and the checkpoint save; culprit 0 also stops the store's host
SWEEP = [
    ("ulysses-a2a-forward", "usp", 1, 3, "1:forward:all_to_all_single:3"),
    ("ulysses-a2a-backward", "usp", 0, 2, "2:backward:all_to_all_single:5"),
    ("ring-p2p-forward", "ring", 1, 1, "1:forward:batch_isend_irecv:2"),
    ("ring-p2p-backward", "ring", 1, 2, "2:backward:batch_isend_irecv:4"),
    ("delta-scan-forward", "qwen3_next", 1, 3, "1:forward:isend:2"),
    ("delta-scan-backward", "qwen3_next", 0, 1, "1:backward:irecv:3"),
    ("linear-scan-forward", "bamba", 1, 2, "1:forward:irecv:2"),
    ("zero3-gather-forward", "usp", 1, 0, "1:forward:all_gather_into_tensor:7"),
    ("zero3-gather-backward", "usp", 1, 3, "1:backward:all_gather_into_tensor:5"),
    ("zero3-reduce-scatter", "usp", 1, 1, "2:backward:reduce_scatter_tensor:1"),
    ("optimizer-step", "usp", 1, 2, "2:step:all_reduce:1"),
    ("save-barrier", "usp", 0, 3, "2:save:barrier:1"),
    ("save-all-reduce", "usp", 1, 0, "2:save:all_reduce:2"),
]


def _sweep(sp: int, names: tuple[str, ...] | None = None) -> list[Stall]:
    """The sweep's stall points at ``sp`` ranks (all, or those named)."""
    return [
        Stall(name, model, sp, c2 if sp == 2 else c4, point)
        for name, model, c2, c4, point in SWEEP
        if names is None or name in names
    ]


def test_a_stopped_rank_is_named_within_the_timeout(tmp_path: Path) -> None:
    """Three stall points at P = 2, at once: the Ulysses all-to-all in the backward (rank 0, the store's
    host, stopped), the ring's p2p in the backward, and the checkpoint save's barrier."""
    stalls = _sweep(2, ("ulysses-a2a-backward", "ring-p2p-backward"))
    _run_stalls([*stalls, Stall("save-barrier", "usp", 2, 1, "2:save:barrier:1")], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [2, 4])
def test_every_stall_point_is_named_within_the_timeout(tmp_path: Path, sp: int) -> None:
    """The whole sweep: 13 stall points over every path's communication (Ulysses, ring p2p, the delta and
    linear scans, ZeRO-3's gathers and reduce-scatters, the optimizer step, the checkpoint save)."""
    _run_stalls(_sweep(sp), tmp_path)
