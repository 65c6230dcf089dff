"""The parts of a HuggingFace causal LM that ds_seqpar runs itself: the decoder and the logits.

Under sequence parallelism the decoder runs once over this rank's tokens (``get_decoder()``), and
the loss needs logits of chunks of its final hidden states. Families differ in what happens between
the two (a final norm outside the decoder, a hidden-state multiplier, the LM head, a final logit
soft-cap, a logit scale or divisor, ...), and new families arrive every month. So no per-family
table: :class:`ModelLogits` runs the model's OWN forward with the decoder replaced by a stand-in
that returns the given hidden states. Whatever the family's forward does after its decoder is
exactly what the SP loss sees; an unknown step cannot be skipped silently.

Wrappers: a PEFT model (``PeftModel`` -> ``LoraModel`` -> the HF model) is unwrapped to the HF model
it adapts (its LoRA layers are in place there); composite models (a language model under a nested
``text_config``, e.g. Gemma 3 with a vision tower) run text-only batches: the decoder is the language
model, the vision tower is never called, and any image or other non-text input is refused.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from ds_seqpar.integrations.positions import position_rule_of
from ds_seqpar.integrations.probe_trace import ProbeTrace


class UnsupportedModelError(ValueError, TypeError, RuntimeError):
    """A model (family) feature that ds_seqpar cannot honour under sequence parallelism; the message
    names the module, the feature and what to do. Raised before the model's attention communicates,
    or, for checks that need one forward (which layers call the attention), identically on every rank."""


def unwrap_hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers ``PreTrainedModel`` inside ``model`` (itself, or the model a PEFT wrapper adapts)."""
    seen = 0
    while hasattr(model, "get_base_model") and seen < 4:  # PeftModel -> LoraModel.model
        inner = model.get_base_model()
        if inner is model:
            break
        model, seen = inner, seen + 1
    return model


def objective_of(model: torch.nn.Module) -> str:
    """``"masked"`` for a HuggingFace masked-LM model (a class ``AutoModelForMaskedLM`` maps to: ModernBERT,
    BERT, ...) that is not also a causal LM, else ``"causal"``; a PEFT wrapper is unwrapped first."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    name = type(unwrap_hf_model(model)).__name__
    masked = {c for names in MODEL_FOR_MASKED_LM_MAPPING_NAMES.values() for c in _as_tuple(names)}
    causal = {c for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for c in _as_tuple(names)}
    return "masked" if name in masked and name not in causal else "causal"


def _as_tuple(names: Any) -> tuple:
    return tuple(names) if isinstance(names, list | tuple) else (names,)


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The module that maps token ids to final hidden states (the language model of composite models)."""
    from transformers import PreTrainedModel

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if not isinstance(decoder, PreTrainedModel) or decoder is model:  # e.g. an LM head named "decoder"
        decoder = getattr(model, "base_model", None)
    if decoder is None or decoder is model:  # e.g. a base_model_prefix that names no attribute
        inner = [m for m in model.children() if isinstance(m, PreTrainedModel)]
        decoder = inner[0] if len(inner) == 1 else None
    if decoder is None or decoder is model:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no separate decoder module (get_decoder() / base_model); ds_seqpar "
            "runs the decoder over each rank's tokens and the model's own head on the result"
        )
    return decoder


def text_configs(model: torch.nn.Module) -> list[Any]:
    """The model's config and, for composite models, its nested text config."""
    return [c for c in (model.config, getattr(model.config, "text_config", None)) if c is not None]


def refuse_unhonoured_features(model: torch.nn.Module) -> None:
    """Model-level features the SP loss would silently drop: raise naming them (before any collective)."""
    name = type(model).__name__
    for config in text_configs(model):
        layer_types = [str(t) for t in getattr(config, "layer_types", None) or []]
        chunk = getattr(config, "attention_chunk_size", None)
        if chunk and not any(t == "chunked_attention" for t in layer_types):
            raise UnsupportedModelError(
                f"{name}: config.attention_chunk_size={chunk} (chunked attention) without config.layer_types naming "
                "its 'chunked_attention' layers: ds_seqpar applies the chunk to the layers those entries name, so "
                "this model cannot run under ds_seqpar"
            )
        if getattr(config, "keep_window_size", None):
            raise UnsupportedModelError(
                f"{name}: dynamic mask attention (config.keep_window_size={config.keep_window_size}, Doge): each key "
                "gets a learned bias from its value, and above keep_window_size keys each query keeps only its "
                "top keep_window_size keys by that bias, chosen over the whole row; ds_seqpar's kernels take no "
                "per-key learned bias and no such selection, so this model cannot run under ds_seqpar"
            )
        if "indexed_attention" in layer_types and not getattr(config, "index_topk", None):  # QSA, not DSA
            raise UnsupportedModelError(
                f"{name}: config.layer_types has indexed_attention layers (Qwen4-Exp QSA: a learned indexer selects "
                f"indexer_budget={getattr(config, 'indexer_budget', None)} compressed key blocks per query over the "
                "whole sequence), which ds_seqpar does not split over the sequence; this model cannot run under ds_seqpar"
            )
        if getattr(config, "output_router_logits", False):
            coef = getattr(config, "router_aux_loss_coef", None)
            raise UnsupportedModelError(
                f"{name}: config.output_router_logits=True adds the MoE load-balancing loss (router_aux_loss_coef="
                f"{coef}) to the model's loss, which ds_seqpar's sequence-parallel loss does not compute; set "
                "model.config.output_router_logits=False (the router still routes every token the same way)"
            )


# Families whose MASK applies ``config.sliding_window`` to every layer while their attention layers neither
# pass it nor keep it (the attention reads it from ``module.config``), and families whose config carries a
# ``sliding_window`` that nothing uses (their mask is plain causal). Keyed by ``config.model_type``.
WINDOW_FROM_CONFIG = frozenset({"phimoe"})
WINDOW_UNUSED = frozenset({"moshi"})


def expected_window(model: torch.nn.Module) -> int | None:
    """The sliding window the config asks some layers to use (None: no sliding layer).

    A family that builds its sliding-window MASK but does not pass ``sliding_window`` to the attention
    would silently lose the window under ds_seqpar (which receives no mask); ``SeqParCausalLM`` checks
    after the first forward that the attention saw a window when the config promises one.
    """
    for config in text_configs(model):
        window = getattr(config, "sliding_window", None)
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            continue
        if getattr(config, "use_sliding_window", True) is False or config.model_type in WINDOW_UNUSED:
            continue
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None and not any("sliding" in str(t) for t in layer_types):
            continue
        return window
    return None


def expected_chunk(model: torch.nn.Module) -> int | None:
    """The attention chunk the config gives its ``"chunked_attention"`` layers (None: no chunked layer);
    ``SeqParCausalLM`` checks after the first forward that such a layer passed it to the attention."""
    for config in text_configs(model):
        chunk = getattr(config, "attention_chunk_size", None)
        if chunk and "chunked_attention" in [str(t) for t in getattr(config, "layer_types", None) or []]:
            return chunk
    return None


PROBE_ATTENTION = "ds_seqpar_probe"
PROBE_TOKENS = 8


PROBE_ENCODER_TOKENS = 3  # encoder states of the probe of an encoder-decoder: neither 8 nor 4 tokens


PROBE_CALLS: list[int] = [0]  # calls of the probe attention during the current probe


def _token_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """A probe attention in which every token attends only to itself: out = its value ``[B, S, H, D_v]``;
    a cross-attention (keys of the probe's encoder states) gives zeros."""
    PROBE_CALLS[0] += 1
    if key.shape[2] != query.shape[2]:
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None
    group = query.shape[1] // value.shape[1]
    return value.repeat_interleave(group, dim=1).transpose(1, 2).contiguous(), None


def check_token_locality(
    model: torch.nn.Module, decoder: torch.nn.Module, objective: str = "causal", encoder_states: bool = False
) -> None:
    """One process, before any collective: everything but the attention must treat a token the same way
    in a shard as in the whole sequence, given its global position.

    With an attention in which each token sees only itself, the decoder runs on 8 probe tokens with
    its default positions, and on their last 4 with ``position_ids = 4..7`` (what a rank holding that
    shard passes; a family with a position rule, ``positions.py``, gets its own position ids of the 8); the
    outputs of those 4 tokens must agree. Otherwise the first module that differs is named
    (``probe_trace.py``); no call of the probe attention (attention computed inline) refuses too. The model's own
    loss on the probe must also be the next-token cross-entropy of its logits (Whisper's decoder, for
    one, does not shift its labels), or for ``objective="masked"`` the cross-entropy of each token's
    logits against its own label (a masked-LM head).

    ``encoder_states``: the decoder of an encoder-decoder; it gets probe encoder states of
    ``PROBE_ENCODER_TOKENS`` zeros (the probe's cross-attention returns zeros) and the model-level loss
    check is skipped (its forward needs the encoder's inputs; ds_seqpar computes the next-token loss).

    Skipped when the parameters are not materialised (meta device, ZeRO-3 partitions).
    """
    from transformers import AttentionInterface

    convs = _sequence_convs(decoder)
    params = list(itertools.islice(model.parameters(), 4))
    if not params or any(p.device.type == "meta" or hasattr(p, "ds_id") for p in params):
        for name, conv in convs.items():  # no probe: any sequence convolution of the decoder refuses
            _refuse_conv(model, decoder, name, conv)
        return
    called: list[str] = []
    hooks = [
        conv.register_forward_pre_hook(lambda *_, name=name: called.append(name))
        for name, conv in convs.items()
    ]
    ids = _probe_ids(model, params[0].device)
    tokens, half = ids[0].tolist(), ids.shape[1] // 2
    extra: dict[str, Any] = {}
    if encoder_states:
        width = getattr(decoder.config, "d_model", None) or decoder.config.hidden_size
        extra["encoder_hidden_states"] = params[0].new_zeros(1, PROBE_ENCODER_TOKENS, width)
    AttentionInterface.register(PROBE_ATTENTION, _token_attention)
    original, was_training = model.config._attn_implementation, model.training
    model.set_attn_implementation(PROBE_ATTENTION)
    model.eval()
    trace, PROBE_CALLS[0] = ProbeTrace(decoder), 0
    try:
        with torch.no_grad():
            trace.next_run()
            whole = decoder(input_ids=ids, use_cache=False, **extra)[0][:, half:]
            trace.next_run()
            shard = decoder(input_ids=ids[:, half:], position_ids=_probe_positions(decoder, ids, half),
                            use_cache=False, **extra)[0]  # fmt: skip
            trace.runs.append({})  # the model-level run below is not compared
            out = None if encoder_states else model(input_ids=ids, labels=ids, use_cache=False)
    except Exception as exc:
        raise UnsupportedModelError(
            f"{type(model).__name__} failed on a probe of {len(tokens)} tokens and a shard of them "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); it cannot run under ds_seqpar"
        ) from exc
    finally:
        model.set_attn_implementation(original)
        model.train(was_training)
        for hook in hooks:
            hook.remove()
        trace.remove()
    _refuse_inline_attention(model, decoder, len(tokens))
    if called:  # a convolution on the text path (a media encoder's is never called on text)
        _refuse_conv(model, decoder, called[0], convs[called[0]])
    tol = 1e-4 if whole.dtype in (torch.float32, torch.float64) else 5e-2
    _check_own_loss(model, out, ids, tol, objective)
    err = ((whole.double() - shard.double()).norm() / whole.double().norm().clamp(min=1e-30)).item()
    if not err <= tol:
        _refuse_divergence(model, decoder, trace, half, tol, convs)
        raise UnsupportedModelError(
            f"{type(model).__name__} treats a token differently in a shard of the sequence than in the whole "
            f"sequence, outside the attention (relative difference {err:.1e} with position_ids given): it derives "
            "positions itself (e.g. RoBERTa's padding offset, learned positions that ignore position_ids) or mixes "
            "tokens outside the attention (a convolution, a token shift); it cannot run under ds_seqpar"
        )


def _probe_ids(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """``[1, 8]`` probe token ids: ids from 3 on that are no pad / bos / eos token of the model."""
    special: set[int] = set()
    for config in text_configs(model):
        for t in ("pad", "bos", "eos"):
            value = getattr(config, f"{t}_token_id", None)
            special.update(value if isinstance(value, list | tuple) else [value])
    vocab = getattr(model.get_input_embeddings(), "num_embeddings", 64)
    tokens = [t for t in range(3, min(vocab, 64)) if t not in special][:PROBE_TOKENS]
    return torch.tensor([tokens], device=device)


def _probe_positions(decoder: torch.nn.Module, ids: torch.Tensor, half: int) -> torch.Tensor:
    """The shard's position ids ``[1, 4]``: its global positions, or, for a family with a position rule
    (``positions.py``), the family's own position ids of the whole probe row from ``half`` on."""
    found = position_rule_of(decoder)
    if found is None:
        return torch.arange(half, ids.shape[1], device=ids.device)[None]
    return found[1](ids)[:, half:]


def _refuse_inline_attention(model: torch.nn.Module, decoder: torch.nn.Module, tokens: int) -> None:
    """No call of the probe attention: the decoder mixes tokens without transformers' attention interface."""
    if PROBE_CALLS[0] == 0:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no layer of {type(decoder).__name__} called transformers' attention interface "
            f"on a probe of {tokens} tokens: it computes its token mixing inline (the class does not support "
            "setting its attention implementation), so ds_seqpar cannot split it over the sequence; this model "
            "cannot run under ds_seqpar"
        )


def _refuse_divergence(
    model: torch.nn.Module, decoder: torch.nn.Module, trace: ProbeTrace, half: int, tol: float, convs: dict
) -> None:
    """Name the first module whose output for the shard's tokens differs (``probe_trace.py``); a sequence
    ``Conv1d`` inside it (applied through its weights, never called) is named as the convolution."""
    where = trace.first_divergence(half, tol)
    if where is None:
        return
    name, module, what = where
    for conv_name, conv in convs.items():
        if conv_name == name or conv_name.startswith(name + "."):
            _refuse_conv(model, decoder, conv_name, conv)
    raise UnsupportedModelError(
        f"{type(model).__name__} treats a token differently in a shard of the sequence than in the whole sequence, "
        f"outside the attention: {type(decoder).__name__}.{name} ({type(module).__name__}) is the first module that "
        f"does ({what}, with the shard's global position_ids given); it derives positions or mixes tokens itself, "
        "which ds_seqpar does not split over the sequence; this model cannot run under ds_seqpar"
    )


def _sequence_convs(decoder: torch.nn.Module) -> dict[str, torch.nn.Conv1d]:
    """Conv1d modules with a kernel longer than one token (they mix neighbouring tokens)."""
    return {
        name: m
        for name, m in decoder.named_modules()
        if isinstance(m, torch.nn.Conv1d) and m.kernel_size[0] > 1
    }


def _refuse_conv(model: torch.nn.Module, decoder: torch.nn.Module, name: str, conv: torch.nn.Conv1d) -> None:
    raise UnsupportedModelError(
        f"{type(model).__name__}: {type(decoder).__name__}.{name} is a Conv1d over the sequence (kernel "
        f"{conv.kernel_size[0]}); its first outputs on each rank would need the previous rank's last tokens, which "
        "ds_seqpar does not exchange: this model cannot run under ds_seqpar"
    )


def _check_own_loss(model: torch.nn.Module, out: Any, ids: torch.Tensor, tol: float, objective: str) -> None:
    """The model's own loss for ``labels = input_ids`` must be the token-mean cross-entropy of its logits
    that ds_seqpar computes (next-token for ``causal``, same-token for ``masked``); otherwise its loss
    has another convention or extra terms."""
    loss, logits = getattr(out, "loss", None), getattr(out, "logits", None)
    if loss is None or logits is None:
        return
    targets = ids[:, 1:] if objective == "causal" else ids
    logits = (logits[:, :-1] if objective == "causal" else logits).float()
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    if not abs(loss.item() - ce.item()) <= tol * max(abs(ce.item()), 1e-30):
        what = "next-token" if objective == "causal" else "masked-token (unshifted)"
        raise UnsupportedModelError(
            f"{type(model).__name__}'s own loss for labels = input_ids ({loss.item():.6g}) is not the {what} "
            f"cross-entropy of its logits ({ce.item():.6g}): it shifts labels differently or adds terms, which "
            "ds_seqpar's sequence-parallel loss does not reproduce; this model cannot run under ds_seqpar"
            + (" (a masked-LM head: use ds_seqpar.SeqParMaskedLM)" if objective == "causal" else "")
        )


class _StandIn(torch.nn.Module):
    """Stands in for a module on the path from the model to its decoder inside the model's forward:
    calling it returns the given hidden states; the next module on the path is another stand-in,
    every other attribute is the original module's."""

    def __init__(self, original: torch.nn.Module, hidden: torch.Tensor, path: list[str], calls: list) -> None:
        super().__init__()
        inner = None
        if path:
            inner = _StandIn(original._modules[path[0]], hidden, path[1:], calls)
        self.__dict__.update(_original=original, _hidden=hidden, _next=(path[0] if path else None, inner))
        self.__dict__["_calls"] = calls

    def __getattr__(self, name: str) -> Any:
        state = self.__dict__
        if name == state["_next"][0]:
            return state["_next"][1]
        return getattr(state["_original"], name)

    def forward(self, *args: Any, **kwargs: Any) -> _DecoderOutput:
        self.__dict__["_calls"].append(True)
        return _DecoderOutput(self.__dict__["_hidden"])


class _DecoderOutput:
    """What a decoder returns, reduced to the hidden states: ``out[0]``, ``out.last_hidden_state``,
    ``out["last_hidden_state"]``; every other field (caches, router logits, image states) is None."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getattr__(self, name: str) -> None:
        if name.startswith("__"):
            raise AttributeError(name)
        return None

    def __getitem__(self, key: int | str) -> Any:
        if key == 0 or key == "last_hidden_state":
            return self.last_hidden_state
        if isinstance(key, slice):
            return (self.last_hidden_state,)[key]
        return None

    def to_tuple(self) -> tuple[torch.Tensor]:
        return (self.last_hidden_state,)


class ModelLogits:
    """Logits of final hidden states through the model's own forward after its decoder.

    ``logits(hidden [B, c, E]) -> [B, c, V]``: the model's forward runs with the top-level child that
    holds the decoder swapped for a stand-in returning ``hidden`` (dummy token ids, no labels, no
    cache), so the final norm / multipliers / LM head / soft-cap / logit scale of the family apply as
    in the plain model, and under ZeRO-3 the head's parameters are gathered by the same hooks.
    """

    def __init__(self, model: torch.nn.Module, decoder: torch.nn.Module) -> None:
        self.model = model
        names = {id(m): name for name, m in model.named_modules()}
        if id(decoder) not in names or decoder is model:
            raise UnsupportedModelError(
                f"{type(model).__name__}: its decoder {type(decoder).__name__} is not one of its submodules; "
                "ds_seqpar cannot run the model's own head on sequence-parallel hidden states"
            )
        self.path = names[id(decoder)].split(".")  # model -> ... -> decoder, e.g. ["model", "decoder"]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        calls: list = []
        slot = self.path[0]
        original = self.model._modules[slot]
        self.model._modules[slot] = _StandIn(original, hidden, self.path[1:], calls)
        try:
            ids = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)
            out = self.model(input_ids=ids, use_cache=False)
        finally:
            self.model._modules[slot] = original
        logits = out.logits if hasattr(out, "logits") else out[0]
        if not calls or logits is None or tuple(logits.shape[:2]) != tuple(hidden.shape[:2]):
            raise UnsupportedModelError(
                f"{type(self.model).__name__}.forward did not turn the hidden states {tuple(hidden.shape)} into "
                f"logits through its '{'.'.join(self.path)}' submodule; ds_seqpar cannot reproduce this model's logits"
            )
        return logits
