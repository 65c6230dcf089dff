"""The resolved, immutable settings of sequence parallelism: every ``"auto"`` resolved once, here.

``resolve_settings(section, model_config, world_size)`` turns a validated ``sequence_parallel`` section
(``config/section.py``) into a frozen ``SeqParSettings``: the object a ``SeqParMesh`` holds and every module
reads. Resolved here and nowhere else:

    ulysses_degree   "auto" -> the largest divisor of size the K/V heads allow (:func:`auto_ulysses_degree`)
    ulysses_chunks   "auto" -> 4 head groups (fewer when the heads per rank do not split evenly)
    mlp_tile_tokens  "auto" -> max(1024, hidden_size) of the model config (1024 without one)
    ranks_per_node   "auto" -> the launcher's LOCAL_WORLD_SIZE (all ranks when unset)
    ring.layout      the layout the ring runs on (sparse balancing: stripes of sparse.block_size)
    plan             "auto" -> ulysses_degree and the ring's schedule chosen by the planner (its registered
                     resolver, ``register_plan_resolver``; docs/plan.md)

Three choices are per call, not per run, and are resolved by their registries where the call's facts
are known: ``kernel`` and ``sparse.kernel`` (``"auto"``: the device and dtype of the tensors) and
``ring.startrail_backward`` (``"auto"``: the heads per rank of the layer, ``comm/schedules/startrail.py``).

The checks that need the model or the world run here too (heads vs U, world vs size); each degree rule
is a function of this module, used by the section's parse-time checks and by ``MeshPlan`` alike.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ds_seqpar.comm.schedules import SCHEDULES, RingParams, ScheduleSpec
from ds_seqpar.errors import SeqParConfigError
from ds_seqpar.layout import LAYOUTS, StripeLayout, UspLayout, ring_layout

__all__ = [
    "DEFAULT_ULYSSES_CHUNKS",
    "MemorySettings",
    "RingSettings",
    "SeqParSettings",
    "auto_ulysses_degree",
    "check_inner_divides",
    "check_size_divides",
    "check_ulysses_divides",
    "divisors",
    "head_counts",
    "input_layout",
    "model_value",
    "register_plan_resolver",
    "resolve_settings",
    "text_config",
]

DEFAULT_ULYSSES_CHUNKS = 4  # ulysses_chunks: "auto"
MIN_TILE_TOKENS = 1024  # mlp_tile_tokens: "auto" = max(this, hidden_size)


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(values: list[Any]) -> str:
    return ", ".join(str(v) for v in values)


# ---------------------------------------------------------------------------------------------- rules


def check_ulysses_divides(size: int, ulysses: int) -> None:
    """U must divide P."""
    if ulysses < 1 or size % ulysses != 0:
        raise SeqParConfigError(
            f"sequence_parallel.ulysses_degree={ulysses} does not divide size={size}; valid: {_choices(divisors(size))}"
        )


def check_inner_divides(inner: int | None, size: int, ulysses: int) -> None:
    """R_inner must divide R = P / U (None: a single ring)."""
    ring = size // ulysses
    if inner is not None and (inner < 1 or ring % inner != 0):
        raise SeqParConfigError(
            f"sequence_parallel.ring.inner_size={inner} does not divide the ring degree R={ring} "
            f"(size={size} / ulysses_degree={ulysses}); valid: null, {_choices(divisors(ring))}"
        )


def check_size_divides(size: int, world: int) -> None:
    """P must divide the world size (world = data parallel x P)."""
    if world < 1 or world % size != 0:
        valid = divisors(world) if world >= 1 else [1]
        raise SeqParConfigError(
            f"sequence_parallel.size={size} does not divide the world size {world} "
            f"(world = data_parallel x size); valid: {_choices(valid)}"
        )


def check_ring(section: Any, ulysses: int) -> None:
    """The ring axis of ``section`` at Ulysses degree ``ulysses``: R_inner divides R, and the schedule's own
    rules on R (TASP domains, StarTrail teams, ATTENTION2D grids)."""
    check_inner_divides(section.ring.inner_size, section.size, ulysses)
    SCHEDULES[section.ring.schedule].check_degree(section.ring, section.size // ulysses)


# ---------------------------------------------------------------------------------------------- model facts


def text_config(model_config: Any) -> Any:
    """The language-model config of a (possibly composite) HF config: ``get_text_config()`` when it has one."""
    get = getattr(model_config, "get_text_config", None)
    return get() if callable(get) else model_config


def model_value(model_config: Any, name: str, default: Any = None) -> Any:
    """``name`` of the (text) config of a HF config or a dict (``default`` when missing or None)."""
    text = text_config(model_config)
    value = text.get(name, default) if isinstance(text, Mapping) else getattr(text, name, default)
    return default if value is None else value


def head_counts(model_config: Any) -> tuple[int, int]:
    """``(num_attention_heads, num_key_value_heads)`` of a model config (dict or object); a composite
    config without head counts of its own (a language model under ``text_config``) is read there."""

    def get(name: str) -> Any:
        if isinstance(model_config, Mapping):
            return model_config.get(name)
        return getattr(model_config, name, None)

    nested = get("text_config")
    if get("num_attention_heads") is None and nested is not None:
        return head_counts(nested)
    heads = get("num_attention_heads")
    if not isinstance(heads, int) or heads < 1:
        raise SeqParConfigError(
            f"model config has num_attention_heads={heads!r}; sequence parallelism needs a positive integer "
            "head count (pass the model's config, e.g. model.config)"
        )
    kv = get("num_key_value_heads") or heads
    if heads % kv != 0:
        raise SeqParConfigError(
            f"model config has num_key_value_heads={kv}, which does not divide num_attention_heads={heads}; "
            f"valid: {_choices(divisors(heads))}"
        )
    return heads, kv


def auto_ulysses_degree(size: int, num_heads: int, num_kv_heads: int) -> int:
    """The rule behind ``ulysses_degree="auto"``.

    The largest divisor U of ``size`` with U <= H and H_kv % U == 0, i.e. as much Ulysses (fast,
    intra-node all-to-all) as the K/V heads allow without replicating them; the rest of ``size`` goes
    to the ring. U = 1 (pure ring) always qualifies, so no replication is ever chosen automatically;
    set an integer ``ulysses_degree`` to ask for replication explicitly. Examples: size=8, H_kv=8 -> 8;
    size=8, H_kv=2 -> 2 (R=4); size=6, H_kv=4 -> 2 (R=3).
    """
    best = 1
    for u in divisors(size):
        if u <= num_heads and num_kv_heads % u == 0:
            best = u
    return best


# ---------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class RingSettings:
    """``sequence_parallel.ring``, resolved: ``layout`` / ``granularity`` are what the ring runs on."""

    layout: str
    granularity: int
    inner_size: int | None  # R_inner of a double ring; None = a single ring
    overlap: bool
    schedule: str
    team_size: int | None
    grid: tuple[int, int] | None
    startrail_backward: str


@dataclass(frozen=True)
class MemorySettings:
    """``sequence_parallel.memory``, resolved (``mlp_tile_tokens`` an integer)."""

    activation_checkpointing: bool
    offload: bool
    tiled_mlp: bool
    tiled_norms: bool
    mlp_tile_tokens: int


@dataclass(frozen=True)
class SeqParSettings:
    """Everything sequence parallelism follows, resolved and immutable (held by ``SeqParMesh.settings``).

    ``sparse`` and ``linear`` are the section's own (immutable) models: nothing in them is resolved.
    """

    enabled: bool
    size: int
    data_parallel_size: int | None
    ulysses_degree: int
    ulysses_chunks: int
    attention: str
    ring: RingSettings
    sparse: Any
    linear: Any
    memory: MemorySettings
    kernel: str
    ranks_per_node: int
    fault_timeout_s: float
    dynamic_degree: bool = False
    inference: Any = None  # the section's InferenceConfig (immutable; docs/inference.md)
    dit: Any = None  # the section's DitConfig (immutable; docs/dit.md)

    @property
    def ring_degree(self) -> int:
        """R = size / U."""
        return self.size // self.ulysses_degree

    @property
    def ring_inner_size(self) -> int:
        """Ranks per inner ring (R when the ring is a single ring)."""
        return self.ring.inner_size or self.ring_degree

    @property
    def schedule(self) -> ScheduleSpec:
        """The spec of ``ring.schedule``."""
        return SCHEDULES[self.ring.schedule]

    def ring_params(self) -> RingParams:
        """What the ring schedule reads of these settings."""
        ring = self.ring
        segments = LAYOUTS[ring.layout].segment_count
        return RingParams(
            self.ring_degree, ring.inner_size, ring.overlap, ring.team_size, ring.grid, segments,
            ring.startrail_backward,
        )  # fmt: skip

    def input_layout(self) -> UspLayout:
        """The layout the data side must shard with: the ring layout over the R ring ranks (as the schedule
        runs on it), then each ring shard split into U Ulysses pieces."""
        params, spec = self.ring_params(), self.schedule
        base = ring_layout(self.ring.layout, self.ring_degree, self.ring.granularity)
        return UspLayout(
            spec.ring_layout(base, params), self.ulysses_degree, spec.pieces(params), self.dynamic_degree
        )


def input_layout(mesh_or_settings: Any, doc_ids: Any = None) -> UspLayout:
    """The layout the data side must shard with, for a ``SeqParMesh`` or its ``SeqParSettings``; with the
    batch's ``doc_ids`` (global order), that batch's layout (a document placement under
    ``ring.layout='documents'``, else the same)."""
    settings = mesh_or_settings if isinstance(mesh_or_settings, SeqParSettings) else mesh_or_settings.settings
    return settings.input_layout().for_batch(doc_ids)


def resolve_settings(
    section: Any,
    model_config: Any = None,
    world_size: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> SeqParSettings:
    """Check what needs the model or the world and resolve every ``"auto"`` of a validated section.

    Args:
        section: a ``SequenceParallelConfig`` (``parse_section`` / ``load_config``: ``size`` resolved).
        model_config: anything with ``num_attention_heads`` (and optionally ``num_key_value_heads``,
            ``hidden_size``), e.g. a HF ``PretrainedConfig``, or None to skip the head checks.
        world_size: total number of ranks, or None (then dp x size) to skip the world checks.
        environ: where ``LOCAL_WORLD_SIZE`` is read (default ``os.environ``).
    """
    if section.size == "auto":
        raise SeqParConfigError(
            'sequence_parallel.size="auto" is resolved by parse_section / load_config (from the world size); '
            "resolve_settings needs the resolved section"
        )
    if world_size is not None:
        _check_world(section, world_size)
    if getattr(section, "plan", "manual") == "auto":
        section = _planned(section, model_config, world_size, environ)
    ulysses = _resolve_ulysses(section, model_config)
    check_ring(section, ulysses)
    world = world_size if world_size is not None else section.size * (section.data_parallel_size or 1)
    return SeqParSettings(
        enabled=section.enabled,
        size=section.size,
        data_parallel_size=section.data_parallel_size,
        ulysses_degree=ulysses,
        ulysses_chunks=DEFAULT_ULYSSES_CHUNKS if section.ulysses_chunks == "auto" else section.ulysses_chunks,
        attention=section.attention,
        ring=_ring_settings(section),
        sparse=section.sparse,
        linear=section.linear,
        memory=_memory_settings(section.memory, model_config),
        kernel=section.kernel,
        ranks_per_node=_ranks_per_node(
            section.ranks_per_node, world, os.environ if environ is None else environ
        ),
        fault_timeout_s=section.fault_timeout_s,
        dynamic_degree=section.dynamic_degree,
        inference=section.inference,
        dit=section.dit,
    )


# plan="auto": the planner (a higher layer, ds_seqpar/plan/auto.py) registers its resolver here, so this
# module never imports it; it returns the section with ulysses_degree and the ring filled in (docs/plan.md)
_PLAN_RESOLVERS: list[Callable[..., Any]] = []


def register_plan_resolver(resolver: Callable[..., Any]) -> None:
    """Install the resolver of ``plan: "auto"``: ``resolver(section, model_config, world_size, environ)``
    returns the section with the plan's choices filled in (``ds_seqpar.plan`` registers it on import)."""
    _PLAN_RESOLVERS[:] = [resolver]


def _planned(
    section: Any, model_config: Any, world_size: int | None, environ: Mapping[str, str] | None
) -> Any:
    if not _PLAN_RESOLVERS:
        raise SeqParConfigError(
            'sequence_parallel.plan="auto" needs the planner, which registers itself when ds_seqpar.plan is imported; '
            'import ds_seqpar (or ds_seqpar.plan) first, or set plan="manual"'
        )
    return _PLAN_RESOLVERS[0](section, model_config, world_size, environ)


def _check_world(section: Any, world: int) -> None:
    dp = section.data_parallel_size
    if dp is not None and dp * section.size != world:
        raise SeqParConfigError(
            f"sequence_parallel.data_parallel_size={dp} x size={section.size} = {dp * section.size} ranks, but "
            f"the world has {world}; valid: data_parallel_size={world // section.size} for size={section.size}"
            if world % section.size == 0
            else f"sequence_parallel.data_parallel_size={dp} x size={section.size} = {dp * section.size} ranks, "
            f'but the world has {world}; valid: size="auto" or a size that divides {world}'
        )
    check_size_divides(section.size, world)


def _attention_free_ulysses(wanted: Any, attention: str, size: int) -> int:
    """U of a model without attention heads (Mamba, Mamba2): as set; its recurrent layers check U against
    their own heads / channels at their first call, before any collective (docs/delta.md)."""
    if wanted != "auto":
        return wanted
    if attention == "ring":
        return 1
    if attention == "ulysses":
        return size
    raise SeqParConfigError(
        'model config has num_attention_heads=None, and ulysses_degree="auto" needs head counts (pass the '
        "model's config, e.g. model.config); an attention-free model such as Mamba has none: set an integer "
        "sequence_parallel.ulysses_degree (its recurrent layers split their heads / channels U ways)"
    )


def _resolve_ulysses(section: Any, model_config: Any) -> int:
    """U: the section's, or ``"auto"`` by the attention algorithm and the model's head counts; checked
    against the query heads when the model is known."""
    wanted, attention = section.ulysses_degree, section.attention
    needs_heads = attention in ("usp", "sparse_ring")
    if model_config is not None and model_value(model_config, "num_attention_heads") is None:
        return _attention_free_ulysses(wanted, attention, section.size)
    if wanted == "auto" and model_config is None and needs_heads:
        raise SeqParConfigError(
            'sequence_parallel.ulysses_degree="auto" needs the model\'s head counts; '
            "pass model_config to resolve_settings / SeqParMesh.from_config or set an integer ulysses_degree"
        )
    if wanted != "auto":
        ulysses = wanted
    elif attention == "ring":
        ulysses = 1
    elif attention == "ulysses":
        ulysses = section.size
    else:
        ulysses = auto_ulysses_degree(section.size, *head_counts(model_config))
    if model_config is not None:
        heads, _ = head_counts(model_config)
        if ulysses > heads:
            valid = [d for d in divisors(section.size) if d <= heads]
            raise SeqParConfigError(
                f"sequence_parallel.ulysses_degree={ulysses} exceeds the model's num_attention_heads={heads}; "
                f"valid: {_choices(valid)}"
            )
    return ulysses


def _ring_settings(section: Any) -> RingSettings:
    ring, sparse = section.ring, section.sparse
    layout, granularity = ring.layout, ring.granularity
    if section.attention == "sparse_ring" and sparse.balancing != "none":  # stripes of the block size
        layout, granularity = StripeLayout.name, sparse.block_size
    return RingSettings(
        layout=layout,
        granularity=granularity,
        inner_size=ring.inner_size,
        overlap=ring.overlap,
        schedule=ring.schedule,
        team_size=ring.team_size,
        grid=tuple(ring.grid) if ring.grid else None,
        startrail_backward=ring.startrail_backward,
    )


def _memory_settings(memory: Any, model_config: Any) -> MemorySettings:
    tokens = memory.mlp_tile_tokens
    if tokens == "auto":
        hidden = model_value(model_config, "hidden_size", 0) if model_config is not None else 0
        tokens = max(MIN_TILE_TOKENS, int(hidden))
    return MemorySettings(
        activation_checkpointing=memory.activation_checkpointing,
        offload=memory.offload,
        tiled_mlp=memory.tiled_mlp,
        tiled_norms=memory.tiled_norms,
        mlp_tile_tokens=tokens,
    )


def _ranks_per_node(wanted: int | str, world: int, environ: Mapping[str, str]) -> int:
    if wanted == "auto":
        wanted = int(environ.get("LOCAL_WORLD_SIZE", world))
    return max(1, min(int(wanted), world))
