"""The explicit per-forward state of sequence parallelism: what every attention and recurrent layer of one
forward needs besides its inputs, and what they did.

``SeqParCausalLM`` (and the other wrappers) make one ``SeqParContext`` per forward and pass it in the
forward kwargs as ``ds_seqpar_context=...``; layers that do not pass their keyword arguments on to the
attention interface (e.g. StableLM, Nemotron) find it through ``ACTIVE_CONTEXT``, set around the
decoder call. Nothing else is shared between layers.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

import torch

from ds_seqpar.integrations.sharded_cache import ShardedCache
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.parallel.work import WorkCounter

__all__ = ["ACTIVE_CONTEXT", "CONTEXT_KEY", "SeqParContext", "current_context"]

CONTEXT_KEY = "ds_seqpar_context"


@dataclass
class SeqParContext:
    """What the attention layers of one forward need besides q, k, v, and what they did.

    ``layer_of`` maps ``id(module)`` of every submodule of a decoder layer to that layer's index;
    ``layers`` collects the indices of the layers that called the attention, ``windows`` / ``chunks`` the
    calls that applied a sliding window / an attention chunk.

    Cross-attention (``SeqParSeq2SeqLM``): ``cross_active`` holds the ids of the attention modules
    running on encoder states right now (their calls go to ``ds_seqpar.cross_attention``), with the
    encoder shard's key mask ``cross_mask [B, m]`` (None: no padding) and ``cross_schedule``;
    ``cross_calls`` counts them. ``local_attention``: the name of a transformers attention implementation
    that every call runs instead, unsplit (a replicated encoder's forward over its whole input).
    ``cache``: the sharded KV cache of ``ds_seqpar.prefill`` / decoding (``sharded_cache.py``): the attention
    layers store this rank's K/V into it, or, while ``cache.decoding``, append to and read from it.
    ``approximate``: a callable with ``ds_seqpar.attention``'s signature that every self-attention call runs
    instead of it (APB / Star Attention prefill, docs/inference.md).
    ``blocks``: None, or the image block id per token of the whole sequence in global order (``[S]`` /
    ``[B, S]``, negative = text; HF's ``block_sequence_ids``): the causal self-attention calls let a query see
    the rest of its own block (``ds_seqpar.attention(blocks=...)``, docs/kernels.md "Image blocks").
    """

    mesh: SeqParMesh
    doc_ids: torch.Tensor | None = None
    work: WorkCounter | None = None
    step: int = 0
    calls: int = field(default=0)
    layer_of: dict[int, int] = field(default_factory=dict)
    layers: set[int] = field(default_factory=set)
    windows: int = 0
    chunks: int = 0
    bidirectional: int = 0
    cross_mask: torch.Tensor | None = None
    cross_schedule: str = "auto"
    cross_active: set[int] = field(default_factory=set)
    cross_calls: int = 0
    local_attention: str | None = None
    cache: ShardedCache | None = None
    cache_calls: dict[int, int] = field(default_factory=dict)

    def cache_slot(self, module: torch.nn.Module) -> Any:
        """The cache entry of this call of ``module``'s attention: its layer index for the layer's first call in
        this forward, ``(layer, n)`` for its n-th repeat (differential attention calls it twice per layer, HRM
        runs its layers once per cycle); prefill and every decoding step make the calls in the same order."""
        layer = self.layer_of.get(id(module), getattr(module, "layer_idx", None))
        n = self.cache_calls.get(layer, 0)
        self.cache_calls[layer] = n + 1
        return layer if n == 0 else (layer, n)

    approximate: Any = None  # an approximate prefill's attention (integrations/apb_prefill.py), else None
    blocks: torch.Tensor | None = None  # image block ids [S] / [B, S] of the whole sequence (class docstring)

    def record(
        self,
        module: torch.nn.Module,
        window: int | None = None,
        causal: bool = True,
        chunk: int | None = None,
    ) -> None:
        """Count one sequence-parallel call of ``module`` (attention or linear attention)."""
        self.calls += 1
        self.windows += window is not None
        self.chunks += chunk is not None
        self.bidirectional += not causal
        if id(module) in self.layer_of:
            self.layers.add(self.layer_of[id(module)])


# The context of the forward in progress, for layers that do not pass their keyword arguments on to
# the attention interface (e.g. StableLM, Nemotron); SeqParCausalLM sets it around the decoder call.
ACTIVE_CONTEXT: contextvars.ContextVar[SeqParContext | None] = contextvars.ContextVar(
    CONTEXT_KEY, default=None
)


def current_context(kwargs: dict[str, Any]) -> SeqParContext | None:
    """The context passed in ``kwargs``, else the one of the forward in progress."""
    ctx = kwargs.get(CONTEXT_KEY)
    return ctx if isinstance(ctx, SeqParContext) else ACTIVE_CONTEXT.get()
