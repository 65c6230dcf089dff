"""Route the attention of unmodified HuggingFace models through ``ds_seqpar.attention``.

transformers 5.x calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key,
value, attention_mask, dropout=..., scaling=..., **kwargs)`` from every attention layer, with query
``[B, H, n, D]``, key/value ``[B, H_kv, n, D]`` (RoPE applied, K/V heads not repeated) and the model's
forward kwargs passed through (``position_ids``, ``sliding_window`` for sliding layers, ...).

``enable_sequence_parallel(model)`` registers one more implementation, ``"ds_seqpar"``, and selects it
with ``model.set_attn_implementation`` for this model only (overriding ``"sdpa"`` process-wide would
change every other model in the process). The model's own code paths stay as they are: RoPE,
sliding-window layers (the ``sliding_window`` kwarg is honoured), GQA, per-layer types. HF builds no
4-D mask for this implementation (``attention_mask`` is None): masks come from global positions and
the ``doc_ids`` of the batch (padding and packed documents), like every ds_seqpar algorithm.

Per-batch state travels explicitly in the forward kwargs as ``ds_seqpar_context=SeqParContext(...)``
(``SeqParCausalLM`` passes it); an attention call without it, with dropout, or with a KV cache
(q_len != k_len, i.e. generation) raises a clear error instead of computing something wrong.
"""

from __future__ import annotations

import contextvars
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from ds_seqpar.data import check_objective
from ds_seqpar.integrations.hf_model import (
    ModelLogits,
    UnsupportedModelError,
    check_token_locality,
    decoder_of,
    expected_window,
    refuse_unhonoured_features,
    unwrap_hf_model,
)
from ds_seqpar.integrations.linear_models import (
    has_routed_layers,
    refuse_recurrent_layers,
    route_linear_layers,
    unroute_linear_layers,
)
from ds_seqpar.loss import sp_causal_lm_loss
from ds_seqpar.memory import enable_memory_savings
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.parallel.cross import cross_attention
from ds_seqpar.parallel.usp import attention, input_layout
from ds_seqpar.parallel.work import WorkCounter

ATTN_IMPLEMENTATION = "ds_seqpar"
CONTEXT_KEY = "ds_seqpar_context"
SHARD_EXTRAS = ("seq_len",)  # what shard_batch adds besides the model inputs
_UNSET: Any = object()  # a keyword the attention layer did not pass


@dataclass
class SeqParContext:
    """What the attention layers of one forward need besides q, k, v, and what they did.

    ``layer_of`` maps ``id(module)`` of every submodule of a decoder layer to that layer's index;
    ``layers`` collects the indices of the layers that called the attention, ``windows`` the calls
    that applied a sliding window.

    Cross-attention (``SeqParSeq2SeqLM``): ``cross_active`` holds the ids of the attention modules
    running on encoder states right now (their calls go to ``ds_seqpar.cross_attention``), with the
    encoder shard's key mask ``cross_mask [B, m]`` (None: no padding) and ``cross_schedule``;
    ``cross_calls`` counts them. ``local_attention``: the name of a transformers attention implementation
    that every call runs instead, unsplit (a replicated encoder's forward over its whole input).
    """

    mesh: SeqParMesh
    doc_ids: torch.Tensor | None = None
    work: WorkCounter | None = None
    step: int = 0
    calls: int = field(default=0)
    layer_of: dict[int, int] = field(default_factory=dict)
    layers: set[int] = field(default_factory=set)
    windows: int = 0
    bidirectional: int = 0
    cross_mask: torch.Tensor | None = None
    cross_schedule: str = "auto"
    cross_active: set[int] = field(default_factory=set)
    cross_calls: int = 0
    local_attention: str | None = None

    def record(self, module: torch.nn.Module, window: int | None = None, causal: bool = True) -> None:
        """Count one sequence-parallel call of ``module`` (attention or linear attention)."""
        self.calls += 1
        self.windows += window is not None
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


# Keywords of transformers' attention interface that ds_seqpar honours (values checked below) and
# keywords that never change the result (positions are already in q/k through RoPE; the cache is
# refused through q_len != k_len; attention weights are not returned).
FEED_FORWARD_LAYER_TYPES = frozenset({"mlp", "moe"})  # config.layer_types entries without sequence mixing
HONOURED_KEYWORDS = ("dropout", "scaling", "sliding_window", "softcap", "s_aux", "is_causal")
NEUTRAL_KEYWORDS = frozenset(
    {
        CONTEXT_KEY,
        "position_ids",
        "cache_position",
        "use_cache",
        "output_attentions",
        "past_key_values",
        "past_key_value",
        "layer_idx",
        "deterministic",
        "return_dict",
    }
)


def _refuse_keywords(name: str, attention_mask: Any, kwargs: dict[str, Any]) -> None:
    """Raise (before any collective) on a keyword whose value would change the attention."""
    if attention_mask is not None:
        shape = (
            tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        )
        raise UnsupportedModelError(
            f"{name} passed attention_mask of shape {shape} to the '{ATTN_IMPLEMENTATION}' attention; ds_seqpar "
            "builds masks from global positions and document ids and cannot honour an explicit mask (no rank "
            "holds the whole [S, S] mask). This model builds its own mask, so it cannot run under ds_seqpar"
        )
    for key, value in kwargs.items():
        if key in NEUTRAL_KEYWORDS or value is None:
            continue
        raise UnsupportedModelError(
            f"{name} passed {key}={_short(value)} to the attention; ds_seqpar honours "
            f"{', '.join(HONOURED_KEYWORDS)} and would ignore {key!r}, which changes the result: this model "
            "cannot run under ds_seqpar (restore its attention with disable_sequence_parallel(model))"
        )


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {value.dtype}>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _sinks(name: str, s_aux: Any, num_heads: int) -> torch.Tensor | None:
    if s_aux is None:
        return None
    if not isinstance(s_aux, torch.Tensor) or s_aux.numel() != num_heads:
        raise UnsupportedModelError(
            f"{name} passed s_aux={_short(s_aux)}; ds_seqpar honours attention sinks as one logit per query "
            f"head ({num_heads} values)"
        )
    return s_aux.reshape(num_heads)


def _window(name: str, sliding_window: Any) -> int | None:
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise UnsupportedModelError(
            f"{name} passed sliding_window={_short(sliding_window)}; ds_seqpar honours an int >= 1 (a query sees "
            "the last `sliding_window` positions, itself included) or None"
        )
    return sliding_window


def seqpar_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: Any = _UNSET,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``"ds_seqpar"`` attention implementation: HF layout in, ``(out [B, n, H, D], None)`` out.

    Honoured keywords: ``scaling``, ``sliding_window`` (query i sees key j iff 0 <= i - j < w),
    ``softcap`` (Gemma 2 attention logit soft-capping), ``s_aux`` (gpt-oss attention sinks: one
    logit per query head in the softmax denominator, gradients included), ``is_causal`` (else the
    module's ``is_causal``), ``dropout`` (only 0). Any other keyword with a non-None value, and a
    non-None ``attention_mask``, raise a ValueError naming the module, keyword and value, before any
    collective; the neutral ones (``position_ids``, cache bookkeeping) are ignored.
    """
    ctx = current_context(kwargs)
    name = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    if not isinstance(ctx, SeqParContext):
        raise RuntimeError(
            f"{name} called the '{ATTN_IMPLEMENTATION}' attention without a ds_seqpar context; run the model "
            "through ds_seqpar.SeqParCausalLM / ds_seqpar.initialize (they pass ds_seqpar_context=...), or "
            "restore the original attention with disable_sequence_parallel(model)"
        )
    if ctx.local_attention is not None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        kwargs.pop(CONTEXT_KEY, None)
        given = {"sliding_window": sliding_window, "softcap": softcap, "s_aux": s_aux, "is_causal": is_causal}
        given = {k: v for k, v in given.items() if v is not None and v is not _UNSET}
        return ALL_ATTENTION_FUNCTIONS[ctx.local_attention](
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **given, **kwargs
        )
    _refuse_keywords(name, attention_mask, kwargs)
    if id(module) in ctx.cross_active:
        return _cross_attention_call(module, name, ctx, query, key, value, dropout, scaling,
                                     sliding_window, softcap, s_aux, is_causal), None  # fmt: skip
    if dropout:
        raise UnsupportedModelError(
            f"{name}: attention dropout={dropout} is not supported under sequence parallelism; "
            "set config.attention_dropout=0.0"
        )
    if query.shape[2] != key.shape[2]:
        raise UnsupportedModelError(
            f"{name}: q_len={query.shape[2]} != k_len={key.shape[2]}: a KV cache is in use, or the layer attends "
            "to keys that are not one per token (compressed or extra keys); sequence-parallel attention needs one "
            "key per query token: pass use_cache=False, and generate with an unwrapped model"
        )
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    if sliding_window is _UNSET:  # not passed: families that keep the window on the module (its mask)
        sliding_window = getattr(module, "sliding_window", None)
        sliding_window = sliding_window if isinstance(sliding_window, int) and sliding_window > 0 else None
    window = _window(name, sliding_window)
    query, key, value, v_dim = _common_head_dim(query, key, value)
    out = attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        mesh=ctx.mesh,
        causal=causal,
        softmax_scale=scaling,
        window=window,
        doc_ids=ctx.doc_ids,
        work=ctx.work,
        layer=getattr(module, "layer_idx", None),
        step=ctx.step,
        softcap=softcap or None,
        sinks=_sinks(name, s_aux, query.shape[1]),
    )
    ctx.record(module, window, causal)
    return (out if v_dim is None else out[..., :v_dim]), None


def _cross_attention_call(
    module: torch.nn.Module,
    name: str,
    ctx: SeqParContext,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
    sliding_window: Any,
    softcap: float | None,
    s_aux: torch.Tensor | None,
    is_causal: bool | None,
) -> torch.Tensor:
    """A cross-attention call (HF layout: query ``[B, H, n_q, D]``, key / value ``[B, H_kv, m, D]`` of this
    rank's encoder shard): ``ds_seqpar.cross_attention`` over the group -> ``[B, n_q, H, D]``. Only the scale
    is honoured; anything else that would change the result is refused by name."""
    given = {"dropout": dropout or None, "sliding_window": None if sliding_window is _UNSET else sliding_window,
             "softcap": softcap or None, "s_aux": s_aux, "is_causal": is_causal or None}  # fmt: skip
    refused = {k: v for k, v in given.items() if v is not None}
    if refused:
        key_name, value_ = next(iter(refused.items()))
        raise UnsupportedModelError(
            f"{name}: cross-attention with {key_name}={_short(value_)}; ds_seqpar's cross-attention is plain "
            "(non-causal, full) softmax attention over the encoder states with a key padding mask: set "
            "config.attention_dropout=0.0, or this model cannot run under ds_seqpar"
        )
    if query.shape[-1] != value.shape[-1]:
        raise UnsupportedModelError(
            f"{name}: cross-attention value head dim {value.shape[-1]} != query head dim {query.shape[-1]}"
        )
    out = cross_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        mesh=ctx.mesh,
        kv_mask=ctx.cross_mask,
        softmax_scale=scaling,
        schedule=ctx.cross_schedule,
    )
    ctx.record(module)
    ctx.cross_calls += 1
    return out


def _common_head_dim(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None]:
    """MLA families (DeepSeek V2/V3, MiniCPM3, ...) have a value head dim != the query/key head dim:
    zero-pad the smaller side (zero value columns give zero output columns, zero q/k columns add 0 to
    every score), exact; returns the value head dim to slice the output back to, or None."""
    d_qk, d_v = query.shape[-1], value.shape[-1]
    if d_qk == d_v:
        return query, key, value, None
    if d_v < d_qk:
        return query, key, torch.nn.functional.pad(value, (0, d_qk - d_v)), d_v
    pad = (0, d_v - d_qk)
    return torch.nn.functional.pad(query, pad), torch.nn.functional.pad(key, pad), value, d_v


def register_attention() -> None:
    """Register the ``"ds_seqpar"`` implementation with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, seqpar_attention_forward)


def enable_sequence_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """Switch ``model``'s attention to ``"ds_seqpar"``; remember the original to restore it.

    Raises an error naming the model class and its attention implementation when the model does
    not dispatch through transformers' attention interface. A PEFT wrapper is unwrapped to the HF
    model it adapts; the wrapper itself is returned.
    """
    wrapper, model = model, unwrap_hf_model(model)
    config = getattr(model, "config", None)
    original = getattr(config, "_attn_implementation", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a HuggingFace PreTrainedModel with a config; ds_seqpar routes the "
            "attention of transformers models (e.g. LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM)"
        )
    if original == ATTN_IMPLEMENTATION:
        return wrapper
    register_attention()
    try:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise UnsupportedModelError(
            f"{type(model).__name__} (attn_implementation={original!r}) cannot route its attention through "
            f"ds_seqpar: transformers refused a custom attention implementation ({exc})"
        ) from exc
    model._ds_seqpar_original_attn = original
    route_linear_layers(model)
    return wrapper


def disable_sequence_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """Restore the attention implementation the model had before ``enable_sequence_parallel``."""
    wrapper, model = model, unwrap_hf_model(model)
    original = getattr(model, "_ds_seqpar_original_attn", None)
    if original is not None:
        model.set_attn_implementation(original)
        del model._ds_seqpar_original_attn
    unroute_linear_layers(model)
    return wrapper


@dataclass(frozen=True)
class _ModelParts:
    """The HF model inside a (PEFT) wrapper, its decoder, its logits, which decoder layer each
    submodule belongs to (``layer_of``, over ``num_layers`` layers) and the sliding window its config
    promises (``window``); kept out of the module tree."""

    hf: torch.nn.Module
    decoder: torch.nn.Module
    logits: ModelLogits
    layer_of: dict[int, int]
    num_layers: int | None
    window: int | None


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

    def __init__(
        self, model: torch.nn.Module, mesh: SeqParMesh, grad_scale: float = 1.0, loss_chunk_size: int = 1024
    ) -> None:
        super().__init__()
        check_objective(self.objective)
        hf = unwrap_hf_model(model)
        decoder = decoder_of(hf)
        refuse_unhonoured_features(hf)
        refuse_recurrent_layers(hf)
        if getattr(hf, "_ds_seqpar_original_attn", None) is None and not has_routed_layers(hf):
            # one process, before the attention is switched
            check_token_locality(hf, decoder, self.objective, encoder_states=self.encoder_states)
        self.model = enable_sequence_parallel(model)
        layer_of, num_layers, layers = _decoder_layers(decoder, hf)
        self._parts = _ModelParts(
            hf, decoder, ModelLogits(hf, decoder), layer_of, num_layers, expected_window(hf)
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
        parts = self._parts
        if self.memory.plan is not None:
            zero3 = any(hasattr(p, "ds_id") for p in itertools.islice(parts.decoder.parameters(), 1))
            self.memory.plan.plan(input_ids.shape[-1], input_ids.device, agree=zero3)
        ctx = ctx or self._context(doc_ids)
        token = ACTIVE_CONTEXT.set(ctx)
        try:
            hidden = parts.decoder(
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
                f"{got[:4].tolist()}..., expected {expected[:4].tolist()}... (layout {layout.ring.kind}); local "
                "positions 0..n-1 would give every rank the same RoPE. Pass the batch from ds_seqpar.shard_batch"
            )

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
        """Loss, correct and count over the labelled ``targets [B, n]`` of the SP group, from ``hidden [B, n, E]``."""
        labelled = targets != -100
        logits = self._parts.logits(hidden[labelled][None])[0].float()  # [T, V], T labelled tokens
        targets = targets[labelled]
        totals = torch.stack(
            [
                torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
                if targets.numel()
                else logits.sum(),
                (logits.argmax(-1) == targets).sum().float(),
                torch.tensor(float(targets.numel()), device=logits.device),
            ]
        )
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
        whose positions come from ``position_ids`` (RoBERTa-style padding-offset positions are refused).
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
