"""The ``"sequence_parallel"`` section as typed, validated, immutable pydantic models (the checks that the
section alone can make: types, choices, divisibility, keys that only one schedule reads, unknown keys).

Names of layouts, schedules and kernels are the registries' (``layout.LAYOUTS``, ``comm.schedules.SCHEDULES``,
the kernel registries of ``ops/``): a registered extension is configurable by name, and the error of a bad
name lists the registered ones. What needs the model or the world, and every ``"auto"``, is resolved by
``section.validate(model_config, world_size)`` into frozen ``SeqParSettings`` (``settings.py``).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)

from ds_seqpar.comm.schedules import SCHEDULES
from ds_seqpar.comm.schedules.ring import RingSpec
from ds_seqpar.comm.schedules.startrail import BACKWARD_CHOICES
from ds_seqpar.config.dit import DitConfig
from ds_seqpar.config.inference import InferenceConfig
from ds_seqpar.layout import LAYOUTS, StripeLayout, ZigzagLayout
from ds_seqpar.ops.attention import KERNELS
from ds_seqpar.ops.sparse.kernels import SPARSE_AUTO_SUMMARY, SPARSE_KERNELS
from ds_seqpar.settings import (
    SeqParSettings,
    check_ring,
    check_ulysses_divides,
    resolve_settings,
)

__all__ = [
    "AUTO",
    "SECTION",
    "LinearConfig",
    "MemoryConfig",
    "RingConfig",
    "SequenceParallelConfig",
    "SparseConfig",
]

SECTION = "sequence_parallel"
AUTO = "auto"  # the policy value of the kernel keys: chosen per device and dtype by the kernel registry

StarTrailBackward = Literal[BACKWARD_CHOICES]
AttentionName = Literal["usp", "ulysses", "ring", "sparse_ring"]
BalancingName = Literal["stripe", "dbsp", "none"]
PlanName = Literal["manual", "auto"]


def _fmt_choices(values: list[Any]) -> str:
    return ", ".join(str(v) for v in values)


def _one_of(key: str, value: str, names: list[str]) -> str:
    """``value`` if it is one of ``names``, else the error that lists them (the registries' names)."""
    if value not in names:
        raise ValueError(f"{SECTION}.{key}={value!r} is not valid; valid: {_fmt_choices(names)}")
    return value


def _menu(entries: dict[str, Any], lead: list[tuple[str, str]] = ()) -> str:
    """``name (summary) | ...`` of a registry, for a field's description."""
    return " | ".join(
        f"{name} ({summary})" for name, summary in [*lead, *((n, e.summary) for n, e in entries.items())]
    )


class _Section(BaseModel):
    """Base of every config model: unknown keys are errors, and a parsed section is immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class RingConfig(_Section):
    """``sequence_parallel.ring``: how the ring axis lays out tokens and schedules transfers."""

    layout: str = Field(
        ZigzagLayout.name, description="Token layout over the ring ranks: " + _menu(LAYOUTS) + "."
    )
    granularity: StrictInt = Field(
        1, description="Stripe width in tokens for layout=stripe (1 = token stripes).", ge=1
    )
    inner_size: StrictInt | None = Field(
        None,
        description="Ranks per inner ring of the double (hierarchical) ring; must divide the ring degree. "
        "null = single ring.",
        ge=1,
    )
    overlap: StrictBool = Field(
        True, description="Overlap the K/V transfer of ring step s+1 with the compute of step s."
    )
    schedule: str = Field(
        RingSpec.name,
        description="How K/V reach every rank: "
        + _menu(SCHEDULES)
        + ". docs/schedules.md says when to use each.",
    )
    team_size: StrictInt | None = Field(
        None,
        description="StarTrail team size C (schedule=startrail): C^2 must divide the ring degree R; 1 = ring.",
        ge=1,
    )
    grid: list[StrictInt] | None = Field(
        None,
        description="ATTENTION2D grid [P_q, P_kv] (schedule=attention2d): P_q x P_kv = ring degree R.",
        min_length=2,
        max_length=2,
    )
    startrail_backward: StarTrailBackward = Field(
        "auto",
        description="StarTrail backward: kv (K/V and dK/dV accumulators travel, like the ring) | query (Q, dO, "
        "lse, delta and a dQ accumulator travel, K/V stay) | auto (the one sending fewer bytes per step).",
    )

    @field_validator("layout")
    @classmethod
    def _layout(cls, value: str) -> str:
        return _one_of("ring.layout", value, list(LAYOUTS))

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, value: str) -> str:
        return _one_of("ring.schedule", value, list(SCHEDULES))


class SparseConfig(_Section):
    """``sequence_parallel.sparse``: dynamic vertical-slash sparse attention (``attention: "sparse_ring"``)."""

    pattern: Literal["vertical_slash"] = Field(
        "vertical_slash", description="Sparsity pattern: vertical_slash (key columns + diagonals, MTraining)."
    )
    vertical: StrictInt | StrictFloat = Field(
        0.01,
        description="Vertical key columns kept per head: a count (int) or a fraction of S (float in (0, 1]).",
    )
    slash: StrictInt | StrictFloat = Field(
        0.02, description="Slash diagonals kept per head: a count (int) or a fraction of S (float in (0, 1])."
    )
    block_size: StrictInt = Field(
        128, ge=1, description="Block (tile) size G in tokens: diagonals run as G x G blocks; stripe width."
    )
    last_q: StrictInt = Field(
        64, ge=1, description="Last queries of the sequence used to estimate the pattern."
    )
    sink_tokens: StrictInt = Field(4, ge=0, description="First key columns always kept (attention sinks).")
    local_diagonals: StrictInt = Field(
        64, ge=1, description="Diagonals nearest the main diagonal always kept (local attention)."
    )
    balancing: BalancingName = Field(
        "stripe",
        description="Work balance: stripe (block stripes of block_size over the ring, MTraining) | dbsp (stripes + "
        "head permutation before the Ulysses all-to-all + block reassignment, db-SP) | none (ring.layout as set).",
    )
    layers: Literal["all"] | list[StrictInt] = Field(
        "all", description='Layers that run sparse ("all" or a list of layer indices); the others stay dense.'
    )
    dense_warmup_steps: StrictInt = Field(
        0, ge=0, description="Training steps that run dense before sparsity starts."
    )
    report_balance: StrictBool = Field(
        True, description="Compute the imbalance ratio rho_s of every sparse layer (ds_seqpar.sparse_stats)."
    )
    kernel: str = Field(
        AUTO,
        description="Sparse block kernel: " + _menu(SPARSE_KERNELS, [(AUTO, SPARSE_AUTO_SUMMARY)]) + ".",
    )

    @field_validator("kernel")
    @classmethod
    def _kernel(cls, value: str) -> str:
        return _one_of("sparse.kernel", value, [AUTO, *SPARSE_KERNELS])

    @field_validator("layers")
    @classmethod
    def _layers(cls, value: str | list[int]) -> str | list[int]:
        if isinstance(value, list) and any(i < 0 for i in value):
            raise ValueError(
                f'sequence_parallel.sparse.layers={value} has a negative layer index; valid: "all" or indices >= 0'
            )
        return value

    @field_validator("vertical", "slash")
    @classmethod
    def _budget(cls, value: int | float, info: Any) -> int | float:
        if isinstance(value, float) and not 0.0 < value <= 1.0:
            raise ValueError(
                f"sequence_parallel.sparse.{info.field_name}={value} is not a fraction in (0, 1]; "
                "valid: a float such as 0.02 (fraction of S) or an int count such as 512"
            )
        if isinstance(value, int) and value < 0:
            raise ValueError(
                f"sequence_parallel.sparse.{info.field_name}={value} must be >= 0; valid: e.g. 512"
            )
        return value


class LinearConfig(_Section):
    """``sequence_parallel.linear``: linear-attention layers (All-Scan over the ring, ``parallel/linear_scan.py``)."""

    scan: Literal["all_scan", "all_gather"] = Field(
        "all_scan",
        description="How each ring rank gets the state entering its tokens: all_scan (pipelined P2P scan, "
        "one state per hop, ZeCO) | all_gather (all-gather every rank's state, LASP-2; for comparison).",
    )
    blocks: StrictInt = Field(
        4, ge=1, description="K: row blocks along d_k the state travels in (pipelining; capped at d_k)."
    )
    chunk_size: StrictInt = Field(64, ge=1, description="Chunk size of the local chunked linear attention.")


class MemoryConfig(_Section):
    """``sequence_parallel.memory``: what trades compute for memory at long sequence lengths (docs/memory.md)."""

    activation_checkpointing: StrictBool = Field(
        False,
        description="Checkpoint every decoder layer: keep only its input, recompute it (attention exchange "
        "included) in backward.",
    )
    offload: StrictBool = Field(
        False,
        description="Move the checkpointed layer inputs to host memory (pinned, pooled, side-stream copies on "
        "CUDA; the last layer's input stays on the device). Needs activation_checkpointing.",
    )
    tiled_mlp: StrictBool = Field(
        False,
        description="Run the position-wise MLP (or MoE block) of every decoder layer over sequence tiles, "
        "recomputed tile by tile in backward.",
    )
    tiled_norms: StrictBool = Field(
        False,
        description="Run the norms of every decoder layer and the final norm over sequence tiles the same way "
        "(they keep their input only).",
    )
    mlp_tile_tokens: Annotated[StrictInt, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description='Tokens per tile of the tiled MLPs and norms; "auto" = max(1024, hidden_size). Needs tiled_mlp '
        "or tiled_norms.",
    )

    @model_validator(mode="after")
    def _check(self) -> MemoryConfig:
        if self.offload and not self.activation_checkpointing:
            raise ValueError(
                "sequence_parallel.memory.offload=true offloads the inputs that activation checkpointing keeps, "
                "but memory.activation_checkpointing is false; valid: set activation_checkpointing=true, or "
                "offload=false"
            )
        if "mlp_tile_tokens" in self.model_fields_set and not (self.tiled_mlp or self.tiled_norms):
            raise ValueError(
                f"sequence_parallel.memory.mlp_tile_tokens={self.mlp_tile_tokens!r} is set but memory.tiled_mlp and "
                "memory.tiled_norms are false, which ignore it; valid: set tiled_mlp=true, or remove mlp_tile_tokens"
            )
        return self


class SequenceParallelConfig(_Section):
    """The validated ``sequence_parallel`` section of a DeepSpeed config."""

    enabled: StrictBool = Field(True, description="Turn sequence parallelism on or off.")
    size: Annotated[StrictInt, Field(ge=1)] | Literal["auto"] = Field(
        ...,
        description="SP degree P: ranks that split one sequence. World size must be a multiple. "
        '"auto" = world / data_parallel_size (all ranks of the world when data_parallel_size is unset); '
        "resolved when the config is loaded.",
    )
    data_parallel_size: Annotated[StrictInt, Field(ge=1)] | None = Field(
        None,
        description="Data-parallel degree dp (SP groups that read different samples). Optional: with it, "
        'world = data_parallel_size x size is checked, and size="auto" becomes world / data_parallel_size.',
    )
    ulysses_degree: Annotated[StrictInt, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="Ulysses (all-to-all over heads) degree U; divides `size`; ring degree R = size / U. "
        '"auto" = the largest divisor of size that the KV heads allow without replication '
        "(resolved by validate()).",
    )
    ulysses_chunks: Annotated[StrictInt, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="Head groups pipelined through the Ulysses all-to-all when the ring degree is 1: the "
        "exchange of one group overlaps the attention of another. 1 = one exchange per direction; "
        '"auto" = 4 (fewer when the heads per rank do not split evenly).',
    )
    ring: RingConfig = Field(default_factory=RingConfig, description="Ring-axis settings.")
    attention: AttentionName = Field(
        "usp",
        description="Algorithm: usp (Ulysses x Ring) | ulysses (U = size) | ring (U = 1) | sparse_ring "
        "(Ulysses x sparse ring with a dynamic vertical-slash pattern; settings in `sparse`).",
    )
    sparse: SparseConfig = Field(
        default_factory=SparseConfig, description="Sparse attention settings (attention='sparse_ring')."
    )
    inference: InferenceConfig = Field(
        default_factory=InferenceConfig,
        description="Long-prompt prefill: exact | apb | star and their parameters (docs/inference.md).",
    )
    dit: DitConfig = Field(
        default_factory=DitConfig,
        description="Diffusion transformers: CFG parallelism and PipeFusion beside the SP group (docs/dit.md).",
    )
    linear: LinearConfig = Field(
        default_factory=LinearConfig, description="Linear-attention layers (linear and hybrid models)."
    )
    memory: MemoryConfig = Field(
        default_factory=MemoryConfig,
        description="Activation checkpointing, offload and tiled MLP for long sequences (docs/memory.md).",
    )
    kernel: str = Field(
        AUTO,
        description="Block attention kernel: "
        + _menu(
            KERNELS,
            [(AUTO, "the first available of " + ", ".join(KERNELS) + " that applies the layer's softcap")],
        )
        + ".",
    )
    ranks_per_node: Annotated[StrictInt, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="Ranks that share a node (NVLink / NVSwitch domain): decides which bytes are intra- and "
        'which inter-node (CommStats link classes, python -m ds_seqpar.report). "auto" = the launcher\'s '
        "LOCAL_WORLD_SIZE (all ranks when unset); set it to simulate a cluster on one machine.",
    )
    dynamic_degree: StrictBool = Field(
        False,
        description="A dynamic SP degree per batch (needs ring.layout='documents'): a batch whose documents "
        "balance over groups of p < size ranks runs in such groups, each over whole documents of its own "
        "(p = 1: no attention communication at all); other batches use the whole group (docs/balance.md).",
    )
    fault_timeout_s: float = Field(
        1800.0,
        description="Seconds a rank waits in a collective for a failed, dead or hung peer before it gives up and "
        "names the rank and step at fault (the process group's timeout; set when ds_seqpar starts torch.distributed).",
    )
    plan: PlanName = Field(
        "manual",
        description="manual (ulysses_degree and ring as configured) | auto (the planner picks ulysses_degree and "
        "the ring's schedule, inner_size, team_size, grid for this size, world and model at load, predicting "
        "step time and peak memory per rank; a value set here that differs from its choice is refused; the "
        "choice and why are logged; needs attention='usp'; docs/plan.md).",
    )
    plan_seq_len: Annotated[StrictInt, Field(ge=2)] | None = Field(
        None, description='Tokens per sequence the plan="auto" optimises for; null: 32768.'
    )
    plan_cluster: str = Field(
        "local",
        description='What plan="auto" predicts on: local (this machine, measured once and cached under '
        "~/.cache/ds_seqpar/) or a cluster preset of ds_seqpar/plan/clusters.py (h100-ib, a100-eth, mi300x-ib).",
    )

    @field_validator("kernel")
    @classmethod
    def _kernel(cls, value: str) -> str:
        return _one_of("kernel", value, [AUTO, *KERNELS])

    @field_validator("fault_timeout_s")
    @classmethod
    def _fault_timeout(cls, value: float) -> float:
        if not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"{SECTION}.fault_timeout_s={value:g} must be > 0 seconds (how long a rank waits in a collective "
                "for a failed or hung peer before it names it; 0 is refused); valid: e.g. 1800 (the default, "
                "30 minutes)"
            )
        return value

    @model_validator(mode="after")
    def _check_degrees(self) -> SequenceParallelConfig:
        p, u = self.size, self.ulysses_degree
        if p == "auto":  # checked again once parse_section has resolved it from the world size
            return self
        if self.attention == "ulysses" and u not in ("auto", p):
            raise ValueError(
                f"sequence_parallel.ulysses_degree={u} conflicts with attention='ulysses', which needs "
                f"ulysses_degree=size={p}; valid: set ulysses_degree to {p} or use attention='usp'"
            )
        if self.attention == "ring" and u not in ("auto", 1):
            raise ValueError(
                f"sequence_parallel.ulysses_degree={u} conflicts with attention='ring', which needs "
                f"ulysses_degree=1; valid: set ulysses_degree to 1 or use attention='usp'"
            )
        if u != "auto":
            check_ulysses_divides(p, u)
            check_ring(self, u)
        elif self.attention == "ring":
            check_ring(self, 1)
        SCHEDULES[self.ring.schedule].check_section(self.ring)
        self._check_placement()
        self._check_plan()
        self._check_sparse()
        self._check_schedule_keys()
        if not LAYOUTS[self.ring.layout].takes_granularity and self.ring.granularity != 1:
            only = " or ".join(f"layout='{n}'" for n, cls in LAYOUTS.items() if cls.takes_granularity)
            raise ValueError(
                f"sequence_parallel.ring.granularity={self.ring.granularity} only applies to {only} (layout is "
                f"'{self.ring.layout}'); valid: remove granularity or set ring.{only}"
            )
        return self

    def _check_plan(self) -> None:
        """plan="auto" chooses U, so it needs the usp algorithm; the plan_* keys only apply to it."""
        if self.plan == "manual":
            for key in ("plan_seq_len", "plan_cluster"):
                if key in self.model_fields_set:
                    raise ValueError(
                        f"sequence_parallel.{key} is set but plan='manual' ignores it; valid: plan='auto', "
                        f"or remove {key}"
                    )
            return
        if self.attention != "usp":
            raise ValueError(
                f"sequence_parallel.plan='auto' chooses ulysses_degree, which attention='{self.attention}' fixes; "
                "valid: attention='usp' (the default), or plan='manual'"
            )

    def _check_placement(self) -> None:
        """A per-batch document placement needs a schedule on the ring layout's own ranks, and dense attention;
        a dynamic degree needs a per-batch placement."""
        layout = self.ring.layout
        if not LAYOUTS[layout].per_batch:
            if self.dynamic_degree:
                valid = " or ".join(f"'{n}'" for n, cls in LAYOUTS.items() if cls.per_batch)
                raise ValueError(
                    f"sequence_parallel.dynamic_degree=true needs a per-batch document placement, but ring.layout="
                    f"'{layout}'; valid: ring.layout={valid}, or dynamic_degree=false"
                )
            return
        if self.attention == "sparse_ring":
            raise ValueError(
                f"sequence_parallel.ring.layout='{layout}' places each batch's documents, which attention="
                "'sparse_ring' does not follow; valid: attention 'usp', 'ring' or 'ulysses', or another ring.layout"
            )
        if not SCHEDULES[self.ring.schedule].places_documents:
            valid = ", ".join(f"'{n}'" for n, spec in SCHEDULES.items() if spec.places_documents)
            raise ValueError(
                f"sequence_parallel.ring.layout='{layout}' places each batch's documents on the ring ranks, which "
                f"ring.schedule='{self.ring.schedule}' regroups into teams or pieces; valid: ring.schedule {valid}, "
                "or another ring.layout"
            )

    def _check_sparse(self) -> None:
        sparse = self.sparse
        if self.attention != "sparse_ring":
            if "sparse" in self.model_fields_set:
                raise ValueError(
                    f"sequence_parallel.sparse is set but attention='{self.attention}' ignores it; "
                    "valid: attention='sparse_ring', or remove the sparse section"
                )
            return
        if sparse.balancing == "none":
            return
        ring_set = self.ring.model_fields_set
        if "layout" in ring_set and self.ring.layout != StripeLayout.name:
            raise ValueError(
                f"sequence_parallel.ring.layout='{self.ring.layout}' conflicts with sparse.balancing="
                f"'{sparse.balancing}', which lays tokens out in stripes of sparse.block_size; valid: remove "
                "ring.layout, or set sparse.balancing='none'"
            )
        if "granularity" in ring_set and self.ring.granularity != sparse.block_size:
            raise ValueError(
                f"sequence_parallel.ring.granularity={self.ring.granularity} differs from sparse.block_size="
                f"{sparse.block_size}; with sparse.balancing='{sparse.balancing}' the stripe width is the block "
                "size: remove ring.granularity"
            )

    def _check_schedule_keys(self) -> None:
        """Ring keys that only one schedule reads, and schedules the sparse ring cannot run on."""
        ring, kind = self.ring, self.ring.schedule
        owners = {key: name for name, spec in SCHEDULES.items() for key in spec.owns}
        for key in type(ring).model_fields:
            owner = owners.get(key)
            if owner is not None and key in ring.model_fields_set and kind != owner:
                raise ValueError(
                    f"sequence_parallel.ring.{key} is set but ring.schedule='{kind}' ignores it; valid: "
                    f"ring.schedule='{owner}', or remove ring.{key}"
                )
        if self.attention == "sparse_ring" and not SCHEDULES[kind].sparse_ring:
            valid = " or ".join(f"'{n}'" for n, spec in SCHEDULES.items() if spec.sparse_ring)
            raise ValueError(
                f"sequence_parallel.ring.schedule='{kind}' is not built for attention='sparse_ring'; valid: "
                f"ring.schedule={valid}, or attention='usp'"
            )

    def validate(self, model_config: Any = None, world_size: int | None = None) -> SeqParSettings:
        """The frozen settings of this section: what needs the model or the world checked, every ``"auto"``
        resolved (``settings.resolve_settings``).

        Args:
            model_config: anything with ``num_attention_heads`` (and optionally ``num_key_value_heads``),
                e.g. a HuggingFace ``PretrainedConfig``, or None to skip the head checks.
            world_size: total number of ranks, or None to skip the world check.
        """
        return resolve_settings(self, model_config, world_size)
