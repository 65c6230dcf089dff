"""The distributed harness itself: results, error propagation, hangs and dead ranks fail fast."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers.harness import DistPool, DistributedTestError, DistributedTimeout


def sum_of_ranks(offset: float) -> float:
    t = torch.tensor([float(dist.get_rank()) + offset])
    dist.all_reduce(t)
    return t.item()


def raise_on_rank(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from rank {bad_rank}")
    dist.barrier()  # the healthy ranks block here: the harness must not wait for them forever
    return dist.get_rank()


def hang_on_rank(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        time.sleep(3600)
    return dist.get_rank()


def exit_on_rank(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        os._exit(3)
    return dist.get_rank()


def test_results_come_back_in_rank_order(dist_pool):
    pool = dist_pool(4)
    assert pool.run(sum_of_ranks, 0.5) == [8.0] * 4
    assert pool.run(dist.get_rank) == [0, 1, 2, 3]


def test_raising_rank_is_named_with_its_traceback():
    with DistPool(3, timeout=60) as pool:
        with pytest.raises(DistributedTestError, match=r"rank 2 failed in raise_on_rank") as info:
            pool.run(raise_on_rank, 2)
        assert "ValueError: boom from rank 2" in str(info.value)
        # the pool respawns after a failure and keeps working
        assert pool.run(sum_of_ranks, 0.0) == [3.0] * 3


def test_hanging_rank_fails_within_timeout_and_is_named():
    with DistPool(2, timeout=60) as pool:
        pool.run(sum_of_ranks, 0.0)  # warm: spawn cost is not part of the measured hang
        start = time.monotonic()
        with pytest.raises(
            DistributedTimeout, match=r"ranks \[1\] did not finish hang_on_rank within 3.0 s"
        ) as info:
            pool.run(hang_on_rank, 1, timeout=3.0)
        assert time.monotonic() - start < 20.0
        assert "time.sleep" in str(info.value) or "hang_on_rank" in str(info.value)


def test_dead_rank_is_named_with_exit_code():
    with (
        DistPool(2, timeout=60) as pool,
        pytest.raises(DistributedTestError, match=r"(?s)rank 1 failed.*exited with code 3"),
    ):
        pool.run(exit_on_rank, 1)
