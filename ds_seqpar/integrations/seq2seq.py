"""Encoder-decoder models (Whisper, ...) under sequence parallelism: the decoder's cross-attention over
sharded encoder states.

Legend: B = batch, n = this rank's decoder tokens, S_kv = encoder positions (frames, patches), m = S_kv / P
this rank's encoder shard, E = hidden size, P = U·R SP degree.

The decoder runs as in ``SeqParCausalLM``: its tokens are sharded by ``shard_batch`` (causal
self-attention over the group, the next-token loss of the group). Its cross-attention layers attend to
the encoder states, which are sharded too, contiguously: rank r holds positions ``[r·m, (r+1)·m)``.
Every call of an attention module that the model makes with encoder states (a ``key_value_states`` /
``cross_attention_states`` input) goes to ``ds_seqpar.cross_attention``, which rotates the smaller side
round the ring (the queries, LV-XAttn, when S_q·H < S_kv·H_kv; else K/V), after a Ulysses exchange of
heads when U > 1. Bytes per layer: ``ds_seqpar.parallel.cross.cross_bytes`` (+ ``cross_ulysses_bytes``).

Shared K/V input (docs/cross_attention.md): every cross-attention layer projects the SAME encoder shard to its
K/V. With ``recompute_cross_kv`` (default) each cross-attention module runs under non-reentrant
activation checkpointing: autograd keeps the encoder shard once (every layer refers to the same tensor)
and each layer's query input, instead of each layer's K/V projections ``2·B·m·E`` and attention
residuals; backward recomputes the projections and the layer's cross-attention (one more forward
exchange of the rotating side per layer). ``benchmarks/bench_cross_memory.py`` measures it.

Where the encoder runs: ``input_features`` (the full input of the model's encoder) runs the encoder on
every rank and keeps this rank's shard of its output (the encoder's own cost is replicated, its
gradients are this rank's part, summed over the group like every other gradient); or
``encoder_hidden_states`` is this rank's shard, computed by the caller (a frozen or separately
parallelised encoder).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ds_seqpar.integrations.causal_lm import SeqParCausalLM
from ds_seqpar.integrations.context import ACTIVE_CONTEXT, SeqParContext, current_context
from ds_seqpar.integrations.hf_model import UnsupportedModelError
from ds_seqpar.integrations.logprobs import TokenLogprobs
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.parallel.cross import CROSS_SCHEDULES

CROSS_INPUTS = ("key_value_states", "cross_attention_states")  # how HF attention modules take encoder states


def shard_encoder_states(
    states: torch.Tensor, mesh: SeqParMesh, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's contiguous part of encoder states ``[B, S_kv, E]`` -> ``([B, m, E], key mask [B, m] | None)``.

    S_kv is padded up to a multiple of P; the padding (and ``mask == 0`` positions, ``mask [B, S_kv]``)
    is masked out of the cross-attention. The key mask is returned on every rank or on none (the ranks
    must agree: the ring and the Ulysses exchange move it). No communication.
    """
    if states.dim() != 3:
        raise ValueError(f"encoder states must be [B, S_kv, E]; got shape {tuple(states.shape)}")
    b, s_kv = states.shape[:2]
    if mask is not None and tuple(mask.shape) != (b, s_kv):
        raise ValueError(f"encoder_attention_mask {tuple(mask.shape)} must be [B, S_kv] = {(b, s_kv)}")
    p, r = mesh.sp_size, mesh.coords.sp_rank
    m = -(-s_kv // p)
    keep = torch.ones(b, s_kv, dtype=torch.bool, device=states.device) if mask is None else mask.bool()
    if m * p != s_kv:
        states = torch.nn.functional.pad(states, (0, 0, 0, m * p - s_kv))
        keep = torch.nn.functional.pad(keep, (0, m * p - s_kv), value=False)
    keep = keep[:, r * m : (r + 1) * m]
    padded = mask is not None or m * p != s_kv  # the same on every rank: all of them pass a mask or none
    return states[:, r * m : (r + 1) * m], keep if padded else None


def _cross_input_index(module: torch.nn.Module) -> tuple[str, int] | None:
    """The name and positional index of the encoder-states parameter of ``module.forward``, if any."""
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return None
    for name in CROSS_INPUTS:
        if name in params:
            return name, params.index(name)
    return None


class _CrossRoute:
    """Wraps one attention module's forward: a call with encoder states marks the module as a
    cross-attention in the context (so the ``"ds_seqpar"`` attention sends it to ``cross_attention``),
    under activation checkpointing when ``recompute`` and autograd is recording."""

    def __init__(self, module: torch.nn.Module, name: str, index: int, recompute: bool) -> None:
        self.module, self.name, self.index, self.recompute = module, name, index, recompute
        self.original = module.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        states = kwargs.get(self.name, args[self.index] if len(args) > self.index else None)
        ctx = current_context(kwargs)
        if states is None or ctx is None:
            return self.original(*args, **kwargs)
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._run, ctx, *args, use_reentrant=False, **kwargs)
        return self._run(ctx, *args, **kwargs)

    def _run(self, ctx: SeqParContext, *args: Any, **kwargs: Any) -> Any:
        ctx.cross_active.add(id(self.module))
        try:
            return self.original(*args, **kwargs)
        finally:
            ctx.cross_active.discard(id(self.module))


class SeqParSeq2SeqLM(SeqParCausalLM):
    """The decoder of an encoder-decoder LM under sequence parallelism, cross-attending to sharded
    encoder states (see the module docstring).

    ``forward(input_ids, shift_labels, position_ids, doc_ids=None, *, input_features=None,
    encoder_hidden_states=None, encoder_attention_mask=None)``: the decoder batch from ``shard_batch``,
    and EITHER ``input_features`` (the full encoder input, every rank the same) with an optional full
    ``encoder_attention_mask [B, S_kv]`` of the encoder's output, OR ``encoder_hidden_states``, this
    rank's shard ``[B, m, E]`` (:func:`shard_encoder_states`) with its optional mask ``[B, m]`` (given on
    every rank of the group or on none: the exchanges move it). Returns
    the SP group's token-weighted next-token loss of the decoder.

    Args:
        model: a HuggingFace encoder-decoder LM (``WhisperForConditionalGeneration``, ...) whose decoder's
            attention dispatches through transformers' attention interface.
        mesh: the SP mesh (U > 1: the cross-attention exchanges heads inside each ring rank first).
        cross_schedule: ``auto`` | ``rotate_q`` | ``rotate_kv`` (``ds_seqpar.cross_attention``).
        recompute_cross_kv: do not keep each cross-attention layer's K/V for backward (see above).
        grad_scale, loss_chunk_size: as ``SeqParCausalLM``.
    """

    encoder_states = True

    def __init__(
        self,
        model: torch.nn.Module,
        mesh: SeqParMesh,
        grad_scale: float = 1.0,
        loss_chunk_size: int = 1024,
        cross_schedule: str = "auto",
        recompute_cross_kv: bool = True,
    ) -> None:
        if cross_schedule not in CROSS_SCHEDULES:
            raise ValueError(f"cross_schedule={cross_schedule!r}; valid: {', '.join(CROSS_SCHEDULES)}")
        if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            raise UnsupportedModelError(
                f"{type(model).__name__} is not an encoder-decoder model (config.is_encoder_decoder is not true); "
                "use ds_seqpar.SeqParCausalLM for a decoder-only LM"
            )
        super().__init__(model, mesh, grad_scale=grad_scale, loss_chunk_size=loss_chunk_size)
        self.cross_schedule = cross_schedule
        self.encoder = self._parts.hf.get_encoder()
        routes = []
        for module in self._parts.decoder.modules():
            found = _cross_input_index(module)
            if found is not None:
                route = _CrossRoute(module, *found, recompute_cross_kv)
                module.forward = route
                routes.append(route)
        if not routes:
            raise UnsupportedModelError(
                f"{type(model).__name__}: no module of its decoder takes encoder states ({' / '.join(CROSS_INPUTS)}); "
                "ds_seqpar cannot find its cross-attention"
            )
        self._routes = tuple(routes)

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        shift_labels: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        *,
        input_features: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        **extra: Any,
    ) -> torch.Tensor:
        hidden = self._decoder_hidden(input_ids, position_ids, doc_ids, input_features, encoder_hidden_states,
                                      encoder_attention_mask, extra)  # fmt: skip
        return self._token_loss(hidden, shift_labels)

    def token_logprobs(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        shift_labels: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        *,
        input_features: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        gather: bool = False,
        entropy: bool = False,
        temperature: float = 1.0,
        chunk_size: int | None = None,
        stats: tuple[str, ...] = (),
        **extra: Any,
    ) -> TokenLogprobs:
        """The decoder's per-token log-probs (see ``SeqParCausalLM.token_logprobs``), with the same encoder inputs
        as ``forward``."""
        hidden = self._decoder_hidden(input_ids, position_ids, doc_ids, input_features, encoder_hidden_states,
                                      encoder_attention_mask, extra)  # fmt: skip
        return self._token_logprobs(
            hidden, shift_labels, doc_ids, gather, entropy, temperature, chunk_size, stats
        )

    @torch.no_grad()
    def evaluate(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        shift_labels: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        *,
        input_features: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        **extra: Any,
    ) -> dict[str, torch.Tensor]:
        """Loss and next-token accuracy of the decoder over the SP group (see ``SeqParCausalLM.evaluate``),
        with the same encoder inputs as ``forward``."""
        hidden = self._decoder_hidden(input_ids, position_ids, doc_ids, input_features, encoder_hidden_states,
                                      encoder_attention_mask, extra)  # fmt: skip
        return self._token_accuracy(hidden, shift_labels)

    def _decoder_hidden(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor | None,
        features: torch.Tensor | None,
        states: torch.Tensor | None,
        mask: torch.Tensor | None,
        extra: dict[str, Any],
    ) -> torch.Tensor:
        """The decoder's final hidden states ``[B, n, E]``, cross-attending to this rank's encoder shard."""
        self._refuse_masks(extra)
        states, mask = self._encoder_shard(features, states, mask)
        ctx = self._context(doc_ids)
        ctx.cross_mask, ctx.cross_schedule = mask, self.cross_schedule
        hidden = self._hidden(input_ids, position_ids, doc_ids, ctx, encoder_hidden_states=states)
        if ctx.cross_calls == 0:
            raise UnsupportedModelError(
                f"{type(self._parts.hf).__name__}: the decoder made no cross-attention call through the ds_seqpar "
                "attention; its cross-attention does not dispatch through transformers' attention interface"
            )
        return hidden

    def _local_attention(self) -> str:
        """The implementation the replicated encoder runs with: the model's original one when transformers
        registers it by name, else ``sdpa`` (the same attention; ``eager`` is per-family code)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        original = getattr(self._parts.hf, "_ds_seqpar_original_attn", None)
        return original if original in ALL_ATTENTION_FUNCTIONS else "sdpa"

    def _encoder_shard(
        self, features: torch.Tensor | None, states: torch.Tensor | None, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if (features is None) == (states is None):
            raise ValueError(
                "SeqParSeq2SeqLM takes exactly one of input_features (the full encoder input) and "
                "encoder_hidden_states (this rank's shard [B, m, E], see shard_encoder_states)"
            )
        if features is not None:
            local = SeqParContext(self.mesh, local_attention=self._local_attention())
            token = ACTIVE_CONTEXT.set(local)
            try:
                full = self.encoder(features).last_hidden_state
            finally:
                ACTIVE_CONTEXT.reset(token)
            return shard_encoder_states(full, self.mesh, mask)
        if states.dim() != 3:
            raise ValueError(
                f"encoder_hidden_states must be this rank's shard [B, m, E]; got {tuple(states.shape)}"
            )
        if mask is not None and tuple(mask.shape) != tuple(states.shape[:2]):
            raise ValueError(
                f"encoder_attention_mask {tuple(mask.shape)} must be [B, m] = {tuple(states.shape[:2])}"
            )
        return states, None if mask is None else mask.bool()
