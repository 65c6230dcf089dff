"""Per-rank measurements shared by the benchmark suites: bytes sent, attention work, peak memory, time.

Every row of a table, ds_seqpar's and the peers', is measured by the same code:

* :class:`SentBytes` wraps ``torch.distributed``'s collectives and point-to-point calls for the
  duration of a ``with`` block and adds up what this rank sends (all-to-all: the chunks for other
  ranks; send/isend, batched or not: the sent tensors; all-gather: (P-1) x the input; all-reduce:
  2(P-1)/P x the tensor, the ring algorithm's volume).
* :func:`attention_pairs` counts query-key score pairs the local kernel computes (causal blocks
  count their lower triangle), for ds_seqpar through its kernel entry points and for the peers
  through the flash-attn shim.
* :class:`PeakMemory` is the peak resident memory of this process inside a ``with`` block above
  what was resident at its start (Linux ``/proc/self/clear_refs`` resets the high-water mark).
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_PROC = Path("/proc/self")


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class SentBytes:
    """Bytes this rank sends through ``torch.distributed`` inside the block (``.total``)."""

    def __init__(self) -> None:
        self.total = 0
        self._saved: dict[str, Any] = {}

    def _wrap(self, name: str, count: Callable[..., int]) -> None:
        original = getattr(dist, name)
        self._saved[name] = original

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.total += count(*args, **kwargs)
            return original(*args, **kwargs)

        # the same wrapper in both namespaces: ``P2POp`` checks its op against distributed_c10d's
        # ``isend``, and ``batch_isend_irecv`` calls that op, so batched sends are counted here too
        for module in (dist, c10d):
            if hasattr(module, name):
                setattr(module, name, counted)

    def __enter__(self) -> SentBytes:
        def world(group: Any) -> int:
            return dist.get_world_size(group)

        def a2a_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **_):
            p = world(group)
            if input_split_sizes:
                me = dist.get_group_rank(group, dist.get_rank()) if group is not None else dist.get_rank()
                row = _bytes(input) // max(input.shape[0], 1)
                return (input.shape[0] - input_split_sizes[me]) * row
            return _bytes(input) * (p - 1) // p

        def a2a_list(output_list, input_list, group=None, **_):
            me = dist.get_group_rank(group, dist.get_rank()) if group is not None else dist.get_rank()
            return sum(_bytes(t) for i, t in enumerate(input_list) if i != me)

        def gather_into(output, input, group=None, **_):
            return _bytes(input) * (world(group) - 1)

        def gather_list(output_list, tensor, group=None, **_):
            return _bytes(tensor) * (world(group) - 1)

        def reduce(tensor, *args, group=None, **_):
            p = world(group)
            return 2 * (p - 1) * _bytes(tensor) // p

        def send(tensor, *args, **_):
            return _bytes(tensor)

        self._wrap("all_to_all_single", a2a_single)
        self._wrap("all_to_all", a2a_list)
        self._wrap("all_gather_into_tensor", gather_into)
        self._wrap("all_gather", gather_list)
        self._wrap("all_reduce", reduce)
        self._wrap("send", send)
        self._wrap("isend", send)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            for module in (dist, c10d):
                if hasattr(module, name):
                    setattr(module, name, original)


def attention_pairs(sq: int, sk: int, heads: int, batch: int, causal: bool) -> int:
    """Score pairs of one kernel call (a top-left causal block computes its lower triangle)."""
    return batch * heads * (sq * (sq + 1) // 2 if causal else sq * sk)


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", (_PROC / "status").read_text(), re.M)
    return int(match.group(1)) if match else 0


class PeakMemory:
    """Peak resident memory (MiB) of this process inside the block, above the resident memory at its start."""

    def __enter__(self) -> PeakMemory:
        import gc

        gc.collect()
        (_PROC / "clear_refs").write_text("5")  # reset VmHWM to the current VmRSS
        self.base_kib = _status_kib("VmRSS")
        self.peak_mib = 0.0
        return self

    def __exit__(self, *exc: Any) -> None:
        self.peak_mib = max(0, _status_kib("VmHWM") - self.base_kib) / 1024


def slowest_rank_times(step: Callable[[], None], reps: int, warmup: int = 1) -> list[float]:
    """Per repetition, the slowest rank's wall time of ``step()`` (after ``warmup`` untimed runs)."""
    times = []
    for rep in range(warmup + reps):
        dist.barrier()
        start = time.perf_counter()
        step()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if rep >= warmup:
            times.append(elapsed.item())
    return times


def round_robin_times(steps: list[Callable[[], None]], reps: int) -> list[list[float]]:
    """Per step, the slowest rank's time of each of ``reps`` repetitions, the steps timed in turn and each
    round starting one step later (so no step always runs first after another's)."""
    times: list[list[float]] = [[] for _ in steps]
    for rep in range(reps):
        for j in range(len(steps)):
            i = (j + rep) % len(steps)
            times[i] += slowest_rank_times(steps[i], reps=1, warmup=0)
    return times
