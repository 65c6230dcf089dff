"""``SeqParVisionLM``: a vision-language model under sequence parallelism (docs/multimodal.md).

The batch is the text model's (``ds_seqpar.shard_batch``: this rank's token ids, pre-shifted labels, global
positions, document ids) plus the processor's vision inputs, whole and the same on every rank of the SP
group (``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``, ``mm_token_type_ids``,
``image_sizes``, ...). One forward:

1. one all-gather of the token ids (and text positions) rebuilds the whole rows ``[B, S]``;
2. the VLM's own forward runs on the whole rows with two of its calls cut: its vision towers run split over the
   group by whole images / frames (``split_tower.py``), and its language model runs on this rank's tokens
   (``language.py``); so the placeholder scatter and the position ids (3-D mRoPE included) are the family's own;
3. the loss is the text model's: this rank's final hidden states through the model's own head, token-weighted
   over the group.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ds_seqpar.integrations.causal_lm import SeqParCausalLM
from ds_seqpar.integrations.context import ACTIVE_CONTEXT, SeqParContext
from ds_seqpar.integrations.hf_model import UnsupportedModelError, unwrap_hf_model
from ds_seqpar.integrations.vision.language import TokenShard, sharded_language_model
from ds_seqpar.integrations.vision.masks import MASK_INPUTS, MaskProbe, block_ids, probe_masks
from ds_seqpar.integrations.vision.positions import packed_rope_positions
from ds_seqpar.integrations.vision.refusals import refuse_unsupported_vlm
from ds_seqpar.integrations.vision.split_tower import split_towers, vision_towers
from ds_seqpar.settings import input_layout

__all__ = ["SeqParVisionLM", "is_vision_lm", "whole_inputs_of"]


LANGUAGE_ATTRIBUTES = ("language_model", "text_model")  # where a VLM's base model keeps its language model


def language_model_of(model: torch.nn.Module) -> torch.nn.Module | None:
    """The language model of a VLM's base model (``model.model.language_model`` / ``.text_model``), or None."""
    base = getattr(model, "model", None)
    found = (getattr(base, name, None) for name in LANGUAGE_ATTRIBUTES) if base is not None else ()
    return next((m for m in found if isinstance(m, torch.nn.Module)), None)


def is_vision_lm(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the HF model inside a PEFT wrapper) is a VLM ``SeqParVisionLM`` runs: a base model
    with a language model and a vision tower."""
    hf = unwrap_hf_model(model)
    return language_model_of(hf) is not None and bool(vision_towers(hf))


# Keywords of a VLM's forward that the wrapper sets itself or that have no meaning in SP training.
OWN_KEYWORDS = frozenset(
    {"input_ids", "attention_mask", "position_ids", "inputs_embeds", "labels", "use_cache", "cache",
     "past_key_values", "cache_position", "logits_to_keep", "return_dict", "mm_encoder_outputs", "kwargs"}
)  # fmt: skip
# Per-token vision inputs ``[B, S0]`` (S0: the rows before the layout's padding); padded with 0 (= text).
TOKEN_INPUTS = ("mm_token_type_ids", *MASK_INPUTS)


def _vision_keywords(base: torch.nn.Module) -> tuple[str, ...]:
    """The keywords of a VLM base model's forward that carry its vision inputs (all but ``OWN_KEYWORDS``)."""
    params = inspect.signature(type(base).forward).parameters
    return tuple(sorted(k for k in params if k not in OWN_KEYWORDS))


def whole_inputs_of(model: torch.nn.Module) -> tuple[str, ...]:
    """The batch keys that go to ``model`` unsharded: a wrapper's ``whole_inputs``, a VLM's vision keywords, or
    none (a text model)."""
    if isinstance(model, SeqParCausalLM):
        return model.whole_inputs
    return _vision_keywords(unwrap_hf_model(model).model) if is_vision_lm(model) else ()


class SeqParVisionLM(SeqParCausalLM):
    """A HuggingFace vision-language model (``*ForConditionalGeneration`` whose base model has a
    ``language_model``) under sequence parallelism: ``forward(**shard_batch(batch, mesh), **vision_inputs)``
    returns the SP group's token-weighted loss (see the module). Text-only batches run as in
    ``SeqParCausalLM``."""

    def __init__(
        self, model: torch.nn.Module, mesh: Any, grad_scale: float = 1.0, loss_chunk_size: int = 1024
    ):
        outer = unwrap_hf_model(model)
        if language_model_of(outer) is None:  # before the text probe
            raise UnsupportedModelError(
                f"{type(outer).__name__} has no base model (model.model) with a language_model / text_model; ds_seqpar runs "
                "VLMs built as model.language_model + model.<vision tower>; train its text path with "
                "ds_seqpar.SeqParCausalLM"
            )
        refuse_unsupported_vlm(outer)
        super().__init__(model, mesh, grad_scale=grad_scale, loss_chunk_size=loss_chunk_size)
        hf = self._parts.hf
        base = getattr(hf, "model", None)
        if base is None or language_model_of(hf) is not self._parts.decoder:
            raise UnsupportedModelError(
                f"{type(hf).__name__} has no base model whose language_model is its decoder "
                f"({type(self._parts.decoder).__name__}); ds_seqpar runs VLMs built as model.language_model "
                "+ model.<vision tower>; train its text path with ds_seqpar.SeqParCausalLM"
            )
        self.whole_inputs = _vision_keywords(base)
        # a tower attends inside its units, on each rank, not over the group: its own attention implementation
        for _, tower, _ in vision_towers(hf):
            tower.config._attn_implementation = self._local_attention

    def _vision_inputs(self, extra: dict[str, Any]) -> dict[str, Any]:
        """Pop the vision inputs out of ``extra``; any other non-None keyword is left for ``_refuse_masks``."""
        return {k: extra.pop(k) for k in list(extra) if k in self.whole_inputs and extra[k] is not None}

    def _loss(self, input_ids, targets, position_ids, doc_ids, extra):  # type: ignore[override]
        vision = self._vision_inputs(extra)
        self._refuse_masks(extra)
        return self._token_loss(self._hidden(input_ids, position_ids, doc_ids, **vision), targets)

    def _evaluate(self, input_ids, targets, position_ids, doc_ids, extra):  # type: ignore[override]
        vision = self._vision_inputs(extra)  # evaluate(): loss and accuracy with the vision inputs, as _loss
        self._refuse_masks(extra)
        return self._token_accuracy(self._hidden(input_ids, position_ids, doc_ids, **vision), targets)

    def _run_decoder(self, input_ids, position_ids, ctx, **vision):  # type: ignore[override]
        if not vision:
            return super()._run_decoder(input_ids, position_ids, ctx)
        layout = input_layout(self.mesh, ctx.doc_ids)
        if layout.group_degree is not None or layout.world != self.mesh.sp_size:
            raise UnsupportedModelError(
                "a VLM batch runs over the whole SP group; sequence_parallel.dynamic_degree splits it into groups: "
                "switch dynamic_degree off for vision-language training"
            )
        rows, positions = self._whole_rows(input_ids, position_ids, layout)
        seq_len = rows.shape[1]
        vision = {k: self._padded(k, v, seq_len) for k, v in vision.items()}
        doc = ctx.doc_ids
        text_positions = positions
        attention_mask = None if doc is None or bool((doc >= 0).all()) else (doc >= 0).long()
        if self._mrope:
            # the processor's all-ones mask: Qwen2.5-Omni / Qwen3-Omni number tokens in 3-D only when given one
            attention_mask = torch.ones_like(rows) if attention_mask is None else attention_mask
            positions = (
                None
                if doc is None or int(doc.max()) == 0
                else packed_rope_positions(self._base, rows, doc, vision)
            )
        ctx.blocks = self._blocks(vision)  # the attention of every layer applies them (docs/kernels.md)
        packed = doc is not None and int(doc.max()) > 0
        probe = MaskProbe(ctx.blocks, seq_len, self.config.model_type, packed)
        shard = TokenShard(
            layout, self.mesh.coords.sp_rank, seq_len, masks_handled=True, positions=text_positions
        )
        local = SeqParContext(self.mesh, local_attention=self._local_attention)
        token = ACTIVE_CONTEXT.set(local)
        try:
            with (
                probe_masks(probe),
                split_towers(self._parts.hf, self.mesh),
                sharded_language_model(self._parts.decoder, ctx, shard),
            ):
                out = self._base(
                    input_ids=rows,
                    attention_mask=attention_mask,
                    position_ids=positions,
                    use_cache=False,
                    **vision,
                )
        finally:
            ACTIVE_CONTEXT.reset(token)
        self._check_calls(ctx)
        return out.last_hidden_state

    def _blocks(self, vision: dict[str, Any]) -> torch.Tensor | None:
        """Block ids ``[B, S]`` of the tokens that attend to each other bidirectionally (``masks.py``), or None."""
        return block_ids(self.config.model_type, vision)

    @property
    def _base(self) -> torch.nn.Module:
        """The VLM's base model (kept out of the module tree: its weights are the model's, once)."""
        return self._parts.hf.model

    @property
    def _mrope(self) -> bool:
        return hasattr(self._base, "get_rope_index")

    @property
    def _local_attention(self) -> str:
        return getattr(self._parts.hf, "_ds_seqpar_original_attn", None) or "sdpa"

    def _whole_rows(self, input_ids: torch.Tensor, position_ids: torch.Tensor, layout: Any) -> tuple:
        """The whole rows ``[B, S]`` of token ids and text positions: one all-gather of both shards."""
        if self.mesh.sp_size == 1:
            return input_ids, position_ids
        local = torch.stack([input_ids.long(), position_ids.long().expand_as(input_ids)]).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.mesh.sp_size)]
        torch.distributed.all_gather(parts, local, group=self.mesh.group("sp"))
        whole = layout.unshard(parts, dim=2)
        return whole[0], whole[1]

    def _padded(self, key: str, value: Any, seq_len: int) -> Any:
        """Per-token vision inputs ``[B, S0]`` padded to the rows' length with 0 (text)."""
        if key not in TOKEN_INPUTS or not isinstance(value, torch.Tensor):
            return value
        if value.shape[-1] > seq_len:
            raise ValueError(f"{key} has {value.shape[-1]} tokens per row but the rows have {seq_len}")
        return torch.nn.functional.pad(value, (0, seq_len - value.shape[-1]))
