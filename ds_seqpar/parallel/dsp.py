"""DSP (dynamic sequence parallelism) for multi-dimensional sequences: switch the sharded axis, attend locally.

Legend: P = SP degree; a spatio-temporal activation ``[B, T, S, C]`` (T frames of S spatial tokens,
C channels), docs/dsp.md: spatial attention (over S, within a frame) needs whole frames, temporal
attention (over T, per spatial position) whole time lines. DSP shards T during spatial blocks and S
during temporal ones; :func:`switch_sharded_axis` moves between the two with one all-to-all over the SP
group, and the attention itself then runs with no communication at all.

Bytes per switch and rank: (P − 1)/P of its shard, B·T·S·C·b / P² to each other rank
(:func:`switch_bytes`); two switches per (spatial, temporal) block pair, forward and backward alike,
against Ulysses-inside-attention's four all-to-alls (q, k, v, out) per attention. docs/dsp.md.
"""

from __future__ import annotations

import torch

from ds_seqpar.comm.axis_switch import switch_axis
from ds_seqpar.mesh import SeqParMesh


def switch_sharded_axis(x: torch.Tensor, *, mesh: SeqParMesh, sharded: int, to: int) -> torch.Tensor:
    """This rank's shard of the same global activation, split over the SP group along ``to`` instead of
    ``sharded`` (rank r holds the r-th of P equal parts); differentiable, its backward the switch back.

    Args:
        x: e.g. ``[B, T/P, S, C]`` with ``sharded=1``; axis ``to`` (e.g. 2) whole, a multiple of P (else a
            ``ValueError`` naming the padded size, before any collective).
    """
    group, members = mesh.group("sp"), mesh.members["sp"]
    return switch_axis(x, sharded, to, group, members, mesh.coords.sp_rank, mesh.comm_stats)


def switch_bytes(numel: int, element_bytes: int, world: int) -> int:
    """Bytes one rank sends in one switch of a shard of ``numel`` elements: (P − 1)/P of it."""
    return (world - 1) * (numel // world) * element_bytes
