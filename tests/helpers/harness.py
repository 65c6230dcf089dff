"""Run functions on N gloo ranks in spawned processes: the one harness every distributed test uses.

A ``DistPool`` spawns ``world_size`` processes once, initialises a gloo process group on a free
local port, and then runs any number of tasks in that group, so a test module pays the spawn cost
once (use the ``dist_pool`` fixture from ``conftest.py``)::

    def check_allreduce(x):                      # module-level, so it pickles by reference
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    results = pool.run(check_allreduce, 1.0)     # one result per rank, in rank order

Failure handling (a test must fail, never hang):

* a rank that raises: ``DistributedTestError`` with that rank's traceback (the other ranks are
  given a short grace, then the pool is torn down and respawned by the next ``run``);
* a rank that does not finish within ``timeout`` seconds: ``DistributedTimeout`` naming the
  hanging ranks, with a stack dump of each (faulthandler on SIGUSR1);
* a rank whose process dies: ``DistributedTestError`` naming the rank and its exit code.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 180.0
ERROR_GRACE_S = 3.0


class DistributedTestError(AssertionError):
    """A rank raised or died while running a task."""


class DistributedTimeout(DistributedTestError):
    """At least one rank did not finish a task within its timeout."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    tasks: mp.Queue,
    results: mp.Queue,
    dump_path: str,
    pg_timeout_s: float,
) -> None:
    """Body of one spawned rank: join the gloo group, then run tasks until told to stop."""
    torch.set_num_threads(1)
    # what a launcher (torchrun / deepspeed) would export; DeepSpeed's engine checks LOCAL_RANK
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    dump = open(dump_path, "w")  # noqa: SIM115 - kept open for faulthandler for the process lifetime
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    results.put((rank, "ready", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, "ok", fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class DistPool:
    """``world_size`` gloo ranks in spawned processes, reused across tasks; respawned after a failure."""

    def __init__(self, world_size: int, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        self.world_size = world_size
        self.timeout = timeout
        self._procs: list[mp.Process] = []
        self._tasks: list[mp.Queue] = []
        self._results: mp.Queue | None = None
        self._dumps: list[str] = []

    # lifecycle -----------------------------------------------------------------------------
    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        dump_dir = tempfile.mkdtemp(prefix="ds_seqpar_pool_")
        self._dumps = [os.path.join(dump_dir, f"rank{r}.stack") for r in range(self.world_size)]
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, port, self._tasks[r], self._results, self._dumps[r], self.timeout),
                daemon=True,
                name=f"ds_seqpar-rank{r}",
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect(None, "start-up", self.timeout, expect="ready")

    def close(self) -> None:
        """Stop the workers (politely, then by force)."""
        for q in self._tasks:
            with contextlib.suppress(OSError, ValueError):
                q.put(None)
        deadline = time.monotonic() + 2.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)
        self._procs, self._tasks, self._results = [], [], None

    def __enter__(self) -> DistPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # running -------------------------------------------------------------------------------
    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order.

        ``fn`` must be a module-level function (pickled by reference). Raises
        ``DistributedTestError`` / ``DistributedTimeout`` instead of hanging.
        """
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self._kill()
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        return self._collect(fn, getattr(fn, "__qualname__", repr(fn)), timeout or self.timeout, expect="ok")

    def _collect(self, fn: Any, what: str, timeout: float, expect: str) -> list[Any]:
        assert self._results is not None
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world_size:
            now = time.monotonic()
            if errors:
                deadline = min(deadline, now + ERROR_GRACE_S)
            if now >= deadline:
                break
            try:
                rank, status, payload = self._results.get(timeout=min(0.2, deadline - now))
            except queue.Empty:
                dead = {
                    r: p.exitcode
                    for r, p in enumerate(self._procs)
                    if not p.is_alive() and r not in results and r not in errors
                }
                for r, code in dead.items():
                    errors[r] = f"process exited with code {code} while running {what}"
                continue
            if status == expect:
                results[rank] = payload
            else:
                errors[rank] = payload
        if len(results) == self.world_size:
            return [results[r] for r in range(self.world_size)]
        missing = [r for r in range(self.world_size) if r not in results and r not in errors]
        stacks = self._stack_dumps(missing)
        self._kill()
        if errors:
            first = min(errors)
            detail = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
            hung = f"; ranks {missing} were still running (stopped)" if missing else ""
            raise DistributedTestError(
                f"rank {first} failed in {what} (world_size={self.world_size}){hung}\n{detail}"
            )
        raise DistributedTimeout(
            f"ranks {missing} did not finish {what} within {timeout:.1f} s (world_size={self.world_size}); "
            f"stacks of the hanging ranks:\n{stacks}"
        )

    def _stack_dumps(self, ranks: list[int]) -> str:
        """Ask the given ranks for a stack dump (SIGUSR1) and return what they wrote."""
        for r in ranks:
            p = self._procs[r]
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(0.5)
        out = []
        for r in ranks:
            try:
                with open(self._dumps[r]) as fh:
                    out.append(f"--- rank {r} ---\n{fh.read().strip() or '(no dump)'}")
            except OSError:
                out.append(f"--- rank {r} ---\n(no dump)")
        return "\n".join(out)


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any
) -> list[Any]:
    """One-off: spawn ``world_size`` ranks, run ``fn`` once, tear down. Prefer a pool for many cases."""
    with DistPool(world_size, timeout=timeout) as pool:
        return pool.run(fn, *args, **kwargs)


LAUNCHER_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_launcher(cmd: list[str], cwd: str, timeout: float = 600.0, env: dict[str, str] | None = None) -> Any:
    """Run a launcher command line (``torchrun``, ``deepspeed``, ``accelerate launch``) as a user would.

    The pytest process's own distributed variables are removed, ``OMP_NUM_THREADS=1`` is set (CPU
    ranks share the cores), and ``env`` is added. Returns the ``subprocess.CompletedProcess`` with
    stdout and stderr as text; the caller asserts on it.
    """
    import subprocess

    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for key in LAUNCHER_ENV_KEYS:
        full.pop(key, None)
    return subprocess.run(
        cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout, check=False
    )
