"""The local profile's latency probe, one process of ``ranks`` (``plan/measure.py`` starts them):
``python -m ds_seqpar.plan.latency RANK RANKS PORT``; rank 0 prints ``{"round_s": ..., "allreduce_s": ...}``:
the seconds of one ring round (batched isend / irecv of 1 KiB) and of one small all-reduce, gloo over
loopback, one thread per process."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable


def _time(fn: Callable[[], None], barrier: Callable[[], None], reps: int = 100) -> float:
    for _ in range(10):
        fn()
    barrier()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main(rank: int, ranks: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    x, y = torch.zeros(256), torch.zeros(256)

    def ring() -> None:
        ops = [dist.P2POp(dist.isend, x, (rank + 1) % ranks), dist.P2POp(dist.irecv, y, (rank - 1) % ranks)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    out = {
        "round_s": _time(ring, dist.barrier),
        "allreduce_s": _time(lambda: dist.all_reduce(x), dist.barrier),
    }
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
