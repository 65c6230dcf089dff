"""Faults: a rank that raises, dies or hangs at step 3 makes every other rank fail within a bounded
time with a ``StepFailed`` that names that rank and step (``ds_seqpar.comm.step_watch``).

Ranks are plain processes (no launcher that would kill the survivors first), so what each survivor
says is observable; every case must end within 60 s.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
        ("die", f"rank {CULPRIT} stopped responding in step 3"),
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
    if mode == "raise":
        assert f"StepFailed: step 3 failed on rank {CULPRIT} (ValueError: injected fault)" in logs[CULPRIT]
