"""The model wrappers of sequence parallelism: ``SeqParCausalLM`` (a causal LM: sharded batch in, SP-group
loss out) and ``SeqParMaskedLM`` (a bidirectional masked-LM encoder); ``seq2seq.py`` adds the
encoder-decoder. Each routes the model's sequence mixing (``routing.py``), makes the forward's context
(``context.py``), applies the memory savings, and refuses inputs it cannot honour before any collective.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from ds_seqpar.data import check_objective
from ds_seqpar.integrations.attention_layers import (
    refuse_unrouted_alibi,
    route_attention_layers,
    unroute_attention_layers,
)
from ds_seqpar.integrations.context import ACTIVE_CONTEXT, CONTEXT_KEY, SeqParContext
from ds_seqpar.integrations.generation import generate
from ds_seqpar.integrations.hf_attention import FEED_FORWARD_LAYER_TYPES
from ds_seqpar.integrations.hf_model import (
    PROBE_ATTENTION,
    ModelLogits,
    UnsupportedModelError,
    check_token_locality,
    decoder_of,
    expected_chunk,
    expected_window,
    refuse_unhonoured_features,
    unwrap_hf_model,
)
from ds_seqpar.integrations.inline_adapters import refuse_unroutable_layers
from ds_seqpar.integrations.logprobs import TokenLogprobs, sharded_logprobs
from ds_seqpar.integrations.positions import PositionFn, PositionRule, model_position_ids, position_rule_of
from ds_seqpar.integrations.prefill import WRAPPER_CLASS
from ds_seqpar.integrations.recurrent_layers import has_recurrent_layers, refuse_recurrent_layers
from ds_seqpar.integrations.routing import enable_sequence_parallel
from ds_seqpar.loss import sp_causal_lm_loss
from ds_seqpar.memory import enable_memory_savings
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.parallel.work import WorkCounter
from ds_seqpar.settings import input_layout

__all__ = ["SHARD_EXTRAS", "SeqParCausalLM", "SeqParMaskedLM"]

SHARD_EXTRAS = ("seq_len",)  # what shard_batch adds besides the model inputs


@dataclass(frozen=True)
class _ModelParts:
    """The HF model inside a (PEFT) wrapper, its decoder, its logits, which decoder layer each
    submodule belongs to (``layer_of``, over ``num_layers`` layers), the sliding window and attention chunk
    its config promises (``window``, ``chunk``) and its position rule (``positions``, ``positions.py``); kept
    out of the module tree."""

    hf: torch.nn.Module
    decoder: torch.nn.Module
    logits: ModelLogits
    layer_of: dict[int, int]
    num_layers: int | None
    window: int | None
    chunk: int | None
    positions: tuple[PositionRule, PositionFn] | None


def _decoder_layers(
    decoder: torch.nn.Module, hf: torch.nn.Module
) -> tuple[dict[int, int], int | None, list[torch.nn.Module]]:
    """``{id(submodule): layer index}`` over the decoder's layer list (the ModuleList with one entry per
    ``num_hidden_layers``), the layer count, and the layers; an empty map and list when no such list exists."""
    config = getattr(decoder, "config", hf.config)
    expected = getattr(config, "num_hidden_layers", None)
    if getattr(config, "is_encoder_decoder", False):  # Whisper, BART: num_hidden_layers is the encoder's
        expected = getattr(config, "decoder_layers", expected)
    for module in decoder.modules():
        if isinstance(module, torch.nn.ModuleList) and expected is not None and len(module) == expected:
            layers = list(module)
            return {id(m): i for i, layer in enumerate(layers) for m in layer.modules()}, expected, layers
    return {}, expected, []


class SeqParCausalLM(torch.nn.Module):
    """A causal LM under sequence parallelism: sharded batch in, SP-group loss out.

    ``forward(input_ids, shift_labels, position_ids, doc_ids=None, **extra)`` takes the output of
    ``ds_seqpar.data.shard_batch`` (position_ids must be the global positions of the shard; a 4-D
    ``attention_mask`` in ``extra`` is refused) and returns the token-weighted loss of the SP group (see
    ``ds_seqpar.loss``); logits are computed in chunks and never materialised for the whole shard.

    ``step`` (set by the training loop; ``train.py`` and ``SeqParTrainer`` do) is the optimizer step
    that ``sequence_parallel.sparse.dense_warmup_steps`` counts.

    Logits are the model's own (``integrations/hf_model.ModelLogits``): its forward after the decoder
    runs on each chunk of hidden states, so final norms, soft-caps and logit scales apply exactly.

    Args:
        model: a HuggingFace ``*ForCausalLM`` (its attention is switched to ``"ds_seqpar"``), a PEFT
            wrapper of one, or a composite model whose language model sits under ``text_config``
            (text-only batches; its vision tower is not called).
        mesh: the SP mesh.
        grad_scale: see ``ds_seqpar.loss.sp_grad_scale``.
        loss_chunk_size: tokens per logits chunk.
    """

    objective = "causal"  # SeqParMaskedLM: "masked"
    encoder_states = False  # SeqParSeq2SeqLM: the decoder attends to encoder states
    whole_inputs: tuple[str, ...] = ()  # batch keys shard_batch passes on unsharded (SeqParVisionLM: vision)

    def __init__(
        self, model: torch.nn.Module, mesh: SeqParMesh, grad_scale: float = 1.0, loss_chunk_size: int = 1024
    ) -> None:
        super().__init__()
        check_objective(self.objective)
        hf = unwrap_hf_model(model)
        decoder = decoder_of(hf)
        refuse_unhonoured_features(hf)
        refuse_recurrent_layers(hf)
        refuse_unrouted_alibi(hf)
        refuse_unroutable_layers(hf)
        if getattr(hf, "_ds_seqpar_original_attn", None) is None and not has_recurrent_layers(hf):
            # one process, before the attention is switched; on the routed attention layers (ALiBi families)
            route_attention_layers(hf, PROBE_ATTENTION)
            try:
                check_token_locality(hf, decoder, self.objective, encoder_states=self.encoder_states)
            finally:
                unroute_attention_layers(hf)
        self.model = enable_sequence_parallel(model)
        layer_of, num_layers, layers = _decoder_layers(decoder, hf)
        self._parts = _ModelParts(
            hf,
            decoder,
            ModelLogits(hf, decoder),
            layer_of,
            num_layers,
            expected_window(hf),
            expected_chunk(hf),
            position_rule_of(decoder),
        )
        self.mesh = mesh
        self.memory = enable_memory_savings(hf, decoder, layers, mesh.settings.memory, mesh.group("sp_dp"))
        self.grad_scale = grad_scale
        self.loss_chunk_size = loss_chunk_size
        self.last_num_tokens: torch.Tensor | None = None
        self.work = WorkCounter()
        self.step = 0  # training step, for sparse.dense_warmup_steps; the training loop sets it

    @property
    def config(self) -> Any:
        return self._parts.hf.config

    def generate(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        """``ds_seqpar.generate`` with this wrapper: sharded prefill, then decoding from the sharded cache
        (docs/inference.md)."""
        return generate(self, input_ids, **kwargs)

    def _hidden(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor | None,
        ctx: SeqParContext | None = None,
        **decoder_inputs: Any,
    ) -> torch.Tensor:
        """Final hidden states ``[B, n, E]`` of this rank's tokens (every layer's attention over the group).
        ``ctx``: a context made by a subclass (``_context``); ``decoder_inputs``: more inputs of the decoder."""
        self._check_positions(input_ids, position_ids, doc_ids)
        position_ids = self._model_positions(input_ids, position_ids, doc_ids)
        parts = self._parts
        if self.memory.plan is not None:
            zero3 = any(hasattr(p, "ds_id") for p in itertools.islice(parts.decoder.parameters(), 1))
            self.memory.plan.plan(input_ids.shape[-1], input_ids.device, agree=zero3)
        return self._run_decoder(input_ids, position_ids, ctx or self._context(doc_ids), **decoder_inputs)

    def _run_decoder(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx: SeqParContext, **decoder_inputs: Any
    ) -> torch.Tensor:
        """The decoder on ``input_ids [B, n]`` at ``position_ids`` with ``ctx`` -> final hidden states ``[B, n, E]``;
        every layer's call is checked after (``_check_calls``)."""
        token = ACTIVE_CONTEXT.set(ctx)
        try:
            hidden = self._parts.decoder(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=False,
                **decoder_inputs,
                **{CONTEXT_KEY: ctx},
            )
        finally:
            ACTIVE_CONTEXT.reset(token)
        hidden = hidden.last_hidden_state if hasattr(hidden, "last_hidden_state") else hidden[0]
        self._check_calls(ctx)
        return hidden

    def _context(self, doc_ids: torch.Tensor | None) -> SeqParContext:
        return SeqParContext(self.mesh, doc_ids, self.work, self.step, layer_of=self._parts.layer_of)

    def _check_calls(self, ctx: SeqParContext) -> None:
        """Every decoder layer must have split its sequence mixing over the group, and a window the
        config promises must have reached the attention; raised identically on every rank."""
        hf, expected = self._parts.hf, self._parts.num_layers
        missing: list[int] = []
        if self._parts.layer_of:
            # a layer the config declares feed-forward only (Nemotron-H's "mlp" / "moe") mixes no tokens
            types = getattr(getattr(self._parts.decoder, "config", hf.config), "layer_types", None) or ()
            idle = {i for i, kind in enumerate(types) if kind in FEED_FORWARD_LAYER_TYPES}
            missing = sorted(set(range(expected)) - ctx.layers - idle)
        elif ctx.calls == 0 or (expected is not None and ctx.calls < expected):
            missing = [-1]
        if missing:
            where = "" if missing == [-1] else f" (layers {missing[:8]} made no call)"
            raise UnsupportedModelError(
                f"{type(hf).__name__} (original attn_implementation="
                f"{getattr(hf, '_ds_seqpar_original_attn', None)!r}) called the ds_seqpar attention "
                f"{ctx.calls} times for {expected} layers{where}: some attention does not dispatch through "
                "transformers' attention interface, so it cannot be split over the sequence"
            )
        if self.objective == "causal" and ctx.bidirectional:
            raise UnsupportedModelError(
                f"{type(hf).__name__}: {ctx.bidirectional} of {ctx.calls} attention calls are bidirectional (is_causal="
                "False): it is an encoder, not a causal LM; train it with ds_seqpar.SeqParMaskedLM (train.py "
                "--objective mlm), which also masks the padding that a bidirectional attention would see"
            )
        window = self._parts.window
        if window is not None and ctx.windows == 0:
            raise UnsupportedModelError(
                f"{type(hf).__name__}: config.sliding_window={window} but no attention layer passed a sliding window "
                "to the attention (the family builds the window into a mask, which ds_seqpar does not receive); "
                "this model cannot run under ds_seqpar"
            )
        chunk = self._parts.chunk
        if chunk is not None and ctx.chunks == 0:
            raise UnsupportedModelError(
                f"{type(hf).__name__}: config.attention_chunk_size={chunk} but no attention layer applied a chunk "
                "(its layers do not expose config.layer_types / layer_idx, which ds_seqpar reads the chunk from); "
                "this model cannot run under ds_seqpar"
            )

    def _check_positions(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, doc_ids: torch.Tensor | None
    ) -> None:
        """RoPE needs the GLOBAL position of every local token; refuse anything else before any collective."""
        if position_ids is None:
            raise ValueError(
                "position_ids is missing: under sequence parallelism each rank holds a slice of the sequence, so "
                "RoPE needs the global positions of its tokens; pass the batch from ds_seqpar.shard_batch"
            )
        if tuple(position_ids.shape[-1:]) != tuple(input_ids.shape[-1:]):
            raise ValueError(
                f"position_ids has shape {tuple(position_ids.shape)} but input_ids {tuple(input_ids.shape)}: "
                "give one position per local token (ds_seqpar.shard_batch does)"
            )
        if doc_ids is not None or self.mesh.sp_size == 1:
            return  # packed documents restart their positions; one rank holds everything
        layout = input_layout(self.mesh)
        n = input_ids.shape[-1]
        expected = layout.local_positions(n * self.mesh.sp_size, self.mesh.coords.sp_rank).to(
            position_ids.device
        )
        got = (position_ids if position_ids.dim() == 1 else position_ids[0]).long()
        if not torch.equal(got, expected):
            raise ValueError(
                f"position_ids of SP rank {self.mesh.coords.sp_rank} are not the global positions of its tokens: got "
                f"{got[:4].tolist()}..., expected {expected[:4].tolist()}... (layout {layout.ring.name}); local "
                "positions 0..n-1 would give every rank the same RoPE. Pass the batch from ds_seqpar.shard_batch"
            )

    def _model_positions(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """The position ids ``[B, n]`` the decoder gets: the global ones, or, for a family with a position rule
        (``positions.py``), the family's own position ids of the whole rows, this rank's part (one all-gather
        of the token ids). Packed documents and grouped layouts are refused first, identically on every rank."""
        found = self._parts.positions
        if found is None:
            return position_ids
        rule, fn = found
        name = type(self._parts.hf).__name__
        if doc_ids is not None and int(doc_ids.max()) > 0:
            raise UnsupportedModelError(
                f"{name} derives its position ids from the token ids ({rule.summary}); with packed documents "
                "(position_ids restarting) the plain model would take the given position_ids as they are, so no "
                "numbering is exact for both: train it on one document per row (padding through attention_mask)"
            )
        if self.mesh.sp_size == 1:
            return fn(input_ids.long())
        layout = input_layout(self.mesh, doc_ids)
        if layout.group_degree is not None or layout.world != self.mesh.sp_size:
            raise UnsupportedModelError(
                f"{name} derives its position ids from the whole row ({rule.summary}), which ds_seqpar gathers over "
                f"the SP group; the batch's layout runs in groups of {layout.group_degree} ranks "
                "(sequence_parallel.dynamic_degree): switch dynamic_degree off for this model"
            )
        return model_position_ids(fn, input_ids, self.mesh.coords.sp_rank, layout, self.mesh.group("sp"))

    def _refuse_masks(self, extra: dict[str, Any]) -> None:
        """Only what ``shard_batch`` produces; any other input the model would use is refused by name."""
        mask = extra.get("attention_mask")
        if mask is not None:
            raise ValueError(
                f"attention_mask of shape {tuple(torch.as_tensor(mask).shape)} cannot be honoured under sequence "
                "parallelism (no rank holds the whole [S, S] mask): give padding as a 2-D attention_mask to "
                "ds_seqpar.shard_batch, and packed documents as position_ids that restart per document"
            )
        unknown = sorted(k for k, v in extra.items() if v is not None and k not in SHARD_EXTRAS)
        if unknown:
            labels = "shift_labels" if self.objective == "causal" else "labels"
            raise ValueError(
                f"{type(self).__name__} got inputs {unknown} that it would not pass to the model; it trains on token "
                f"ids only (input_ids, {labels}, position_ids, doc_ids from ds_seqpar.shard_batch"
                f"{'' if self.objective == 'causal' else '(objective=masked)'}): images, token types or embeddings "
                "cannot be split over the sequence"
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        shift_labels: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        **extra: Any,
    ) -> torch.Tensor:
        return self._loss(input_ids, shift_labels, position_ids, doc_ids, extra)

    def _loss(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor | None,
        extra: dict[str, Any],
    ) -> torch.Tensor:
        """The SP group's token-weighted loss of ``targets [B, n]`` (-100 = no label) at this rank's tokens."""
        self._refuse_masks(extra)
        return self._token_loss(self._hidden(input_ids, position_ids, doc_ids), targets)

    def _token_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The SP group's token-weighted loss of final hidden states ``[B, n, E]`` against ``targets [B, n]``."""
        loss, num_tokens = sp_causal_lm_loss(
            hidden,
            targets,
            self._parts.logits,
            self.mesh.group("sp"),
            grad_scale=self.grad_scale,
            chunk_size=self.loss_chunk_size,
        )
        self.last_num_tokens = num_tokens
        return loss

    def token_logprobs(
        self,
        input_ids: torch.Tensor,
        shift_labels: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        *,
        gather: bool = False,
        entropy: bool = False,
        temperature: float = 1.0,
        chunk_size: int | None = None,
        stats: tuple[str, ...] = (),
        **extra: Any,
    ) -> TokenLogprobs:
        """Log p(label) of every labelled token (and entropies), this rank's ``[B, n]`` or, ``gather=True``, the
        whole ``[B, S]``; see ``ds_seqpar.integrations.logprobs`` (``ds_seqpar.token_logprobs``)."""
        self._refuse_masks(extra)
        hidden = self._hidden(input_ids, position_ids, doc_ids)
        return self._token_logprobs(
            hidden, shift_labels, doc_ids, gather, entropy, temperature, chunk_size, stats
        )

    def _token_logprobs(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        doc_ids: torch.Tensor | None,
        gather: bool,
        entropy: bool,
        temperature: float,
        chunk_size: int | None,
        stats: tuple[str, ...] = (),
    ) -> TokenLogprobs:
        """Log-probs of ``targets [B, n]`` from final hidden states ``[B, n, E]`` (``gather``: over the group)."""
        return sharded_logprobs(
            hidden,
            targets,
            self._parts.logits,
            self.mesh,
            doc_ids,
            gather=gather,
            entropy=entropy,
            temperature=temperature,
            chunk_size=chunk_size or self.loss_chunk_size,
            grad_scale=self.grad_scale,
            stats=stats,
        )

    @torch.no_grad()
    def evaluate(
        self,
        input_ids: torch.Tensor,
        shift_labels: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        **extra: Any,
    ) -> dict[str, torch.Tensor]:
        """Loss and next-token accuracy over the labelled tokens of the whole SP group.

        Logits are computed only at labelled positions. Returns tensors ``loss``, ``correct`` and
        ``count`` (summed over the SP group; identical on its ranks).
        """
        return self._evaluate(input_ids, shift_labels, position_ids, doc_ids, extra)

    def _evaluate(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor | None,
        extra: dict[str, Any],
    ) -> dict[str, torch.Tensor]:
        self._refuse_masks(extra)
        return self._token_accuracy(self._hidden(input_ids, position_ids, doc_ids), targets)

    def _token_accuracy(self, hidden: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Loss, correct and count over the labelled ``targets [B, n]`` of the SP group, from ``hidden [B, n, E]``.

        The B x n tokens are taken ``loss_chunk_size`` at a time (as the training loss, ``ds_seqpar.loss``);
        logits ``[c, V]`` fp32 are computed for the labelled tokens of one chunk only, so evaluation never
        holds more logits than a training step's forward. Each rank calls the logits
        ``ceil(B x n / loss_chunk_size)`` times (an empty chunk too); under ZeRO-3, which gathers the head's
        parameters in each call, the ranks of the ZeRO group first agree on the largest count (one
        all-reduce of 1 number over ``sp_dp``, as the tiled MLP's tiles). Communicates one all-reduce of
        3 numbers over the SP group.
        """
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # [B n, E]
        flat_targets = targets.reshape(-1)
        totals = torch.zeros(3, dtype=torch.float32, device=hidden.device)
        chunk = max(1, int(self.loss_chunk_size))
        calls = torch.tensor([-(-max(flat_targets.numel(), 1) // chunk)], device=hidden.device)
        zero3 = any(hasattr(p, "ds_id") for p in itertools.islice(self._parts.decoder.parameters(), 1))
        if zero3 and self.mesh.plan.world_size > 1:
            torch.distributed.all_reduce(
                calls, op=torch.distributed.ReduceOp.MAX, group=self.mesh.group("sp_dp")
            )
        for start in range(0, int(calls) * chunk, chunk):
            y = flat_targets[start : start + chunk]
            labelled = y != -100
            y = y[labelled]
            h = flat_hidden[start : start + chunk][labelled]  # [c, E], c labelled tokens of the chunk
            logits = self._parts.logits(h[None])[0].float()  # [c, V]
            if y.numel():
                totals[0] += torch.nn.functional.cross_entropy(logits, y, reduction="sum")
                totals[1] += (logits.argmax(-1) == y).sum()
                totals[2] += y.numel()
        group = self.mesh.group("sp")
        if self.mesh.sp_size > 1:
            torch.distributed.all_reduce(totals, group=group)
        count = totals[2].clamp(min=1.0)
        return {"loss": totals[0] / count, "correct": totals[1], "count": totals[2]}


class SeqParMaskedLM(SeqParCausalLM):
    """A bidirectional encoder with a masked-LM head under sequence parallelism (RingFormer's setting).

    ``forward(input_ids, labels, position_ids, doc_ids=None, **extra)`` takes the output of
    ``ds_seqpar.shard_batch(..., objective="masked")``: ``labels`` are the original ids at the masked
    tokens and -100 elsewhere, NOT shifted; padding (also the layout's) has document id -1, so no real
    token attends to it. The loss is the token-weighted mean over the masked tokens of the whole SP
    group, exactly as for ``SeqParCausalLM`` (``ds_seqpar.loss``); every attention layer runs
    non-causal over the whole group (ring / Ulysses / USP), sliding windows symmetric
    (``|i - j| < window``, ModernBERT's local layers), packed documents separated by ``doc_ids``.

    Args: as ``SeqParCausalLM``; ``model`` is a HuggingFace ``*ForMaskedLM`` (ModernBERT, BERT, ...)
        whose positions come from ``position_ids`` or a position rule (``positions.py``: RoBERTa's padding
        offset, run on the whole row; packed documents are refused for those).
    """

    objective = "masked"

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        **extra: Any,
    ) -> torch.Tensor:
        return self._loss(input_ids, labels, position_ids, doc_ids, extra)

    def token_logprobs(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        *,
        gather: bool = False,
        entropy: bool = False,
        temperature: float = 1.0,
        chunk_size: int | None = None,
        stats: tuple[str, ...] = (),
        **extra: Any,
    ) -> TokenLogprobs:
        """Log p(label) at the masked tokens (and entropies); see ``SeqParCausalLM.token_logprobs``."""
        self._refuse_masks(extra)
        hidden = self._hidden(input_ids, position_ids, doc_ids)
        return self._token_logprobs(hidden, labels, doc_ids, gather, entropy, temperature, chunk_size, stats)

    @torch.no_grad()
    def evaluate(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        **extra: Any,
    ) -> dict[str, torch.Tensor]:
        """Loss and accuracy over the masked tokens of the whole SP group (see ``SeqParCausalLM.evaluate``)."""
        return self._evaluate(input_ids, labels, position_ids, doc_ids, extra)


WRAPPER_CLASS.append(SeqParCausalLM)  # prefill / generate wrap HF models in it (integrations/prefill.py)
