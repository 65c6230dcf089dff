"""Process mesh for sequence parallelism: world = dp x sp, sp = ring_outer x ring_inner x ulysses.

Rank mapping (Ulysses innermost, so its bandwidth-heavy all-to-all stays inside a node)::

    rank = dp_rank * SP + ring_rank * U + ulysses_rank
    ring_rank = ring_outer_rank * R_inner + ring_inner_rank

Groups (member lists are global ranks):

=============== ================================================ ==============================
group           members                                          used for
=============== ================================================ ==============================
``sp``          the SP = U*R contiguous ranks sharing a sequence loss reduction, data sharding
``ulysses``     U contiguous ranks                               head <-> sequence all-to-all
``ring``        R ranks with stride U                            K/V ring
``ring_inner``  R_inner ring ranks with the same outer index     inner ring of the double ring
``ring_outer``  R_outer ring ranks with the same inner index     outer ring of the double ring
``dp``          dp ranks with stride SP                          sampler (all SP ranks of a group
                                                                 see the same samples)
``sp_dp``       all dp*SP ranks (= world)                        ZeRO sharding and grad reduction
=============== ================================================ ==============================

Every group ds_seqpar creates carries the mesh's ``fault_timeout_s`` (``sequence_parallel.fault_timeout_s``;
the ``timeout`` of ``torch.distributed.new_group``, which gloo and NCCL both honour), so no collective on
them waits longer for a failed, dead or stopped peer (docs/reliability.md "A failed, dead or hung rank is
named, within a bounded time"). ``sp_dp`` is the default group itself (``init_distributed`` gives it the
same timeout).

Nothing here is module-level state: a ``SeqParMesh`` is built once and passed explicitly.
``plan_mesh`` computes the member lists without torch.distributed, so it can be checked anywhere;
``plan_from_config`` does the same for a ``sequence_parallel`` section (``python -m ds_seqpar.report``).

A mesh holds its settings (``mesh.settings``: the frozen ``SeqParSettings``, every ``"auto"`` resolved);
they never change. ``mesh.with_section(section)`` gives a mesh with other settings on the same process
groups (same sizes), which is how one set of groups serves many configurations (tests, benchmarks).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ds_seqpar.comm.stats import CommStats
from ds_seqpar.config import SequenceParallelConfig, parse_section
from ds_seqpar.settings import (
    SeqParSettings,
    check_inner_divides,
    check_size_divides,
    check_ulysses_divides,
    resolve_settings,
)

GROUP_KINDS = ("sp", "ulysses", "ring", "ring_inner", "ring_outer", "dp", "sp_dp")


@dataclass(frozen=True)
class MeshCoords:
    """This rank's coordinates on every axis of the mesh."""

    rank: int
    dp_rank: int
    sp_rank: int
    ulysses_rank: int
    ring_rank: int
    ring_inner_rank: int
    ring_outer_rank: int


@dataclass(frozen=True)
class MeshPlan:
    """Sizes of every axis and the member lists of every group (pure arithmetic, no processes)."""

    world_size: int
    sp_size: int
    ulysses_size: int
    ring_inner_size: int

    def __post_init__(self) -> None:
        check_size_divides(self.sp_size, self.world_size)
        check_ulysses_divides(self.sp_size, self.ulysses_size)
        check_inner_divides(self.ring_inner_size, self.sp_size, self.ulysses_size)

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @property
    def ring_size(self) -> int:
        return self.sp_size // self.ulysses_size

    @property
    def ring_outer_size(self) -> int:
        return self.ring_size // self.ring_inner_size

    def coords(self, rank: int) -> MeshCoords:
        """Coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside the world of {self.world_size} ranks")
        dp_rank, sp_rank = divmod(rank, self.sp_size)
        ring_rank, ulysses_rank = divmod(sp_rank, self.ulysses_size)
        ring_outer_rank, ring_inner_rank = divmod(ring_rank, self.ring_inner_size)
        return MeshCoords(rank, dp_rank, sp_rank, ulysses_rank, ring_rank, ring_inner_rank, ring_outer_rank)

    def rank_of(self, dp_rank: int, ring_rank: int, ulysses_rank: int) -> int:
        """Global rank at the given coordinates."""
        return dp_rank * self.sp_size + ring_rank * self.ulysses_size + ulysses_rank

    def groups(self, kind: str) -> list[list[int]]:
        """All groups of one kind, each a sorted list of global ranks, in a fixed order."""
        u, ri, ro, r = self.ulysses_size, self.ring_inner_size, self.ring_outer_size, self.ring_size
        dps = range(self.dp_size)
        if kind == "sp":
            return [[self.rank_of(d, q, x) for q in range(r) for x in range(u)] for d in dps]
        if kind == "ulysses":
            return [[self.rank_of(d, q, x) for x in range(u)] for d in dps for q in range(r)]
        if kind == "ring":
            return [[self.rank_of(d, q, x) for q in range(r)] for d in dps for x in range(u)]
        if kind == "ring_inner":
            return [
                [self.rank_of(d, o * ri + i, x) for i in range(ri)]
                for d in dps
                for x in range(u)
                for o in range(ro)
            ]
        if kind == "ring_outer":
            return [
                [self.rank_of(d, o * ri + i, x) for o in range(ro)]
                for d in dps
                for x in range(u)
                for i in range(ri)
            ]
        if kind == "dp":
            return [list(range(s, self.world_size, self.sp_size)) for s in range(self.sp_size)]
        if kind == "sp_dp":
            return [list(range(self.world_size))]
        raise ValueError(f"unknown group kind {kind!r}; valid: {', '.join(GROUP_KINDS)}")


def plan_mesh(
    world_size: int, sp_size: int, ulysses_size: int = 1, ring_inner_size: int | None = None
) -> MeshPlan:
    """Plan a mesh from sizes; ``ring_inner_size=None`` means a single ring (inner = R)."""
    ring = sp_size // ulysses_size if ulysses_size >= 1 and sp_size % ulysses_size == 0 else 1
    return MeshPlan(world_size, sp_size, ulysses_size, ring_inner_size or ring)


def _mesh_sizes(settings: SeqParSettings) -> tuple[int, int, int | None]:
    """``(sp_size, ulysses_size, ring_inner_size)`` of resolved settings (1, 1, None when disabled)."""
    if not settings.enabled:
        return 1, 1, None
    return settings.size, settings.ulysses_degree, settings.ring.inner_size


def _sizes_section(
    sp_size: int, ulysses_size: int, ring_inner_size: int | None, fault_timeout_s: float | None = None
) -> SequenceParallelConfig:
    """The default section of a mesh of these sizes (what ``SeqParMesh.build`` follows)."""
    ring = {} if ring_inner_size is None else {"inner_size": ring_inner_size}
    timeout = {} if fault_timeout_s is None else {"fault_timeout_s": fault_timeout_s}
    return SequenceParallelConfig(size=sp_size, ulysses_degree=ulysses_size, ring=ring, **timeout)


def plan_from_config(
    config: SequenceParallelConfig, world_size: int, model_config: Any = None
) -> tuple[SeqParSettings, MeshPlan]:
    """The resolved settings and the plan of the mesh :meth:`SeqParMesh.from_config` builds on
    ``world_size`` ranks (U resolved against ``model_config``), without torch.distributed."""
    settings = config.validate(model_config, world_size)
    return settings, plan_mesh(world_size, *_mesh_sizes(settings))


@dataclass
class MeshGroups:
    """The process groups of a mesh: this rank's group of every kind, their members, and the ring subgroups
    made on demand (StarTrail teams, ATTENTION2D rows and columns), and the timeout every one of them was
    created with (``fault_timeout_s``). Shared by meshes of the same sizes."""

    process_groups: dict[str, Any]
    members: dict[str, list[int]]
    timeout_s: float
    subgroups: dict[str, tuple[Any, list[int], int]] = field(default_factory=dict)

    def new_group(self, ranks: list[int]) -> Any:
        """``dist.new_group(ranks)`` with this mesh's timeout (collective over the default group)."""
        return dist.new_group(ranks, timeout=datetime.timedelta(seconds=self.timeout_s))


@dataclass
class SeqParMesh:
    """The live mesh: this rank's coordinates, process groups, settings and a communication counter.

    Build it after ``torch.distributed`` is initialised, with :meth:`build` or :meth:`from_config`
    (every rank of the world must build the same mesh: group creation is collective), or from another
    mesh of the same sizes with :meth:`with_section` (no collective).

    ``settings`` are the frozen ``SeqParSettings`` the attention, layouts and scans follow. ``resources``
    holds per-mesh reusable objects (ring schedules with their receive buffers, sparse statistics).
    """

    plan: MeshPlan
    coords: MeshCoords
    groups: MeshGroups
    settings: SeqParSettings
    comm_stats: CommStats = field(default_factory=CommStats)
    resources: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        s, p = self.settings, self.plan
        if (s.size, s.ulysses_degree, s.ring_inner_size) != (p.sp_size, p.ulysses_size, p.ring_inner_size):
            raise ValueError(
                f"settings of size={s.size}, ulysses_degree={s.ulysses_degree}, ring.inner_size={s.ring.inner_size} "
                f"do not match this mesh (sp {p.sp_size}, ulysses {p.ulysses_size}, ring_inner {p.ring_inner_size}); "
                "build a mesh of those sizes (SeqParMesh.from_config)"
            )
        self.comm_stats.rank, self.comm_stats.node_of = self.coords.rank, self.node_of  # link classes

    @classmethod
    def build(
        cls,
        sp_size: int,
        ulysses_size: int = 1,
        ring_inner_size: int | None = None,
        *,
        world_size: int | None = None,
        rank: int | None = None,
        fault_timeout_s: float | None = None,
    ) -> SeqParMesh:
        """Create every process group (collective over the default group); the settings are the defaults
        of a section with these sizes (USP, zigzag, p2p ring with overlap, kernel auto).

        Every group gets ``fault_timeout_s`` as its timeout (None: the default group's own timeout, so a
        mesh never waits longer than the world's collectives do); ``settings.fault_timeout_s`` holds it."""
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised; call deepspeed.init_distributed() (or "
                "torch.distributed.init_process_group) before building a SeqParMesh"
            )
        world_size = dist.get_world_size() if world_size is None else world_size
        rank = dist.get_rank() if rank is None else rank
        plan = plan_mesh(world_size, sp_size, ulysses_size, ring_inner_size)
        inner = None if plan.ring_inner_size == plan.ring_size else plan.ring_inner_size
        timeout = group_timeout_s() if fault_timeout_s is None else fault_timeout_s
        section = _sizes_section(sp_size, ulysses_size, inner, timeout)
        settings = resolve_settings(section, None, world_size)
        return cls(plan, plan.coords(rank), _create_groups(plan, rank, settings.fault_timeout_s), settings)

    @classmethod
    def from_config(
        cls, config: SequenceParallelConfig | dict[str, Any], model_config: Any = None
    ) -> SeqParMesh:
        """Build the mesh a ``sequence_parallel`` section describes (a validated section or its dict; U
        resolved against ``model_config``); every check runs before the first group is created."""
        section = parse_section(config) if isinstance(config, dict) else config
        world = dist.get_world_size() if dist.is_initialized() else None
        settings = section.validate(model_config, world)
        mesh = cls.build(*_mesh_sizes(settings), fault_timeout_s=settings.fault_timeout_s)
        return mesh.with_settings(settings) if settings.enabled else mesh

    def with_section(
        self, section: SequenceParallelConfig | dict[str, Any], model_config: Any = None
    ) -> SeqParMesh:
        """A mesh on these process groups that follows ``section`` (its sizes must be this mesh's); no
        collective, a fresh ``comm_stats`` and fresh per-mesh resources."""
        section = parse_section(section, self.plan.world_size) if isinstance(section, dict) else section
        return self.with_settings(section.validate(model_config, self.plan.world_size))

    def with_settings(self, settings: SeqParSettings) -> SeqParMesh:
        """A mesh on these process groups that follows resolved ``settings`` (of this mesh's sizes)."""
        return SeqParMesh(self.plan, self.coords, self.groups, settings)

    def schedule(self) -> Any:
        """The ring schedule of the settings, built once per mesh (it owns its receive buffers)."""
        spec, params = self.settings.schedule, self.settings.ring_params()
        key = ("ring_schedule", *spec.cache_key(params))
        if key not in self.resources:
            self.resources[key] = spec.build(self, params)
        return self.resources[key]

    @property
    def process_groups(self) -> dict[str, Any]:
        return self.groups.process_groups

    @property
    def members(self) -> dict[str, list[int]]:
        return self.groups.members

    # sizes ---------------------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        return self.plan.dp_size

    @property
    def sp_size(self) -> int:
        return self.plan.sp_size

    @property
    def ulysses_size(self) -> int:
        return self.plan.ulysses_size

    @property
    def ring_size(self) -> int:
        return self.plan.ring_size

    @property
    def ring_inner_size(self) -> int:
        return self.plan.ring_inner_size

    @property
    def ring_outer_size(self) -> int:
        return self.plan.ring_outer_size

    def group(self, kind: str) -> Any:
        """The process group of ``kind`` (one of ``GROUP_KINDS``) that contains this rank."""
        if kind not in self.process_groups:
            raise ValueError(f"unknown group kind {kind!r}; valid: {', '.join(GROUP_KINDS)}")
        return self.process_groups[kind]

    def ring_subgroup(self, name: str, parts: list[list[int]]) -> tuple[Any, list[int], int]:
        """The process group of the part of ``parts`` (lists of ring ranks partitioning the ring) that holds
        this rank: ``(group, global member ranks in part order, this rank's index)``. Collective the first
        time a name is asked for: every rank creates the groups of every ring (all dp and Ulysses indices)
        in the same order, with the mesh's groups' timeout; cached with the mesh's groups (StarTrail teams,
        ATTENTION2D rows and columns)."""
        cache = self.groups.subgroups
        if name not in cache:
            p, mine = self.plan, None
            for d in range(p.dp_size):
                for x in range(p.ulysses_size):
                    for part in parts:
                        ranks = [p.rank_of(d, q, x) for q in part]
                        group = self.groups.new_group(ranks) if len(ranks) > 1 else None
                        if self.coords.rank in ranks:
                            mine = (group, ranks, ranks.index(self.coords.rank))
            if mine is None:
                raise ValueError(f"ring subgroup {name!r}: no part holds ring rank {self.coords.ring_rank}")
            cache[name] = mine
        return cache[name]

    @property
    def ranks_per_node(self) -> int:
        """Ranks per node (``sequence_parallel.ranks_per_node``, resolved in the settings)."""
        return self.settings.ranks_per_node

    def node_of(self, rank: int) -> int:
        """Node index of a global rank (ranks are numbered node by node, as the launchers do)."""
        return rank // self.ranks_per_node

    def mpu(self) -> DeepSpeedMPU:
        """The adapter DeepSpeed takes as ``deepspeed.initialize(..., mpu=...)``."""
        return DeepSpeedMPU(self)

    def describe(self) -> str:
        """One line for logs, e.g. ``rank 5: dp 0/1, sp 5/8 (ulysses 1/2, ring 2/4 = outer 1/2 x inner 0/2)``."""
        c, p = self.coords, self.plan
        return (
            f"rank {c.rank}: dp {c.dp_rank}/{p.dp_size}, sp {c.sp_rank}/{p.sp_size} "
            f"(ulysses {c.ulysses_rank}/{p.ulysses_size}, ring {c.ring_rank}/{p.ring_size} = "
            f"outer {c.ring_outer_rank}/{p.ring_outer_size} x inner {c.ring_inner_rank}/{p.ring_inner_size})"
        )


def _create_groups(plan: MeshPlan, rank: int, timeout_s: float) -> MeshGroups:
    """Every process group of ``plan``, each with timeout ``timeout_s`` (collective over the world: every
    rank creates every group in order); ``sp_dp`` is the default group."""
    groups = MeshGroups({}, {}, timeout_s)
    for kind in GROUP_KINDS:
        for ranks in plan.groups(kind):
            group = dist.group.WORLD if kind == "sp_dp" else groups.new_group(ranks)
            if rank in ranks:
                groups.process_groups[kind] = group
                groups.members[kind] = ranks
    return groups


def group_timeout_s(group: Any = None) -> float | None:
    """The timeout, in seconds, a process group's backend waits for a peer (default: the default group);
    None when torch does not expose it."""
    group = dist.distributed_c10d._get_default_group() if group is None else group
    for device in getattr(group, "_device_types", ()):
        try:
            return group._get_backend(device).options._timeout.total_seconds()
        except (AttributeError, RuntimeError):
            continue
    return None


class DeepSpeedMPU:
    """The ``mpu`` object DeepSpeed 0.19.8 queries when SP is combined with ZeRO.

    It has exactly the interface of DeepSpeed's own SP state module
    (``runtime/sequence_parallel/parallel_state_sp.py``), which DeepSpeed recognises by its
    ``initialize_sequence_parallel`` method: ZeRO-1/2/3 partition and reduce gradients over the
    sequence-data-parallel group (dp x sp, here the whole world) and "model parallel" is an alias
    of the SP group.

    It deliberately has NO ``get_data_parallel_*`` methods: DeepSpeed's ZeRO-3 partitions the
    parameters over ``mpu.get_data_parallel_group()`` when that method exists, which would leave
    the SP ranks out of the gradient reduction (each SP rank would update with its own partial
    gradient). ds_seqpar's data loader takes the dp rank from the mesh instead (``mesh.coords``).
    """

    def __init__(self, mesh: SeqParMesh) -> None:
        self.mesh = mesh

    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:
        """Groups already exist in the mesh; only check that the sizes agree."""
        if sequence_parallel_size != self.mesh.sp_size:
            raise ValueError(
                f"sequence_parallel_size={sequence_parallel_size} disagrees with the mesh's sp size "
                f"{self.mesh.sp_size}; build the mesh and the DeepSpeed config from the same section"
            )

    # sequence parallel
    def get_sequence_parallel_group(self) -> Any:
        return self.mesh.group("sp")

    def get_sequence_parallel_world_size(self) -> int:
        return self.mesh.sp_size

    def get_sequence_parallel_rank(self) -> int:
        return self.mesh.coords.sp_rank

    # sequence x data parallel (ZeRO partitioning and gradient reduction)
    def get_sequence_data_parallel_group(self) -> Any:
        return self.mesh.group("sp_dp")

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.mesh.plan.world_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.mesh.coords.rank

    # model parallel = sequence parallel (as in DeepSpeed's SP state module)
    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank
