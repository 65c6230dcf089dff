"""``main``: check the flags, then either run on the launcher's ranks or start them through torch's own
launcher (``torch.distributed.run``, the code behind ``torchrun``) and report their verdict.

Exit codes: 0 PASS, 1 FAIL (a difference above the tolerance), 2 bad input (reported once, before any
process group), 3 a rank crashed (its traceback is above torchrun's summary).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings

import torch

from ds_seqpar.errors import SeqParConfigError
from ds_seqpar.verify.args import parse_args
from ds_seqpar.verify.compare import run_comparison
from ds_seqpar.verify.report import header, loss_table, module_table, progress_line, verdict

__all__ = ["RESULT_ENV", "main"]

# set by the plain invocation for the ranks it starts: rank 0 writes the verdict there, every rank exits 0
RESULT_ENV = "DS_SEQPAR_VERIFY_RESULT"
CRASH_EXIT_CODE = 3


def main(argv: list[str] | None = None) -> int:
    """``python -m ds_seqpar.verify``; returns the exit code."""
    warnings.filterwarnings("ignore", message=r".*is deprecated", category=FutureWarning)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if not args.launched:
        return relaunch(args, argv)
    return run_ranks(args)


def relaunch(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``args.world`` ranks of this command through ``torch.distributed.run`` (standalone rendezvous;
    on CPU gloo with ``OMP_NUM_THREADS=1``) and return the verdict of rank 0."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args as torchrun_args
    from torch.distributed.run import run as torchrun

    nproc = args.world
    if torch.cuda.is_available() and torch.cuda.device_count() < nproc:
        raise SeqParConfigError(
            f"{args.ds_config}: sequence_parallel needs {nproc} ranks but {torch.cuda.device_count()} GPU(s) are "
            "visible; lower sequence_parallel.size, or launch on more GPUs with torchrun / deepspeed yourself"
        )
    if not torch.cuda.is_available():
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # the ranks share the cores
    fd, result_path = tempfile.mkstemp(prefix="ds_seqpar-verify-", suffix=".json")
    os.close(fd)
    os.environ[RESULT_ENV] = result_path
    launch = ["--standalone", f"--nproc_per_node={nproc}", "-m", "ds_seqpar.verify", *argv]
    print(f"verify: starting {nproc} ranks: python -m torch.distributed.run {' '.join(launch)}", flush=True)
    try:
        torchrun(torchrun_args(launch))
        with open(result_path, encoding="utf-8") as fh:
            return 0 if json.load(fh)["passed"] else 1
    except ChildFailedError as exc:
        codes = [failure.exitcode for failure in exc.failures.values()]
        print(
            f"verify: {len(codes)} rank(s) failed (exit codes {codes}); see their output above",
            file=sys.stderr,
        )
        return 2 if 2 in codes else CRASH_EXIT_CODE
    finally:
        os.environ.pop(RESULT_ENV, None)
        os.unlink(result_path)


def run_ranks(args: argparse.Namespace) -> int:
    """This rank's part of the comparison; rank 0 prints. Returns 0 (PASS) / 1 (FAIL); when the plain
    invocation started the ranks, rank 0 writes the verdict to ``RESULT_ENV`` and every rank exits 0."""
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))

    def say(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    device = f"cuda ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "cpu (gloo)"
    for line in header(args, device):
        say(line)
    owned = not dist.is_initialized()  # a process group made here is destroyed here
    result = run_comparison(args, progress=lambda loss: say(progress_line(loss, args.steps)))
    found = verdict(result, args.tolerance)
    for line in [*loss_table(result.losses, args.tolerance), *module_table(result.modules, args.tolerance)]:
        say(line)
    say(found.line)
    result_path = os.environ.get(RESULT_ENV)
    if rank == 0 and result_path:
        with open(result_path, "w", encoding="utf-8") as fh:
            json.dump({"passed": found.passed, "worst": found.worst_name}, fh)
    if owned:
        dist.barrier()
        dist.destroy_process_group()
    if owned and result_path:
        # The verdict is written; a rank started by ``relaunch`` skips the interpreter's teardown, where a
        # library thread left joinable now and then aborts the process ("terminate called without an
        # active exception") and would turn a finished verdict into a crash.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0 if found.passed else 1
