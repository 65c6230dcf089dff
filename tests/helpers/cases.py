"""The one case type of the distributed attention sweeps (ring engine, USP, schedules, properties).

Every field and its default is written here once; a sweep builds its cases with keywords and varies them
with ``dataclasses.replace``. A case is picklable (it travels to the gloo ranks) and prints whole in a
failure message.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_seqpar.layout import LAYOUTS, doc_ids_from_cu_seqlens
from ds_seqpar.ops.masks import MaskSpec
from ds_seqpar.ops.sparse import VerticalSlashBudget
from tests.helpers.references import H

SPARSE_BUDGET = {"vertical": 0.05, "slash": 0.05, "block_size": 4, "last_q": 16, "sink_tokens": 2}
SPARSE_BUDGET["local_diagonals"] = 4
"""The ``sequence_parallel.sparse`` budget of the cases with ``sparse`` set (small blocks, a few lines)."""


def _doc_ids(cu_seqlens: tuple[int, ...] | None, seq_len: int) -> torch.Tensor | None:
    return None if cu_seqlens is None else doc_ids_from_cu_seqlens(list(cu_seqlens), seq_len)


@dataclass(frozen=True)
class AttentionCase:
    """One attention case: the inputs, the mask and the ``sequence_parallel`` section of its mesh.

    Inputs: ``seq_len`` tokens, ``h`` query and ``h_kv`` K/V heads, ``dtype``, ``seed`` (and ``batch`` rows
    where a runner draws its own inputs). Mask: ``causal``, ``window``, packed documents ``cu_seqlens``
    (``[0, ..., end]``; tokens past ``end`` are padding; the first ``left_pad`` tokens are padding too),
    attention ``chunk`` (Llama 4's chunked attention). Mesh: ``u`` = ulysses_degree, ``inner`` =
    ring.inner_size, ``schedule`` and its keys, ``chunks`` = ulysses_chunks. Engine knobs of the ring
    sweep: ``kernel``, ``tile_min`` (backward tile rows), ``delta`` (the backward on rowsum(dout · out)).
    """

    layout: str = "zigzag"
    causal: bool = True
    seq_len: int = 16
    h: int = H
    h_kv: int = H
    dtype: torch.dtype = torch.float64
    seed: int = 0
    batch: int = 2
    window: int | None = None
    cu_seqlens: tuple[int, ...] | None = None
    granularity: int = 1
    u: int = 1
    inner: int | None = None
    schedule: str = "p2p"
    overlap: bool = True
    team_size: int | None = None
    grid: tuple[int, int] | None = None
    startrail_backward: str = "auto"
    ranks_per_node: int | str = "auto"
    chunks: int | str = "auto"
    kernel: str = "auto"
    tile_min: int = 1024
    delta: bool = False
    attention: str = "usp"
    softcap: float | None = None
    sinks: bool = False
    alibi: bool = False
    sparse: str | None = None
    dynamic: bool = False
    chunk: int | None = None
    left_pad: int = 0

    def section(self, world: int) -> dict:
        """The ``sequence_parallel`` section of this case's mesh over ``world`` ranks."""
        ring = {"inner_size": self.inner, "schedule": self.schedule, "overlap": self.overlap}
        if self.sparse is None:  # the sparse ring's layout follows its balancing
            ring |= {"layout": self.layout, "granularity": self.granularity}
        if self.team_size is not None:
            ring |= {"team_size": self.team_size, "startrail_backward": self.startrail_backward}
        if self.grid is not None:
            ring["grid"] = list(self.grid)
        section = {
            "size": world,
            "ulysses_degree": self.u,
            "ulysses_chunks": self.chunks,
            "ranks_per_node": self.ranks_per_node,
            "kernel": self.kernel,
            "attention": self.attention,
            "ring": ring,
        }
        if self.sparse is not None:
            section["sparse"] = {**SPARSE_BUDGET, "balancing": self.sparse}
        if self.dynamic:
            section["dynamic_degree"] = True
        return section

    @property
    def spec(self) -> MaskSpec:
        return MaskSpec(causal=self.causal, window=self.window)

    def doc_ids(self) -> torch.Tensor | None:
        """Document id per token ``[S]`` (padding -1), or None without packed documents."""
        ids = _doc_ids(self.cu_seqlens, self.seq_len)
        if ids is not None and self.left_pad:
            ids[: self.left_pad] = -1
        return ids

    @property
    def segments(self) -> int:
        """Segments per rank of the ring layout (zigzag 2, else 1), as the byte model counts them."""
        return LAYOUTS[self.layout].segment_count


@dataclass(frozen=True)
class SparseCase:
    """One case of the sparse ring sweeps: the engine with a given pattern (``layout``: a ring layout, or
    ``"blocks"`` for a random db-SP block assignment) and ``ds_seqpar.attention`` with
    ``attention: "sparse_ring"`` (``u``, ``balancing``; ``force_blocks`` accepts every block move, so the
    relayout path runs). Pattern budget: ``block`` rows per tile and the lines of ``SPARSE_BUDGET``."""

    seq_len: int
    layout: str = "stripe"
    granularity: int = 1
    block: int = 8
    dtype: torch.dtype = torch.float64
    h: int = 4
    h_kv: int = 2
    seed: int = 0
    window: int | None = None
    cu_seqlens: tuple[int, ...] | None = None
    kernel: str = "auto"
    inner: int | None = None
    u: int = 1
    balancing: str = "none"
    force_blocks: bool = False

    def section(self, world: int) -> dict:
        """The ``sequence_parallel`` section of the ``ds_seqpar.attention`` path."""
        sparse = {
            **SPARSE_BUDGET,
            "block_size": self.block,
            "balancing": self.balancing,
            "kernel": self.kernel,
        }
        ring = {"inner_size": self.inner}
        if self.balancing == "none":  # a balancing chooses the layout itself
            ring["layout"] = self.layout
        return {
            "size": world,
            "ulysses_degree": self.u,
            "attention": "sparse_ring",
            "ring": ring,
            "sparse": sparse,
        }

    def budget(self) -> VerticalSlashBudget:
        """The pattern budget of this case (what ``section``'s ``sparse`` resolves to)."""
        return VerticalSlashBudget(**{**SPARSE_BUDGET, "block_size": self.block})

    def doc_ids(self) -> torch.Tensor | None:
        return _doc_ids(self.cu_seqlens, self.seq_len)


@dataclass(frozen=True)
class ScanCase:
    """One case of the recurrent-scan sweeps (linear attention, the delta rule, the conv1d halo): the mesh
    (``u``, the ring ``layout``, ``sequence_parallel.linear``: ``mode`` = scan, ``blocks``, ``chunk`` =
    chunk_size), the decay kind the inputs carry (``decay``: the sweep's names) and, for the halo, the
    conv ``kernel`` width and whether the model's own ``nn.Conv1d`` is passed (``module``)."""

    seq_len: int = 16
    u: int = 1
    layout: str = "zigzag"
    granularity: int = 1
    mode: str = "all_scan"
    blocks: int = 1
    chunk: int = 4
    decay: str = "none"
    seed: int = 0
    kernel: int = 4
    module: bool = False

    def section(self, world: int) -> dict:
        return {
            "size": world,
            "ulysses_degree": self.u,
            "ring": {"layout": self.layout, "granularity": self.granularity},
            "linear": {"scan": self.mode, "blocks": self.blocks, "chunk_size": self.chunk},
        }

    @property
    def segments(self) -> int:
        """Pieces per rank of the ring layout (what the all-gather scan moves per rank)."""
        return LAYOUTS[self.layout].segment_count


@dataclass(frozen=True)
class CrossCase:
    """One cross-attention case: ``s_q`` queries over ``s_kv`` keys with ``h_kv`` K/V heads, the rotation
    ``schedule`` (``rotate_q`` | ``rotate_kv``), and a key-padding mask when ``padding``."""

    schedule: str
    s_q: int
    s_kv: int
    h_kv: int
    padding: bool = False
