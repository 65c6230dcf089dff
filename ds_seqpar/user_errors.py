"""Report an expected user error once per job, as the last lines of the output, without a traceback.

A configuration or input error (a bad key, a model feature ds_seqpar refuses, a missing file, an
unusable flag, a failed step whose rank is named) is found identically on every rank, before any collective. Printed by every rank with
its traceback it would appear N times, buried above the launcher's failure report. Instead
:func:`run_main` catches the errors in ``USER_ERRORS`` and:

* the first rank of the job that reaches the report (a lock file keyed by the launcher process)
  reports it and exits with code 2; every other rank exits with code 0 at once, quietly, so the
  launcher's summary names one failed rank. Every rank that reaches the report adds a byte to the
  lock; the reporting rank waits (up to ``WINNER_WAIT_S``) until all of the machine's ranks have, then
  removes it and exits. A rank slowed by a loaded machine therefore still finds the lock, however
  late; a lock left by ranks that never got there is removed by the next job that claims one on this
  machine, once its launcher has gone;
* under ``torchrun`` the report goes into torchrun's error file (``TORCHELASTIC_ERROR_FILE``), which
  torchrun prints as the ``traceback`` line at the end of its failure summary (so does a multi-process
  ``accelerate launch``, which runs torch elastic); under DeepSpeed's launcher and in a single process
  it goes to stderr;
* ``DS_SEQPAR_DEBUG=1`` re-raises instead, with the full traceback on every rank.

Anything else (a bug, an out-of-memory error) propagates unchanged, with its traceback; inside a
training step (``StepFailed``) the cause's traceback is part of the one report.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from ds_seqpar.comm.step_watch import StepFailed
from ds_seqpar.config import SeqParConfigError
from ds_seqpar.integrations.hf_model import UnsupportedModelError
from ds_seqpar.layout import LayoutError

DEBUG_ENV = "DS_SEQPAR_DEBUG"
EXIT_CODE = 2
WINNER_WAIT_S = 10.0  # the reporting rank waits up to this long for the machine's other ranks to exit
WINNER_POLL_S = 0.05


class UsageError(SeqParConfigError):
    """A command-line flag that cannot be used (what ``argparse`` reports as ``error:``)."""


USER_ERRORS: tuple[type[BaseException], ...] = (
    SeqParConfigError,
    UnsupportedModelError,
    LayoutError,
    StepFailed,
)


LOCK_PREFIX = "ds_seqpar-error-"


def _started(pid: int) -> int:
    """When process ``pid`` started (whole seconds of its /proc entry), 0 when it is gone."""
    try:
        return int(os.stat(f"/proc/{pid}").st_ctime)
    except OSError:
        return 0


def _job_key() -> str:
    """Identifies this job among the processes of one machine: the launcher (parent) pid and its start."""
    ppid = os.getppid()
    launcher = "-".join(
        os.environ.get(k, "") for k in ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
    )
    return f"{ppid}-{_started(ppid)}-{launcher}"


def _lock_path() -> str:
    """The job's report lock: a 0-byte file in the temp directory, created by the reporting rank."""
    return os.path.join(tempfile.gettempdir(), LOCK_PREFIX + _job_key())


def _remove_gone_locks(directory: str) -> None:
    """Remove the report locks of launchers that are no longer running (their pid gone or reused)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if not name.startswith(LOCK_PREFIX):
                continue
            pid, _, rest = name.removeprefix(LOCK_PREFIX).partition("-")
            started = rest.partition("-")[0]
            if not (pid.isdigit() and started.isdigit()):
                continue
            if started == "0" or _started(int(pid)) != int(started):
                with contextlib.suppress(OSError):  # another job removed it first
                    os.remove(os.path.join(directory, name))


def _local_ranks() -> int:
    """The job's ranks on this machine (torchrun / accelerate: LOCAL_WORLD_SIZE; DeepSpeed: LOCAL_SIZE)."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "WORLD_SIZE"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 1


def _claim_report() -> bool:
    """True for the first rank of this job (on this machine) that asks; False for every later one."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return True
    path = _lock_path()
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        _count_and_release(path)
        return False
    except OSError:  # no writable temp dir: fall back to rank 0
        return os.environ.get("RANK", "0") == "0"
    os.write(fd, b"r")
    os.close(fd)
    _remove_gone_locks(os.path.dirname(path))
    return True


def _count_and_release(path: str) -> None:
    """Add this rank's byte to the lock (appends of one byte are atomic); the machine's last rank removes it."""
    with contextlib.suppress(OSError):  # removed meanwhile: nothing left to do
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, b"r")
            seen = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if seen >= _local_ranks():
            os.remove(path)  # the reporting rank may be gone already


def format_report(exc: BaseException) -> str:
    """The lines a user sees: the error's kind and its message (which names the value and the fix).

    A ``StepFailed`` whose cause is not itself a user error (a bug, out of memory) keeps the cause's
    traceback above the step's diagnosis.
    """
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, UsageError):
        return text
    report = f"ds_seqpar: error ({type(exc).__name__}): {text}"
    cause = exc.__cause__
    if isinstance(exc, StepFailed) and cause is not None and not isinstance(cause, USER_ERRORS):
        report = "".join(traceback.format_exception(cause)).rstrip() + "\n" + report
    return report + f"\n(set {DEBUG_ENV}=1 for the full traceback on every rank)"


def report(exc: BaseException) -> NoReturn:
    """Report ``exc`` once for the job (see the module docstring) and exit."""
    if not _claim_report():
        sys.stdout.flush()
        os._exit(0)  # quietly: no atexit hooks of the libraries that would print on their way out
    text = format_report(exc)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    sys.stdout.flush()
    if error_file:
        payload = {
            "message": {
                "message": text,
                "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))},
            }
        }
        with open(error_file, "w", encoding="utf-8") as fh:
            json.dump(payload, fh)
    else:
        print(text, file=sys.stderr, flush=True)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _wait_for_the_others()
    os._exit(EXIT_CODE)


def _wait_for_the_others() -> None:
    """The reporting rank: wait until every rank of this machine has found the lock (and exited quietly),
    so the launcher reports this rank alone, then remove the lock; after ``WINNER_WAIT_S`` leave it (a
    rank still on its way must find it; the next claim on this machine removes it)."""
    path, deadline = _lock_path(), time.monotonic() + WINNER_WAIT_S
    while time.monotonic() < deadline:
        try:
            if os.stat(path).st_size >= _local_ranks():
                os.remove(path)
                return
        except OSError:
            return
        time.sleep(WINNER_POLL_S)


def run_main(main: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``main(*args, **kwargs)``, with the errors in ``USER_ERRORS`` reported once (module docstring)."""
    try:
        return main(*args, **kwargs)
    except USER_ERRORS as exc:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        report(exc)
