"""The candidates the planner ranks: every mesh and ring choice the settings' rules allow
(docs/plan.md "Candidates").

A candidate is P (SP degree; dp = world / P), U (Ulysses degree, U | P, allowed by the head counts),
R = P / U, the ring schedule with its own choice (a double ring's inner ring, TASP's domain, StarTrail's
team size, ATTENTION2D's grid), the token layout, the memory savings and the micro-batch. Each is checked
by the same rules a config is (``config/section.py``, ``settings.resolve_settings``): what a user could
not configure is never proposed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ds_seqpar.comm.model import SCHEDULES, attention2d_grids, startrail_team_sizes, tasp_domains
from ds_seqpar.settings import divisors

__all__ = ["MEMORY_SAVINGS", "Candidate", "allowed_ulysses", "candidates"]

# the memory.* choices the planner tries, lightest first (docs/memory.md "What each saving does")
MEMORY_SAVINGS: dict[str, tuple[str, ...]] = {
    "none": (),
    "checkpointing": ("activation_checkpointing",),
    "checkpointing+tiled": ("activation_checkpointing", "tiled_mlp", "tiled_norms"),
    "all": ("activation_checkpointing", "offload", "tiled_mlp", "tiled_norms"),
}


@dataclass(frozen=True)
class Candidate:
    """One configuration: sizes, ring schedule and its choice, layout, memory savings, micro-batch."""

    size: int  # P
    ulysses: int  # U
    schedule: str = "p2p"
    inner: int | None = None  # double ring R_in / TASP domain d; None: a single ring (domain R)
    team_size: int | None = None  # StarTrail C
    grid: tuple[int, int] | None = None  # ATTENTION2D (P_q, P_kv)
    layout: str = "zigzag"
    memory: str = "none"  # a key of MEMORY_SAVINGS
    micro_batch: int = 1
    data_parallel: int = 1
    dynamic: bool = False  # sequence_parallel.dynamic_degree (layout "documents" only; docs/balance.md)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def ring(self) -> int:
        """R = P / U."""
        return self.size // self.ulysses

    @property
    def policy(self) -> str:
        """The SP-degree policy: ``dynamic`` (a degree per batch, ``dynamic_degree``) or ``fixed`` (P)."""
        return "dynamic" if self.dynamic else "fixed"

    @property
    def ring_label(self) -> str:
        """The schedule as a reader names it: ring, double ring (R_in), all-gather, TASP, StarTrail, 2D."""
        if self.ring == 1:
            return "none (R = 1)"
        if self.schedule == "p2p":
            return f"double ring (inner {self.inner})" if self.inner else "ring"
        if self.schedule == "tasp":
            return f"tasp (d {self.inner or self.ring})"
        if self.schedule == "startrail":
            return f"startrail (C {self.team_size})"
        if self.schedule == "attention2d":
            return f"attention2d ({self.grid[0]}x{self.grid[1]})"
        return self.schedule

    def section(self) -> dict[str, Any]:
        """The ``sequence_parallel`` section of this candidate (``ranks_per_node`` left to the caller)."""
        ring: dict[str, Any] = {"schedule": self.schedule, "layout": self.layout}
        if self.inner is not None:
            ring["inner_size"] = self.inner
        if self.team_size is not None:
            ring["team_size"] = self.team_size
        if self.grid is not None:
            ring["grid"] = list(self.grid)
        section = {
            "size": self.size,
            "ulysses_degree": self.ulysses,
            "ring": ring,
            "memory": {key: True for key in MEMORY_SAVINGS[self.memory]},
        }
        return section | ({"dynamic_degree": True} if self.dynamic else {})


def allowed_ulysses(size: int, heads: int, kv_heads: int) -> list[int]:
    """U | P with U <= H, the query heads split evenly (H % U == 0) and the K/V heads either split
    (H_kv % U == 0) or replicated evenly (U % H_kv == 0): the Ulysses rules of ``settings.py``."""
    return [
        u
        for u in divisors(size)
        if u <= heads and heads % u == 0 and (kv_heads % u == 0 or u % kv_heads == 0)
    ]


def _ring_choices(ring: int, ulysses: int, ranks_per_node: int) -> Iterator[dict[str, Any]]:
    """The schedules over R ring ranks of stride U: ring, double ring (inner = the ring ranks of one node),
    all-gather, TASP, StarTrail (C > 1), ATTENTION2D (both sides > 1)."""
    if ring == 1:
        yield {"schedule": "p2p"}
        return
    per_node = ranks_per_node // ulysses if ranks_per_node % ulysses == 0 else 0
    inner = per_node if 1 < per_node < ring and ring % per_node == 0 else None
    yield {"schedule": "p2p"}
    if inner:
        yield {"schedule": "p2p", "inner": inner}
    yield {"schedule": "all_gather"}
    if "tasp" in SCHEDULES and (inner or ring) in tasp_domains(ring):
        yield {"schedule": "tasp", "inner": inner}
    for c in startrail_team_sizes(ring):
        if c > 1:
            yield {"schedule": "startrail", "team_size": c}
    for grid in attention2d_grids(ring):
        if min(grid) > 1:
            yield {"schedule": "attention2d", "grid": tuple(grid)}


def candidates(
    sizes: Sequence[int],
    world: int,
    heads: int,
    kv_heads: int,
    ranks_per_node: int,
    *,
    layouts: Sequence[str] = ("zigzag",),
    memory: Sequence[str] = tuple(MEMORY_SAVINGS),
    micro_batches: Sequence[int] = (1,),
) -> Iterator[Candidate]:
    """Every candidate of the SP degrees ``sizes`` (each dividing ``world``), checked by the config rules."""
    for size in sizes:
        for u in allowed_ulysses(size, heads, kv_heads):
            for choice in _ring_choices(size // u, u, ranks_per_node):
                for layout in layouts:
                    if layout != "zigzag" and not SCHEDULES[choice["schedule"]].places_documents:
                        continue
                    for saving in memory:
                        for batch in micro_batches:
                            yield Candidate(size, u, layout=layout, memory=saving, micro_batch=batch,
                                            data_parallel=world // size, **choice)  # fmt: skip
