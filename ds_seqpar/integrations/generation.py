"""Generation under SP: sharded prefill, then decoding from the sharded cache (docs/inference.md "Generation").

Legend: P SP ranks, B batch, S0 prompt tokens, T new tokens, V vocabulary.

``generate(model, input_ids [B, S0], mesh=..., max_new_tokens=T, **sampling)`` takes HF's sampling arguments
through the model's own ``GenerationConfig`` and logits processors (temperature, top-k, top-p, min-p,
repetition penalty, min_new_tokens, bad words, ...), so greedy decoding and sampling under a seed pick the
tokens ``model.generate`` picks. Per token: one decoding step (``decode.py``), the processors, the choice,
then ONE broadcast of the chosen ``[B]`` token ids from the SP group's first rank (every rank continues with
the same tokens) and one host read of the stop condition. Beams, assisted decoding, stop strings and the
other strategies are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ds_seqpar.integrations.decode import decode_step
from ds_seqpar.integrations.hf_model import UnsupportedModelError, unwrap_hf_model
from ds_seqpar.integrations.prefill import causal_wrapper, model_device, prefill
from ds_seqpar.integrations.sharded_cache import ShardedCache, sp_reducer
from ds_seqpar.mesh import SeqParMesh

__all__ = ["GenerateOutput", "generate"]

# GenerationConfig fields whose value (other than the neutral default(s)) asks for something this loop does not do: (field, default, why)
REFUSED_SETTINGS = (
    ("num_beams", 1, "beam search"),
    ("num_beam_groups", 1, "group beam search"),
    ("num_return_sequences", 1, "several sequences per prompt (repeat the prompt rows instead)"),
    ("penalty_alpha", None, "contrastive search"),
    ("stop_strings", None, "stop strings (give stop token ids as eos_token_id)"),
    ("max_time", None, "a time limit"),
    ("prompt_lookup_num_tokens", None, "prompt-lookup decoding"),
    ("assistant_early_exit", None, "self-speculative decoding"),
    ("output_attentions", False, "attention weights"),
    ("output_hidden_states", False, "hidden states"),
    ("guidance_scale", (None, 1, 1.0), "classifier-free guidance (its processor runs the unsharded model)"),
)


@dataclass(frozen=True)
class GenerateOutput:
    """``sequences [B, S0 + T]`` (prompt then new tokens; rows that stopped are padded with the pad id),
    ``logits``: T raw float32 ``[B, V]`` logits (before the processors), the one that chose each new token, and
    this rank's ``cache`` (prompt and new tokens)."""

    sequences: torch.Tensor
    logits: tuple[torch.Tensor, ...]
    cache: ShardedCache


def _config(hf: torch.nn.Module, generation_config: Any, sampling: dict[str, Any]) -> Any:
    """The model's generation config updated with ``sampling``; unknown or refused settings raise by name."""
    config, unused = hf._prepare_generation_config(generation_config, **sampling)
    unused = {k: v for k, v in unused.items() if v is not None}
    if unused:
        raise ValueError(
            f"generate: {sorted(unused)} are not generation settings ds_seqpar honours (HF GenerationConfig fields "
            "such as do_sample, temperature, top_k, top_p, repetition_penalty, eos_token_id are)"
        )
    for name, default, what in REFUSED_SETTINGS:
        value = getattr(config, name, None)
        neutral = default if isinstance(default, tuple) else (default,)
        if value is not None and value not in neutral:
            raise UnsupportedModelError(
                f"generate: {name}={value!r} asks for {what}, which ds_seqpar does not run"
            )
    return config


def _broadcast(tokens: torch.Tensor, mesh: SeqParMesh) -> torch.Tensor:
    """The SP group's first rank's ``tokens [B]`` on every rank of the group."""
    tokens = tokens.contiguous()
    sp_reducer(mesh).broadcast_(tokens)
    return tokens


def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    mesh: SeqParMesh | None = None,
    position_ids: torch.Tensor | None = None,
    prefill_mode: str | None = None,
    seed: int | None = None,
    generation_config: Any = None,
    **sampling: Any,
) -> GenerateOutput:
    """Generate continuations of ``input_ids [B, S0]`` (the same on every SP rank) over the SP group.

    Args:
        model: a ``SeqParCausalLM`` (or the DeepSpeed engine around one), or a HF causal LM with ``mesh``.
        position_ids: packed prompts (``prefill``); the new tokens continue each row's last document.
        prefill_mode: a name of ``PREFILL_MODES``; None: ``sequence_parallel.inference.prefill``.
        seed: ``torch.manual_seed(seed)`` before the first token (sampling draws from torch's generator).
        generation_config, sampling: as for HF's ``model.generate`` (``max_new_tokens``, ``do_sample``,
            ``temperature``, ``top_k``, ``top_p``, ``eos_token_id``, ...); defaults from the model's own.
    """
    from transformers import LogitsProcessorList

    wrapper = causal_wrapper(model, mesh)
    hf = unwrap_hf_model(wrapper.model)
    ids = torch.as_tensor(input_ids).long().to(model_device(wrapper))
    config = _config(hf, generation_config, sampling)
    hf._prepare_special_tokens(config, False, device=ids.device)
    if ids.dim() != 2:
        raise ValueError(f"generate takes input_ids [B, S0]; got shape {tuple(ids.shape)}")
    max_new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - ids.shape[1]
    if max_new < 1:
        raise ValueError(
            f"generate: {max_new} new tokens to make (max_new_tokens / max_length); ask for >= 1"
        )
    processors = hf._get_logits_processor(
        generation_config=config, input_ids_seq_length=ids.shape[1], encoder_input_ids=ids,
        prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(), device=ids.device, model_kwargs={},
    )  # fmt: skip
    if seed is not None:
        torch.manual_seed(seed)
    first = prefill(wrapper, ids, position_ids=position_ids, mode=prefill_mode,
                    reserve=-(-max_new // wrapper.mesh.sp_size) + 1)  # fmt: skip
    logits, cache = first.logits, first.cache
    eos, pad = config._eos_token_tensor, config._pad_token_tensor
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
    sequences, raw = ids, []
    for step in range(max_new):
        raw.append(logits)
        scores = processors(sequences, logits)
        if config.do_sample:
            chosen = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            chosen = torch.argmax(scores, dim=-1)
        chosen = _broadcast(chosen, wrapper.mesh)
        if eos is not None:
            chosen = torch.where(unfinished, chosen, pad.to(chosen.device))
            unfinished = unfinished & ~torch.isin(chosen, eos.to(chosen.device))
        sequences = torch.cat([sequences, chosen[:, None]], dim=1)
        if step == max_new - 1 or not bool(unfinished.any()):
            break
        logits = decode_step(wrapper, cache, chosen)
    return GenerateOutput(sequences, tuple(raw), cache)
