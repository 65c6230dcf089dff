"""Shared fixtures: one pool of gloo ranks per (test module, world size)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # Triton kernels run in its CPU interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable, Iterator

import pytest

from tests.helpers.harness import DistPool


@pytest.fixture(scope="module")
def dist_pool() -> Iterator[Callable[[int], DistPool]]:
    """``dist_pool(n)`` returns this module's pool of ``n`` gloo ranks (spawned on first use)."""
    pools: dict[int, DistPool] = {}

    def get(world_size: int) -> DistPool:
        if world_size not in pools:
            pools[world_size] = DistPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
