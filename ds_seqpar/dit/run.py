"""``parallelize(pipe, config)``: a diffusers pipeline whose transformer runs over the world (docs/dit.md).

world = cfg_parallel x pipefusion.degree x size, rank = (branch · stages + stage) · size + sp_rank:
- the SP group (``size`` ranks, a ``SeqParMesh``): every call's token streams split, attention exact
  (Ulysses x ring, ``DitParallel``);
- the CFG team (``cfg_parallel`` = 2 ranks holding the same stage and SP piece): the batch's two guidance
  branches, one per member (``CfgParallel``);
- the stage team (``pipefusion.degree`` ranks): PipeFusion's patch pipeline over the blocks.

The pipeline itself is unchanged: its own denoising loop calls ``pipe.transformer`` and gets the whole output
on every rank, so every rank's scheduler step (and final latents) is the same. Checks run before any group
is created.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ds_seqpar.comm.team import TeamComm
from ds_seqpar.config import SECTION, SeqParConfigError, load_config
from ds_seqpar.integrations.deepspeed import init_distributed
from ds_seqpar.integrations.dit import (
    CfgParallel,
    DitParallel,
    check_dit_settings,
    dit_section,
    plan_of,
    sparse_settings,
)
from ds_seqpar.mesh import SeqParMesh

__all__ = ["DitRun", "parallelize"]


@dataclass
class DitRun:
    """What ``parallelize`` installed: the SP mesh, the CFG / stage teams, the parts (``remove()`` undoes)."""

    mesh: SeqParMesh
    cfg_team: TeamComm | None
    stage_team: TeamComm | None
    parts: list[Any] = field(default_factory=list)

    def remove(self) -> None:
        for part in reversed(self.parts):
            part.remove()
        self.parts = []


def _team(world: int, size: int, stages: int, cfg: int, axis: str) -> tuple[Any, list[int], int] | None:
    """Create every team of ``axis`` (collective, same order on every rank); this rank's (group, members, index)."""
    rank, mine = dist.get_rank(), None
    for branch in range(cfg if axis == "stage" else 1):
        for stage in range(stages if axis == "cfg" else 1):
            for sp_rank in range(size):
                if axis == "cfg":
                    members = [(b * stages + stage) * size + sp_rank for b in range(cfg)]
                else:
                    members = [(branch * stages + s) * size + sp_rank for s in range(stages)]
                group = dist.new_group(members)
                if rank in members:
                    mine = (group, members, members.index(rank))
    return mine


def parallelize(pipe: Any, config: str | os.PathLike[str] | dict[str, Any]) -> DitRun:
    """Install the config's parallelism on ``pipe.transformer`` (or on a transformer given directly)."""
    transformer = getattr(pipe, "transformer", pipe)
    plan = plan_of(transformer)  # refuses a model without a token plan, before any group
    world = int(os.environ.get("WORLD_SIZE", "1")) if not dist.is_initialized() else dist.get_world_size()
    section, _ = load_config(config, world_size=world)
    dit = section.dit
    if not section.enabled:
        raise SeqParConfigError(
            f"{SECTION}.enabled is false; run the pipeline without ds_seqpar.dit.parallelize"
        )
    if section.size * dit.replicas() != world:
        raise SeqParConfigError(
            f"{SECTION}: size {section.size} x dit.cfg_parallel {dit.cfg_parallel} x dit.pipefusion.degree "
            f"{dit.pipefusion.degree} = {section.size * dit.replicas()} ranks, but the world has {world}; "
            "valid: launch that many ranks, or change the degrees so that their product is the world"
        )
    if dit.pipefusion.degree > 1 and section.size > 1:
        raise SeqParConfigError(
            f"{SECTION}.dit.pipefusion.degree={dit.pipefusion.degree} with size={section.size}: PipeFusion x "
            "Ulysses/ring inside a stage is not built; valid: size=1 with PipeFusion, or pipefusion.degree=1"
        )
    if plan.joint_order is not None and dit.pipefusion.degree > 1:
        raise SeqParConfigError(
            f"{SECTION}.dit.pipefusion.degree={dit.pipefusion.degree}: {type(transformer).__name__} has joint "
            "text + image attention, which PipeFusion does not pipeline; valid: pipefusion.degree=1 (SP / CFG)"
        )
    section = dit_section(section)
    settings = section.validate(transformer.config, world)  # no group yet
    check_dit_settings(settings, type(transformer).__name__, training=False)
    sparse = sparse_settings(settings)
    if sparse is not None and (section.size == 1 or dit.pipefusion.degree > 1):
        raise SeqParConfigError(
            f"{SECTION}.dit.attention='block_sparse' with size={section.size} and pipefusion.degree="
            f"{dit.pipefusion.degree}: block-sparse attention runs over an SP group of size > 1 without PipeFusion; "
            "valid: size >= 2 and pipefusion.degree=1, or attention='dense'"
        )
    init_distributed(section.fault_timeout_s)
    mesh = SeqParMesh.from_config(section, transformer.config)
    stages, cfg = dit.pipefusion.degree, dit.cfg_parallel
    run = DitRun(mesh, None, None)
    if cfg > 1:
        run.cfg_team = TeamComm(*_team(world, section.size, stages, cfg, "cfg"), mesh.comm_stats)
        run.parts.append(CfgParallel(transformer, run.cfg_team, plan))
    if stages > 1:
        from ds_seqpar.integrations.dit.pipefusion import PipeFusion

        run.stage_team = TeamComm(*_team(world, section.size, stages, cfg, "stage"), mesh.comm_stats)
        pf = dit.pipefusion
        run.parts.append(PipeFusion(transformer, run.stage_team, pf.patches, pf.warmup_steps))
    elif section.size > 1:
        run.parts.append(DitParallel(transformer, mesh, sparse=sparse))
    return run
