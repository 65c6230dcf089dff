"""Meshes for tests, built from ``sequence_parallel`` sections.

Creating process groups is collective and costs time on gloo, so each rank process keeps one mesh per
(size, U, R_inner) and every section of those sizes gets a mesh on its groups (``with_section``):
``mesh_for({"size": 4, "ulysses_degree": 2, "ring": {"layout": "stripe"}})``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ds_seqpar import SeqParMesh
from ds_seqpar.config import SequenceParallelConfig, parse_section

_BASES: dict[tuple[int, int, int | None], SeqParMesh] = {}  # per rank process


def mesh_for(section: dict[str, Any] | SequenceParallelConfig, model_config: Any = None) -> SeqParMesh:
    """A mesh that follows ``section`` (U resolved against ``model_config``), on this process's groups of
    its sizes (created on first use, collectively)."""
    world = dist.get_world_size()
    parsed = parse_section(section, world) if isinstance(section, dict) else section
    settings = parsed.validate(model_config, world)
    key = (settings.size, settings.ulysses_degree, settings.ring.inner_size)
    if key not in _BASES:
        _BASES[key] = SeqParMesh.build(*key)
    return _BASES[key].with_settings(settings)
