"""One rank of the fault test (tests/test_faults.py): five all-reduce steps under ``StepWatch``;
rank ``culprit`` misbehaves at step 3 (``raise``: raises inside the step; ``die``: exits without a
word inside the step; ``hang``: never starts step 3). Run as ``python -m tests.fault_worker MODE CULPRIT TIMEOUT``
with the torch.distributed environment variables set."""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from ds_seqpar.comm.step_watch import StepWatch


def main() -> None:
    mode, culprit, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    watch = StepWatch()
    value = torch.ones(8)
    for step in range(1, 6):
        if rank == culprit and step == 3 and mode == "hang":
            time.sleep(3600)
        with watch.step(step):
            if rank == culprit and step == 3:
                if mode == "raise":
                    raise ValueError("injected fault")
                if mode == "die":
                    os._exit(17)
            dist.all_reduce(value)
    watch.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
