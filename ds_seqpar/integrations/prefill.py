"""Sharded prefill: the prompt's forward under the config's SP layout, leaving a ``ShardedCache``
(docs/inference.md "Prefill").

Legend: P SP ranks, B batch, S0 prompt tokens, S = S0 padded to the layout's multiple, n = S / P, E hidden, V vocab.

``prefill(model, input_ids [B, S0], mesh=...)`` shards the prompt as training does (``shard_batch``), runs the
decoder without autograd state through the SP attention (every schedule, layout, window, document mask), and
each attention layer keeps this rank's K/V (``sharded_cache.py``). The last prompt token's hidden state
``[B, E]`` reaches every rank with one all-reduce over ``sp`` (the others add zeros), and every rank computes
its logits. How the forward runs is a registered ``PrefillMode``: ``"exact"`` here; approximate modes plug in
through ``register_prefill_mode``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ds_seqpar.data import shard_batch
from ds_seqpar.integrations.context import SeqParContext
from ds_seqpar.integrations.hf_model import UnsupportedModelError, unwrap_hf_model
from ds_seqpar.integrations.sharded_cache import ShardedCache, sp_reducer
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.parallel.agree import check_same_inputs
from ds_seqpar.settings import input_layout

__all__ = ["PREFILL_MODES", "PrefillMode", "Prefilled", "causal_wrapper", "prefill", "register_prefill_mode"]


@dataclass(frozen=True)
class Prefilled:
    """``logits [B, V]`` (float32) of the last prompt token, identical on every SP rank, and this rank's cache."""

    logits: torch.Tensor
    cache: ShardedCache


@dataclass(frozen=True)
class PrefillMode:
    """How the prompt's forward runs: ``forward(wrapper, batch, ctx) -> hidden [B, n, E]`` of this rank's rows,
    with ``batch`` = ``shard_batch``'s output and ``ctx.cache`` set (its attention layers store their K/V);
    ``check(wrapper, input_ids [B, S0], position_ids)`` refuses, before any collective, what the mode cannot honour."""

    name: str
    summary: str
    forward: Callable[[Any, dict[str, Any], SeqParContext], torch.Tensor]
    check: Callable[[Any, torch.Tensor, Any], None] = lambda wrapper, ids, position_ids: None


def _exact_forward(wrapper: Any, batch: dict[str, Any], ctx: SeqParContext) -> torch.Tensor:
    return wrapper._hidden(batch["input_ids"], batch["position_ids"], batch["doc_ids"], ctx=ctx)


PREFILL_MODES: dict[str, PrefillMode] = {}


def register_prefill_mode(mode: PrefillMode) -> None:
    """Add (or replace) a prefill mode under ``mode.name``."""
    PREFILL_MODES[mode.name] = mode


register_prefill_mode(PrefillMode("exact", "the training forward of the SP layout, exact", _exact_forward))

_WRAPPERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
WRAPPER_CLASS: list[
    type
] = []  # [SeqParCausalLM], registered by integrations/causal_lm.py (which imports this module)


def causal_wrapper(model: torch.nn.Module, mesh: SeqParMesh | None) -> Any:
    """The ``SeqParCausalLM`` to run ``model`` with: the model itself, the DeepSpeed engine's module, or one made
    (once per model and mesh, kept while the model lives) around a HF causal LM; refuses other wrappers."""
    (SeqParCausalLM,) = WRAPPER_CLASS
    model = getattr(model, "module", model) if not isinstance(model, SeqParCausalLM) else model
    if isinstance(model, SeqParCausalLM):
        if model.objective != "causal" or model.encoder_states:
            raise UnsupportedModelError(
                f"{type(model).__name__} is not a causal LM wrapper; prefill and generation take SeqParCausalLM"
            )
        if mesh is not None and mesh is not model.mesh:
            raise ValueError(
                "prefill/generate: mesh= differs from the wrapper's own mesh; pass one or the other"
            )
        return model
    if mesh is None:
        raise ValueError(
            f"prefill/generate of a {type(model).__name__} needs mesh=... (a SeqParMesh), or pass a SeqParCausalLM"
        )
    known = _WRAPPERS.get(model)
    if known is None or known.mesh is not mesh:
        known = SeqParCausalLM(model, mesh)
        _WRAPPERS[model] = known
    return known


def refuse_undecodable(wrapper: Any, packed: bool = False) -> None:
    """Families whose decoding from a sharded cache would not be exact, refused by name before any collective
    (``packed``: prompts given with position ids restarting per document)."""
    hf = unwrap_hf_model(wrapper.model)
    name = type(hf).__name__
    if wrapper._parts.positions is not None:
        raise UnsupportedModelError(
            f"{name} derives its position ids from the token ids ({wrapper._parts.positions[0].summary}); "
            "decoding from a sharded cache takes position ids that continue the prompt's: generate with the plain model"
        )
    from ds_seqpar.integrations.decode_rules import refuse_undecodable_family
    from ds_seqpar.integrations.recurrent_state import refuse_packed_recurrent, refuse_undecodable_layers

    refuse_undecodable_family(hf)
    refuse_undecodable_layers(hf)
    if packed:
        refuse_packed_recurrent(hf)


def _check_prompt(ids: torch.Tensor, wrapper: Any, position_ids: Any) -> torch.Tensor:
    """``ids`` as int64 ``[B, S0]`` on the model's device; shapes checked locally (no collective)."""
    ids = torch.as_tensor(ids)
    if ids.dim() != 2 or ids.shape[1] < 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"prefill takes input_ids [B, S] of integer token ids with S >= 1, the same on every SP rank; got "
            f"{tuple(ids.shape)} {ids.dtype}"
        )
    if position_ids is not None and tuple(torch.as_tensor(position_ids).shape) != tuple(ids.shape):
        raise ValueError(
            f"prefill: position_ids {tuple(torch.as_tensor(position_ids).shape)} must match input_ids "
            f"{tuple(ids.shape)} (packed prompts: positions restarting at 0 per document)"
        )
    return ids.long().to(model_device(wrapper))


def model_device(wrapper: Any) -> torch.device:
    """The device of the wrapped model's parameters (ZeRO-3 partitions included)."""
    return next(iter(wrapper.model.parameters())).device


def _same_prompt(ids: torch.Tensor, mesh: SeqParMesh) -> None:
    """One all-reduce: every SP rank must hold the same token ids (a silently different prompt per rank would
    give a cache of several prompts)."""
    if mesh.sp_size == 1:
        return
    mix = torch.arange(1, ids.numel() + 1, dtype=torch.float64, device=ids.device).reshape(ids.shape)
    sig = torch.stack([(ids.double() * mix).sum(), (ids.double() ** 2).sum()])
    both = torch.stack([sig, -sig])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=mesh.group("sp"))
    if not torch.equal(both[0], -both[1]):
        raise ValueError(
            "prefill: the SP ranks hold different prompts (input_ids differ); every rank of an SP group must pass "
            "the same input_ids"
        )


def prefill(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    mesh: SeqParMesh | None = None,
    position_ids: torch.Tensor | None = None,
    mode: str | None = None,
    reserve: int = 0,
) -> Prefilled:
    """The prompt's forward over the SP group; returns its last logits and this rank's cache.

    Args:
        model: a ``SeqParCausalLM`` (or the DeepSpeed engine around one), or a HF causal LM with ``mesh``; its
            attention is switched to ``"ds_seqpar"`` (``disable_sequence_parallel`` restores it).
        input_ids: ``[B, S0]``, the same on every SP rank (checked).
        position_ids: None, or ``[B, S0]`` restarting at 0 per document: packed prompts (each document sees only
            itself; decoding continues each row's last document).
        mode: a name of ``PREFILL_MODES``; None: ``sequence_parallel.inference.prefill`` (default ``"exact"``).
        reserve: cache slots each layer allocates up front for decoded tokens (the cache grows otherwise).
    """
    wrapper = causal_wrapper(model, mesh)
    mesh = wrapper.mesh
    if mode is None:
        mode = "exact" if mesh.settings.inference is None else mesh.settings.inference.prefill
    if mode not in PREFILL_MODES:
        raise ValueError(
            f"prefill mode={mode!r} is not one of {sorted(PREFILL_MODES)} (register_prefill_mode)"
        )
    chosen = PREFILL_MODES[mode]
    refuse_undecodable(wrapper, packed=position_ids is not None)
    ids = _check_prompt(input_ids, wrapper, position_ids)
    chosen.check(wrapper, ids, position_ids)
    b, s0 = ids.shape
    batch = shard_batch({"input_ids": ids, "position_ids": position_ids}, mesh, layout=input_layout(mesh))
    batch["prompt_ids"] = ids  # the whole prompt, for modes that need more than the shard (APB's anchor)
    layout = input_layout(mesh).for_batch(batch["doc_ids"])
    if layout.world != mesh.sp_size or layout.group_degree is not None:
        raise UnsupportedModelError(
            "prefill: this batch runs in groups of ranks (sequence_parallel.dynamic_degree); decoding merges over the "
            "whole SP group: switch dynamic_degree off to generate"
        )
    # the first collectives: the ranks' shapes, then their token ids
    check_same_inputs(mesh, "prefill", ("input_ids",), (ids,), fix="give every SP rank the same prompt")
    _same_prompt(ids, mesh)
    order = layout.local_positions(batch["seq_len"], mesh.coords.sp_rank)
    packed = position_ids is not None
    docs = batch["doc_ids"].expand(b, -1) if packed else None
    next_pos = torch.as_tensor(position_ids)[:, -1].long() + 1 if packed else torch.full((b,), s0)
    next_pos = next_pos.to(ids.device)
    cache = ShardedCache(
        mesh, s0, order, order < s0, docs, None if docs is None else docs[:, s0 - 1], next_pos, reserve
    )
    ctx = wrapper._context(batch["doc_ids"])
    ctx.cache = cache
    with torch.no_grad():
        hidden = chosen.forward(wrapper, batch, ctx)
        last = hidden.new_zeros(b, hidden.shape[-1])
        at = torch.nonzero(order == s0 - 1).flatten()
        if at.numel():
            last = hidden[:, int(at[0])]
        last = last.contiguous()
        sp_reducer(mesh).sum_(last)
        logits = wrapper._parts.logits(last[:, None])[:, 0].float()
    return Prefilled(logits, cache)
