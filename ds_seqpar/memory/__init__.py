"""Memory savings for long sequences: layer checkpointing, offload of the kept inputs, tiled MLP, and the
memory model (docs/memory.md). Configured by ``sequence_parallel.memory``; ``SeqParCausalLM`` applies them."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from ds_seqpar.memory.checkpoint import LayerCheckpoint
from ds_seqpar.memory.estimate import MemoryEstimate, largest_seq_len, memory_estimate
from ds_seqpar.memory.inference import decode_cache_bytes, prefill_memory_estimate
from ds_seqpar.memory.offload import HostStore
from ds_seqpar.memory.tiled_mlp import TilePlan, find_mlps, find_norms, tile_modules

__all__ = [
    "HostStore",
    "LayerCheckpoint",
    "MemoryEstimate",
    "MemorySavings",
    "TilePlan",
    "decode_cache_bytes",
    "enable_memory_savings",
    "largest_seq_len",
    "memory_estimate",
    "prefill_memory_estimate",
]


@dataclass
class MemorySavings:
    """What ``enable_memory_savings`` switched on for one model."""

    store: HostStore | None = None  # kept layer inputs (checkpointing), offloaded or not
    plan: TilePlan | None = None  # tile count of the tiled MLPs
    checkpointed: str = ""  # "transformers" (HF's own layer wrapper) | "ds_seqpar" (our wrapper) | ""
    tiled: list[str] = field(default_factory=list)  # names of the tiled MLP modules

    def describe(self) -> str:
        parts = []
        if self.store is not None:
            parts.append(
                f"checkpointing ({self.checkpointed})" + (" + offload" if self.store.offload else "")
            )
        if self.plan is not None:
            parts.append(f"tiled {len(self.tiled)} modules ({self.plan.tile_tokens} tokens/tile)")
        return ", ".join(parts) or "none"


def _checkpoint_generic(layer: torch.nn.Module, checkpoint: LayerCheckpoint) -> None:
    """Checkpoint ``layer.forward`` ourselves (models whose layers have no transformers wrapper)."""
    original = layer.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if layer.training and torch.is_grad_enabled():
            return checkpoint(functools.partial(original, **kwargs), *args)
        return original(*args, **kwargs)

    forward.__ds_seqpar_checkpointed__ = original  # type: ignore[attr-defined]
    layer.forward = forward


def enable_memory_savings(
    hf: torch.nn.Module,
    decoder: torch.nn.Module,
    layers: list[torch.nn.Module],
    settings: Any,
    group: Any = None,
) -> MemorySavings:
    """Switch on what ``settings`` (the mesh's ``MemorySettings``) asks for, on the ``decoder`` of ``hf`` and its ``layers``.

    Checkpointing goes through transformers' own layer wrapper (``activation_checkpointing_enable``)
    when the model supports it, with :class:`LayerCheckpoint` as the checkpoint function; otherwise
    each layer's forward is wrapped. ``group``: the ZeRO partition group whose ranks agree on the tile
    count of the tiled MLPs.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    savings = MemorySavings()
    if settings.activation_checkpointing:
        if not layers:
            raise ValueError(
                f"sequence_parallel.memory.activation_checkpointing=true but {type(hf).__name__} has no list of "
                "num_hidden_layers decoder layers to checkpoint; set activation_checkpointing=false"
            )
        savings.store = HostStore(offload=settings.offload)
        checkpoint = LayerCheckpoint(savings.store)
        hf_layers = all(isinstance(layer, GradientCheckpointingLayer) for layer in layers)
        if hf_layers and getattr(hf, "supports_gradient_checkpointing", False):
            enable = getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable
            enable()
            for module in hf.modules():
                if hasattr(module, "gradient_checkpointing"):
                    module._gradient_checkpointing_func = checkpoint
            savings.checkpointed = "transformers"
        else:
            for layer in layers:
                _checkpoint_generic(layer, checkpoint)
            savings.checkpointed = "ds_seqpar"
    if settings.tiled_mlp or settings.tiled_norms:
        savings.plan = TilePlan(settings.mlp_tile_tokens, group)
        modules = find_mlps(layers) if settings.tiled_mlp else []
        modules += find_norms(layers, decoder) if settings.tiled_norms else []
        savings.tiled = tile_modules(modules, savings.plan)
    return savings
