"""``attention2d``: a grid of P_q x P_kv ring ranks; Q gathered along rows, K/V along columns (docs/schedules.md).

Legend: ring rank r = i·P_kv + j (row i, column j); a grid row is the query team (P_kv ranks), a column
the K/V group (P_q ranks). The engine runs on the row's gathered query rows against ONE block, the
column's all-gathered K/V; ``parallel/team.py`` merges the row's partial outputs by their LSE. Backward
reduce-scatters dK/dV over the column (and dQ over the row). Degenerate grids: (R, 1) is all-gather-KV
context parallelism byte for byte, (1, R) all-gather-Q with an all-to-all output merge.

Bytes per peer and rounds: docs/comm_model.md "ATTENTION2D".
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

import torch

from ds_seqpar.comm.layer_bytes import LayerShape, PeerBytes, add_bytes
from ds_seqpar.comm.p2p import Block, Payload
from ds_seqpar.comm.schedules.base import (
    RingParams,
    ScheduleSpec,
    TeamRanks,
    check_ring_rank,
    refuse_double_ring,
)
from ds_seqpar.comm.team import TeamComm
from ds_seqpar.layout.composite import GroupLayout

__all__ = ["Attention2DSpec", "GridColumnSchedule", "attention2d_grids", "attention2d_peers", "grid_parts"]


def attention2d_grids(ring: int) -> list[tuple[int, int]]:
    """Valid ATTENTION2D grids (P_q, P_kv) with P_q · P_kv = R."""
    return [(ring // p_kv, p_kv) for p_kv in range(1, ring + 1) if ring % p_kv == 0]


def attention2d_peers(ring: int, rank: int, grid: tuple[int, int] | None) -> tuple[list[int], list[int]]:
    """(row peers, column peers) of ring rank ``rank`` = i·P_kv + j on the grid (P_q, P_kv): row peers
    i·P_kv + j' (j' ≠ j, the Q gather / output merge), column peers i'·P_kv + j (i' ≠ i, the K/V gather)."""
    check_ring_rank(ring, rank)
    if grid is None or len(grid) != 2 or any(not isinstance(p, int) or p < 1 for p in grid):
        raise ValueError(f"attention2d needs grid=(P_q, P_kv) of positive ints; got grid={grid!r}")
    p_q, p_kv = grid
    if p_q * p_kv != ring:
        raise ValueError(
            f"attention2d grid={grid!r}: P_q·P_kv = {p_q * p_kv} must equal R={ring}; "
            f"valid: {attention2d_grids(ring)}"
        )
    i, j = divmod(rank, p_kv)
    return [i * p_kv + jj for jj in range(p_kv) if jj != j], [ii * p_kv + j for ii in range(p_q) if ii != i]


def grid_parts(rows: int, cols: int) -> tuple[list[list[int]], list[list[int]]]:
    """ATTENTION2D rows (``cols`` consecutive ring ranks) and columns (``rows`` ranks of stride ``cols``)."""
    return (
        [[i * cols + j for j in range(cols)] for i in range(rows)],
        [[i * cols + j for i in range(rows)] for j in range(cols)],
    )


class GridColumnSchedule(TeamRanks):
    """ATTENTION2D's K/V side: the column's K/V as one block; dK/dV reduce-scattered over the column.

    Args:
        row: the grid row's ``TeamComm`` (P_kv ranks: the query team); column: the column's (P_q ranks).
        rows, cols: the ring ranks of every grid row and column (query and K/V groups).
        i, j: this rank's grid coordinates.
    """

    gathers_kv = False  # K/V are gathered over the column, by this schedule

    def __init__(
        self,
        row: TeamComm,
        column: TeamComm,
        rows: tuple[tuple[int, ...], ...],
        cols: tuple[tuple[int, ...], ...],
        i: int,
        j: int,
    ) -> None:
        self.team_comm, self.column, self.query_groups, self.key_groups = row, column, rows, cols
        self.query_rank, self.member = i, j  # grid row i (the query team), column j

    @property
    def size(self) -> int:
        return 1

    def incoming(self) -> None:
        return None  # the column gathers whole blocks: no accumulator travels

    def backward_variant(self, wanted: str, shape: LayerShape) -> str:
        """Always ``kv``: K/V are gathered over the column, nothing travels a sub-ring."""
        return "kv"

    def forward(self, kv: Payload) -> Iterator[Block]:
        yield self.member, self.column.gather(*kv)

    def backward(self, kv: Payload) -> Generator[Block, list[torch.Tensor], Payload]:
        grads = yield self.member, self.column.gather(*kv)
        out = self.column.reduce_rows(*grads)
        grads.clear()
        return out


class Attention2DSpec(ScheduleSpec):
    """The ``attention2d`` schedule on ``ring.grid`` = [P_q, P_kv] with P_q x P_kv = R."""

    name = "attention2d"
    summary = "grid of P_q x P_kv ranks: Q gathered along rows, K/V along columns, outputs merged along rows"
    owns = ("grid",)
    places_documents = False
    runner = "team"

    def check_section(self, ring: Any) -> None:
        refuse_double_ring(ring, self.name)

    def check_degree(self, ring: Any, ring_degree: int) -> None:
        grid = ring.grid
        if grid is None or grid[0] < 1 or grid[1] < 1 or grid[0] * grid[1] != ring_degree:
            valid = [f"[{d}, {ring_degree // d}]" for d in range(1, ring_degree + 1) if ring_degree % d == 0]
            raise ValueError(
                f"sequence_parallel.ring.grid={grid} does not suit ring.schedule='attention2d' on the ring degree "
                f"R={ring_degree}: P_q x P_kv must equal R; valid: {', '.join(valid)}"
            )

    def build(self, mesh: Any, params: RingParams) -> GridColumnSchedule:
        rows, cols = params.grid
        stats, (i, j) = mesh.comm_stats, divmod(mesh.coords.ring_rank, cols)
        row_parts, col_parts = grid_parts(rows, cols)
        row = TeamComm(*mesh.ring_subgroup(f"grid_rows_{rows}x{cols}", row_parts), stats)
        column = TeamComm(*mesh.ring_subgroup(f"grid_cols_{rows}x{cols}", col_parts), stats)
        rows_of, cols_of = tuple(tuple(p) for p in row_parts), tuple(tuple(p) for p in col_parts)
        return GridColumnSchedule(row, column, rows_of, cols_of, i, j)

    def layouts(self, schedule: Any, base: Any) -> tuple[Any, Any]:
        return GroupLayout(base, schedule.key_groups), GroupLayout(base, schedule.query_groups)

    def cache_key(self, params: RingParams) -> tuple:
        return (self.name, params.grid)

    def peer_bytes(self, shape: LayerShape, params: RingParams, rank: int, backward: bool) -> PeerBytes:
        """Q gathered over the row, K/V over the column, outputs merged over the row."""
        row, column = attention2d_peers(params.ring, rank, params.grid)
        b, a, out = shape.element_bytes, shape.acc_bytes, {}
        for peer in row:
            if backward:
                add_bytes(out, rank, peer, "all_gather", 2 * shape.q_elements * b + 2 * shape.row_heads * a)
                add_bytes(out, rank, peer, "reduce_scatter", shape.q_elements * a)
            else:
                add_bytes(out, rank, peer, "all_gather", shape.q_elements * b)
                add_bytes(out, rank, peer, "all_to_all", shape.row_heads * (shape.head_dim + 1) * a)
        for peer in column:
            add_bytes(out, rank, peer, "all_gather", 2 * shape.kv_elements * b)
            if backward:
                add_bytes(out, rank, peer, "reduce_scatter", 2 * shape.kv_elements * a)
        return out

    def rounds(self, params: RingParams, backward: bool) -> int:
        """Forward [P_kv > 1]·(row gather + row merge) + [P_q > 1]·column gather; backward
        [P_kv > 1]·(row gather + dQ reduce-scatter) + [P_q > 1]·(column gather + dK/dV reduce-scatter)."""
        attention2d_peers(params.ring, 0, params.grid)  # validates the grid
        p_q, p_kv = params.grid
        row, column = int(p_kv > 1), int(p_q > 1)
        return 2 * (row + column) if backward else 2 * row + column

    def report_rows(self, params: RingParams) -> list[tuple[str, str]]:
        rows, cols = params.grid
        return [("ATTENTION2D grid", f"{rows} rows x {cols} columns (ring rank = row x {cols} + col)")]
