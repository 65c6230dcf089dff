"""The ``"sequence_parallel"`` section of a DeepSpeed JSON, as a typed and validated model.

Example (all keys optional except ``size``, which may be ``"auto"``: every rank of the world, or
world / ``data_parallel_size``)::

    "sequence_parallel": {
      "enabled": true,
      "size": 8,
      "ulysses_degree": 2,
      "ring": {"layout": "zigzag", "inner_size": null, "overlap": true},
      "attention": "usp",
      "kernel": "auto"
    }

Mesh vocabulary: ``size`` = P (SP degree), ``ulysses_degree`` = U, ring degree R = P / U,
``ring.inner_size`` = ranks per inner ring of the double ring (R_inner; R_outer = R / R_inner).

Two validation stages:

* ``load_config(path_or_dict)`` checks everything the section alone can check (types, choices,
  divisibility, unknown keys) and returns the section plus the DeepSpeed dict with DeepSpeed's own
  ``sequence_parallel_size`` set.
* ``SequenceParallelConfig.validate(model_config, world_size)`` checks what needs the model or the
  world (heads vs U, world vs size) and resolves ``ulysses_degree="auto"``.

Every error is a ``SeqParConfigError`` whose message names the key, the bad value and a valid
alternative, e.g. ``sequence_parallel.ulysses_degree=3 does not divide size=8; valid: 1, 2, 4, 8``.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

SECTION = "sequence_parallel"

LayoutName = Literal["contiguous", "zigzag", "stripe"]
ScheduleName = Literal["p2p", "all_gather", "tasp", "startrail", "attention2d"]
StarTrailBackward = Literal["auto", "kv", "query"]
NO_HAMILTONIAN_DECOMPOSITION = (4, 6)  # the complete digraphs TASP cannot use (Tillson)
SparseKernelName = Literal["auto", "triton", "blocks", "masked"]
AttentionName = Literal["usp", "ulysses", "ring", "sparse_ring"]
BalancingName = Literal["stripe", "dbsp", "none"]
KernelName = Literal["auto", "torch", "sdpa", "cuda_sdpa", "flash_attn"]


class SeqParConfigError(ValueError):
    """A ``sequence_parallel`` setting is invalid; the message names the key and a fix."""


class MissingFileError(SeqParConfigError, FileNotFoundError):
    """A path the user gave (config, data, checkpoint) does not exist; the message names it and the fix."""


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _fmt_choices(values: list[Any]) -> str:
    return ", ".join(str(v) for v in values)


class _Section(BaseModel):
    """Base of every config model: unknown keys are errors, assignments are re-validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class RingConfig(_Section):
    """``sequence_parallel.ring``: how the ring axis lays out tokens and schedules transfers."""

    layout: LayoutName = Field(
        "zigzag",
        description="Token layout over the ring ranks: contiguous | zigzag (2R chunks, balanced causal) | "
        "stripe (round-robin blocks of `granularity` tokens).",
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
    schedule: ScheduleName = Field(
        "p2p",
        description="How K/V reach every rank: p2p (ring / double ring of isend/irecv) | all_gather "
        "(Llama-3 style all-gather K/V + reduce-scatter dK/dV; for irregular packed batches) | tasp (d - 1 "
        "concurrent rings over the Hamiltonian cycles of a domain of d = inner_size (or R) ranks: every link "
        "of an all-to-all node busy) | startrail (teams of team_size ranks gather Q/K/V, sub-rings of "
        "R / team_size^2 ranks carry K/V between teams: inter-node bytes / team_size) | attention2d "
        "(grid of P_q x P_kv ranks: Q gathered along rows, K/V along columns, outputs merged along rows). "
        "docs/schedules.md says when to use each.",
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
    kernel: SparseKernelName = Field(
        "auto",
        description="Sparse block kernel: auto (triton where it runs, else blocks) | triton (block-sparse Triton "
        "kernel, CUDA, no host sync) | blocks (tile planner over the dense kernel, any device) | masked (dense "
        "kernel under the token mask, any device, no host sync, O(S^2) work).",
    )

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
    linear: LinearConfig = Field(
        default_factory=LinearConfig, description="Linear-attention layers (linear and hybrid models)."
    )
    memory: MemoryConfig = Field(
        default_factory=MemoryConfig,
        description="Activation checkpointing, offload and tiled MLP for long sequences (docs/memory.md).",
    )
    kernel: KernelName = Field(
        "auto",
        description="Block attention kernel: auto | torch (chunked reference) | sdpa (PyTorch CPU flash op) | "
        "cuda_sdpa (PyTorch's fused CUDA ops) | flash_attn (CUDA).",
    )
    ranks_per_node: Annotated[StrictInt, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="Ranks that share a node (NVLink / NVSwitch domain): decides which bytes are intra- and "
        'which inter-node (CommStats link classes, python -m ds_seqpar.report). "auto" = the launcher\'s '
        "LOCAL_WORLD_SIZE (all ranks when unset); set it to simulate a cluster on one machine.",
    )
    fault_timeout_s: Annotated[float, Field(gt=0)] = Field(
        1800.0,
        description="Seconds a rank waits in a collective for a failed, dead or hung peer before it gives up and "
        "names the rank and step at fault (the process group's timeout; set when ds_seqpar starts torch.distributed).",
    )

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
        if u != "auto" and p % u != 0:
            raise ValueError(
                f"sequence_parallel.ulysses_degree={u} does not divide size={p}; valid: {_fmt_choices(divisors(p))}"
            )
        if u != "auto":
            self._check_ring(p // u)
        elif self.attention == "ring":
            self._check_ring(p)
        if self.ring.schedule == "all_gather" and self.ring.inner_size is not None:
            raise ValueError(
                f"sequence_parallel.ring.inner_size={self.ring.inner_size} needs ring.schedule='p2p' (a double "
                "ring is a P2P schedule); valid: ring.inner_size=null or ring.schedule='p2p'"
            )
        self._check_sparse()
        self._check_schedule_keys()
        if self.ring.layout != "stripe" and self.ring.granularity != 1:
            raise ValueError(
                f"sequence_parallel.ring.granularity={self.ring.granularity} only applies to layout='stripe' "
                f"(layout is '{self.ring.layout}'); valid: remove granularity or set ring.layout='stripe'"
            )
        return self

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
        if "layout" in ring_set and self.ring.layout != "stripe":
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

    @property
    def ring_layout(self) -> tuple[str, int]:
        """``(layout, granularity)`` the ring actually uses (sparse balancing stripes by the block size)."""
        if self.attention == "sparse_ring" and self.sparse.balancing != "none":
            return "stripe", self.sparse.block_size
        return self.ring.layout, self.ring.granularity

    def _check_ring(self, ring_degree: int) -> None:
        inner = self.ring.inner_size
        if inner is not None and ring_degree % inner != 0:
            raise ValueError(
                f"sequence_parallel.ring.inner_size={inner} does not divide the ring degree R={ring_degree} "
                f"(size={self.size} / ulysses_degree={self.ulysses_degree}); "
                f"valid: null, {_fmt_choices(divisors(ring_degree))}"
            )
        ring, kind = self.ring, self.ring.schedule
        if kind == "tasp":
            domain = inner or ring_degree
            if domain in NO_HAMILTONIAN_DECOMPOSITION:
                valid = [d for d in divisors(ring_degree) if d > 1 and d not in NO_HAMILTONIAN_DECOMPOSITION]
                raise ValueError(
                    f"sequence_parallel.ring.schedule='tasp' over a domain of {domain} ranks (ring.inner_size="
                    f"{inner}, ring degree R={ring_degree}): the complete digraph on 4 or 6 ranks has no Hamiltonian "
                    f"decomposition; valid: ring.inner_size in {_fmt_choices(valid)} (nearest sizes with one: "
                    f"{domain - 1}, {domain + 1}), or ring.schedule='p2p'"
                )
        if kind == "startrail":
            valid = [c for c in divisors(ring_degree) if ring_degree % (c * c) == 0]
            c = ring.team_size
            if c is None or ring_degree % (c * c) != 0:
                raise ValueError(
                    f"sequence_parallel.ring.team_size={c} does not suit ring.schedule='startrail' on the ring degree "
                    f"R={ring_degree}: C^2 must divide R (teams of C ranks, sub-rings of R / C^2); valid: "
                    f"{_fmt_choices(valid)}"
                )
        if kind == "attention2d":
            grid = ring.grid
            if grid is None or grid[0] < 1 or grid[1] < 1 or grid[0] * grid[1] != ring_degree:
                valid = [f"[{d}, {ring_degree // d}]" for d in divisors(ring_degree)]
                raise ValueError(
                    f"sequence_parallel.ring.grid={grid} does not suit ring.schedule='attention2d' on the ring degree "
                    f"R={ring_degree}: P_q x P_kv must equal R; valid: {', '.join(valid)}"
                )

    def _check_schedule_keys(self) -> None:
        """Schedule settings that only one schedule reads, and schedules that do not compose."""
        ring, kind = self.ring, self.ring.schedule
        for key, owner in (
            ("team_size", "startrail"),
            ("grid", "attention2d"),
            ("startrail_backward", "startrail"),
        ):
            if key in ring.model_fields_set and kind != owner:
                raise ValueError(
                    f"sequence_parallel.ring.{key} is set but ring.schedule='{kind}' ignores it; valid: "
                    f"ring.schedule='{owner}', or remove ring.{key}"
                )
        if kind in ("startrail", "attention2d") and ring.inner_size is not None:
            raise ValueError(
                f"sequence_parallel.ring.inner_size={ring.inner_size} makes a double ring, which "
                f"ring.schedule='{kind}' does not compose with (its teams / grid rows already stay inside a node); "
                "valid: ring.inner_size=null, or ring.schedule='p2p' / 'tasp'"
            )
        if self.attention == "sparse_ring" and kind not in ("p2p", "all_gather"):
            raise ValueError(
                f"sequence_parallel.ring.schedule='{kind}' is not built for attention='sparse_ring'; valid: "
                "ring.schedule='p2p' or 'all_gather', or attention='usp'"
            )

    # ----------------------------------------------------------------------------------------
    @property
    def ring_degree(self) -> int:
        """R = size / U (needs a resolved ``ulysses_degree``)."""
        return self.size // self.resolved_ulysses_degree

    @property
    def resolved_ulysses_degree(self) -> int:
        if self.ulysses_degree == "auto":
            if self.attention == "ring":
                return 1
            if self.attention == "ulysses":
                return self.size
            raise SeqParConfigError(
                'sequence_parallel.ulysses_degree="auto" is resolved by validate(model_config, world_size); '
                "call it first or set an integer ulysses_degree"
            )
        return self.ulysses_degree

    @property
    def ring_pieces(self) -> int:
        """Equal pieces each ring shard's segments are cut into (``tasp``: d − 1, one per cycle), else 1."""
        if not self.enabled or self.ring.schedule != "tasp" or self.size == "auto":
            return 1
        return max(1, self.ring_inner_size - 1)

    @property
    def ring_inner_size(self) -> int:
        """Ranks per inner ring (R when the ring is a single ring)."""
        return self.ring.inner_size or self.ring_degree

    def validate(self, model_config: Any = None, world_size: int | None = None) -> SequenceParallelConfig:
        """Check the constraints that need the model or the world; return a copy with U resolved.

        Args:
            model_config: anything with ``num_attention_heads`` (and optionally ``num_key_value_heads``),
                e.g. a HuggingFace ``PretrainedConfig``, or None to skip the head checks.
            world_size: total number of ranks, or None to skip the world check.
        """
        if self.size == "auto":
            raise SeqParConfigError(
                'sequence_parallel.size="auto" is resolved by parse_section / load_config (from the world size); '
                "validate() needs the resolved section"
            )
        dp = self.data_parallel_size
        if world_size is not None and dp is not None and dp * self.size != world_size:
            raise SeqParConfigError(
                f"sequence_parallel.data_parallel_size={dp} x size={self.size} = {dp * self.size} ranks, but the "
                f"world has {world_size}; valid: data_parallel_size={world_size // self.size} for size={self.size}"
                if world_size % self.size == 0
                else f"sequence_parallel.data_parallel_size={dp} x size={self.size} = {dp * self.size} ranks, but "
                f'the world has {world_size}; valid: size="auto" or a size that divides {world_size}'
            )
        if world_size is not None and (world_size < 1 or world_size % self.size != 0):
            valid = divisors(world_size) if world_size >= 1 else [1]
            raise SeqParConfigError(
                f"sequence_parallel.size={self.size} does not divide the world size {world_size} "
                f"(world = data_parallel x size); valid: {_fmt_choices(valid)}"
            )
        resolved = self.model_copy(deep=True)
        if model_config is None:
            if self.ulysses_degree == "auto" and self.attention in ("usp", "sparse_ring"):
                raise SeqParConfigError(
                    'sequence_parallel.ulysses_degree="auto" needs the model\'s head counts; '
                    "pass model_config to validate() or set an integer ulysses_degree"
                )
            if self.ulysses_degree == "auto":
                resolved.ulysses_degree = self.resolved_ulysses_degree
            return resolved
        heads, kv_heads = head_counts(model_config)
        if self.ulysses_degree == "auto":
            if self.attention in ("usp", "sparse_ring"):
                resolved.ulysses_degree = auto_ulysses_degree(self.size, heads, kv_heads)
            else:
                resolved.ulysses_degree = self.resolved_ulysses_degree
            resolved._check_ring(self.size // resolved.ulysses_degree)
        u = resolved.ulysses_degree
        if u > heads:
            valid = [d for d in divisors(self.size) if d <= heads]
            raise SeqParConfigError(
                f"sequence_parallel.ulysses_degree={u} exceeds the model's num_attention_heads={heads}; "
                f"valid: {_fmt_choices(valid)}"
            )
        return resolved


def head_counts(model_config: Any) -> tuple[int, int]:
    """``(num_attention_heads, num_key_value_heads)`` of a model config (dict or object); a composite
    config without head counts of its own (a language model under ``text_config``) is read there."""

    def get(name: str) -> Any:
        if isinstance(model_config, dict):
            return model_config.get(name)
        return getattr(model_config, name, None)

    text_config = get("text_config")
    if get("num_attention_heads") is None and text_config is not None:
        return head_counts(text_config)
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
            f"valid: {_fmt_choices(divisors(heads))}"
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


def config_field_paths(model: type[BaseModel] = SequenceParallelConfig, prefix: str = SECTION) -> list[str]:
    """Dotted names of every field, e.g. ``sequence_parallel.ring.layout`` (used by the docs test)."""
    paths: list[str] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}"
        paths.append(path)
        sub = _submodel(field.annotation)
        if sub is not None:
            paths.extend(config_field_paths(sub, path))
    return paths


def _submodel(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        sub = _submodel(arg)
        if sub is not None:
            return sub
    return None


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel]:
    """The model class that owns the last element of a pydantic error location."""
    model: type[BaseModel] = SequenceParallelConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        sub = _submodel(field.annotation) if field is not None else None
        if sub is None:
            break
        model = sub
    return model


def _literal_choices(annotation: Any) -> list[Any]:
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    out: list[Any] = []
    for arg in get_args(annotation):
        out.extend(_literal_choices(arg))
    return out


def _accepts_int(annotation: Any) -> bool:
    if annotation is int:
        return True
    return any(_accepts_int(arg) for arg in get_args(annotation))


def _format_error(err: dict[str, Any]) -> str:
    """One readable line for one pydantic error: key, bad value, valid alternative."""
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p in {"int", "literal['auto']"}))
    loc = tuple(p for p in loc if not str(p).startswith(("constrained-int", "function-")))
    key = ".".join([SECTION, *(str(p) for p in loc)]) if loc else SECTION
    kind = err["type"]
    bad = err.get("input")
    if kind == "value_error":
        return str(err["ctx"]["error"]) if "ctx" in err else err["msg"]
    if kind == "extra_forbidden":
        owner = _model_at(loc)
        valid = list(owner.model_fields)
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"{key} is not a known key{hint}; valid keys: {_fmt_choices(valid)}"
    if kind == "missing":
        return f"{key} is required; e.g. {key}=8 (the number of ranks that split one sequence)"
    field = _model_at(loc).model_fields.get(str(loc[-1])) if loc else None
    annotation = field.annotation if field is not None else None
    choices = _literal_choices(annotation)
    if choices and _accepts_int(annotation):
        # a union such as `int >= 1 | "auto"`: one message for whichever branch complained
        return f"{key}={bad!r} is not valid; valid: a positive integer or {_fmt_choices(choices)}"
    if choices:
        return f"{key}={bad!r} is not valid; valid: {_fmt_choices(choices)}"
    if kind in {"greater_than_equal", "greater_than"}:
        return (
            f"{key}={bad!r} must be >= {err['ctx'].get('ge', err['ctx'].get('gt'))}; valid: e.g. 1, 2, 4, 8"
        )
    if kind in {"int_type", "int_parsing", "int_from_float"}:
        return f"{key}={bad!r} must be an integer (JSON number without quotes); valid: e.g. 1, 2, 4, 8"
    if kind in {"bool_type", "bool_parsing"}:
        return f"{key}={bad!r} must be a boolean; valid: true, false"
    if kind in {"model_type", "dict_type", "model_attributes_type"}:
        owner = _submodel(annotation) if annotation is not None else None
        valid = _fmt_choices(list(owner.model_fields)) if owner else "an object"
        return f"{key}={bad!r} must be an object (JSON dict); valid keys: {valid}"
    return f"{key}={bad!r}: {err['msg']}"


def current_world_size() -> int:
    """The world size: torch.distributed's when it is up, else the launcher's ``WORLD_SIZE`` (1 alone)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    value = os.environ.get("WORLD_SIZE", "1")
    if not value.isdigit() or int(value) < 1:
        raise SeqParConfigError(f"WORLD_SIZE={value!r} in the environment is not a positive integer")
    return int(value)


def parse_section(section: dict[str, Any], world_size: int | None = None) -> SequenceParallelConfig:
    """Validate a ``sequence_parallel`` dict; raise ``SeqParConfigError`` listing every problem.

    ``size: "auto"`` is resolved here to ``world_size / data_parallel_size`` (``world_size`` defaults
    to :func:`current_world_size`), so the returned section always has an integer ``size``.
    """
    if not isinstance(section, dict):
        raise SeqParConfigError(
            f"{SECTION}={section!r} must be an object (JSON dict); valid: "
            f'{{"{SECTION}": {{"size": 8, "ulysses_degree": 2}}}}'
        )
    try:
        parsed = SequenceParallelConfig.model_validate(section)
    except ValidationError as exc:
        lines = [_format_error(e) for e in exc.errors()]
        raise SeqParConfigError("\n".join(dict.fromkeys(lines))) from None
    if parsed.size != "auto":
        return parsed
    world = current_world_size() if world_size is None else world_size
    dp = parsed.data_parallel_size or 1
    if world % dp != 0:
        raise SeqParConfigError(
            f'sequence_parallel.size="auto" with data_parallel_size={dp}: {dp} does not divide the world size '
            f"{world}; valid: data_parallel_size in {_fmt_choices(divisors(world))}"
        )
    return parse_section({**section, "size": world // dp}, world)


def load_config(
    config: str | os.PathLike[str] | dict[str, Any],
    world_size: int | None = None,
) -> tuple[SequenceParallelConfig, dict[str, Any]]:
    """Read a whole DeepSpeed config (path or dict) and split off the ``sequence_parallel`` section.

    ``world_size`` resolves ``size: "auto"`` (default: :func:`current_world_size`).

    Returns:
        ``(section, ds_config)``: the validated section, and a copy of the DeepSpeed dict without the
        section and with DeepSpeed's own ``sequence_parallel_size`` set to ``section.size`` (1 when
        sequence parallelism is disabled).
    """
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise SeqParConfigError(
                f"DeepSpeed config file '{path}' does not exist; valid: a path to a JSON file such as "
                "ds_configs/usp_zero3.json"
            )
        with open(path, encoding="utf-8") as fh:
            try:
                raw = json.load(fh)
            except json.JSONDecodeError as exc:
                raise SeqParConfigError(
                    f"DeepSpeed config file '{path}' is not valid JSON ({exc.msg} at line {exc.lineno}, "
                    f"column {exc.colno}); fix the JSON syntax there"
                ) from None
    elif isinstance(config, dict):
        raw = config
    else:
        raise SeqParConfigError(
            f"config={type(config).__name__} is not supported; valid: a path to a DeepSpeed JSON file or a dict"
        )
    ds_config = copy.deepcopy(raw)
    if SECTION not in ds_config:
        raise SeqParConfigError(
            f"the DeepSpeed config has no '{SECTION}' section; valid: add "
            f'"{SECTION}": {{"size": <ranks per sequence>}} (see docs/configuration.md)'
        )
    section = parse_section(ds_config.pop(SECTION), world_size)
    sp_size = section.size if section.enabled else 1
    existing = ds_config.get("sequence_parallel_size")
    if existing is not None and existing != sp_size:
        raise SeqParConfigError(
            f"sequence_parallel_size={existing} (DeepSpeed's key) disagrees with {SECTION}.size={sp_size}; "
            f"valid: remove sequence_parallel_size or set it to {sp_size}"
        )
    ds_config["sequence_parallel_size"] = sp_size
    return section, ds_config
