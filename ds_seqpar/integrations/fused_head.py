"""A causal LM that TRL's post-training trainers call as they call a model with TRL's fused LM head.

Legend: B = batch, S = the row length TRL gives, n = this rank's tokens.

TRL's GRPO and DPO trainers get per-token log-probs by calling the model with the WHOLE rows and
``fused_lm_head=True``::

    out = model(input_ids=ids [B, S], attention_mask=mask [B, S], labels=labels [B, S], fused_lm_head=True)
    out.log_probs   # [B, S - 1]: log p(labels[:, t + 1] | tokens <= t), 0 where the label is -100

Under sequence parallelism every rank of an SP group holds the same rows (the trainers' data is split
over the data-parallel replicas only, ``integrations/trl_trainers.py``). :class:`SeqParFusedLM` answers
that call by sharding the rows itself (``ds_seqpar.shard_batch``: padding inside a row becomes document id
-1, positions are the row's ``0..S-1`` as HF numbers them without ``position_ids``), running the decoder
over the group and ``token_logprobs(gather=True)`` (``integrations/logprobs.py``): each rank computes its n
tokens' log-probs chunk by chunk and the group all-gathers them. The fields are the same as TRL's
``FusedCausalLMOutput`` (``log_probs``, ``entropy``, ``mean_logits``, ``is_top1``, ``log_sum_sq_probs``, ``loss``),
at the sampler's ``temperature``. The gathered log-probs are replicated: TRL's loss, computed identically on
every rank of the group, back-propagates each rank's own tokens (``logprobs.py``).

``generate`` runs the plain model (its own attention, every rank the whole prompt): TRL's in-process
generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ds_seqpar.data import shard_batch
from ds_seqpar.integrations.causal_lm import SeqParCausalLM
from ds_seqpar.integrations.routing import disable_sequence_parallel, enable_sequence_parallel

__all__ = ["FUSED_FIELDS", "FusedLogprobs", "SeqParFusedLM"]

FUSED_FIELDS = ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs")


@dataclass
class FusedLogprobs:
    """What a fused-head call returns: per-token fields ``[B, S - 1]`` (None when not requested) and the loss
    (negative log-likelihood summed over the labelled tokens, divided by ``num_items_in_batch`` or their count)."""

    loss: torch.Tensor
    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


class SeqParFusedLM(SeqParCausalLM):
    """``SeqParCausalLM`` that also answers TRL's fused-head calls (module docstring).

    Attributes set by the trainer: ``temperature`` (GRPO's sampling temperature; the logits are divided by
    it), ``fused_outputs`` (the fields to compute, a subset of :data:`FUSED_FIELDS`), ``pad_token_id`` (the id
    the layout's end padding uses).
    """

    temperature: float = 1.0
    fused_outputs: tuple[str, ...] = ("log_probs", "entropy")
    pad_token_id: int = 0

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        shift_labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        *,
        fused_lm_head: bool = False,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        num_items_in_batch: Any = None,
        use_cache: bool | None = None,
        **extra: Any,
    ) -> Any:
        if not fused_lm_head:
            return super().forward(input_ids, shift_labels, position_ids, doc_ids, attention_mask=attention_mask,
                                   labels=labels, **extra)  # fmt: skip
        return self.fused(
            input_ids, attention_mask, labels, shift_labels, position_ids, num_items_in_batch, extra
        )

    def fused(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        labels: torch.Tensor | None,
        shift_labels: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        num_items_in_batch: Any,
        extra: dict[str, Any],
    ) -> FusedLogprobs:
        """Per-token fields of whole rows ``input_ids [B, S]`` (the same on every rank of the group)."""
        self._refuse_fused_inputs(labels, shift_labels, position_ids, extra)
        batch = {"input_ids": input_ids, "labels": labels}
        if attention_mask is not None:
            batch["attention_mask"] = attention_mask
        shard = shard_batch(batch, self.mesh, pad_token_id=self.pad_token_id)
        stats = tuple(f for f in self.fused_outputs if f not in ("log_probs", "entropy"))
        res = self.token_logprobs(**shard, gather=True, entropy="entropy" in self.fused_outputs,
                                  temperature=self.temperature, stats=stats)  # fmt: skip
        keep = input_ids.shape[1] - 1
        log_probs = res.logprobs[:, :keep]
        count = (res.labels[:, :keep] != -100).sum().clamp(min=1)
        loss = -log_probs.sum() / (count if num_items_in_batch is None else num_items_in_batch)
        fields = {name: value[:, :keep] for name, value in res.stats.items()}
        if "is_top1" in fields:  # TRL's field is boolean (gathered as 0 / 1)
            fields["is_top1"] = fields["is_top1"] > 0.5
        entropy = None if res.entropy is None else res.entropy[:, :keep]
        return FusedLogprobs(loss, log_probs, entropy, **fields)

    def _refuse_fused_inputs(
        self,
        labels: torch.Tensor | None,
        shift_labels: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        extra: dict[str, Any],
    ) -> None:
        """Only token ids, a 2-D padding mask and labels; anything else is refused by name before any collective."""
        if labels is None:
            raise ValueError("a fused-head call needs labels [B, S] (-100 = not scored), as TRL passes them")
        given = {k: v for k, v in extra.items() if v is not None and v is not False}
        if shift_labels is not None:
            given["shift_labels"] = shift_labels
        if position_ids is not None:
            given["position_ids"] = position_ids
        if given:
            raise ValueError(
                f"{type(self).__name__}: fused-head inputs {sorted(given)} are not honoured under sequence parallelism "
                "(the rows are sharded here from input_ids, attention_mask and labels: no images, token types, packed "
                "position_ids or MoE router outputs); remove them or train without sequence parallelism"
            )

    # --- what TRL's generation and checkpointing helpers call on the unwrapped model ---------------------------

    @property
    def generation_config(self) -> Any:
        return self._parts.hf.generation_config

    @generation_config.setter
    def generation_config(self, value: Any) -> None:
        self._parts.hf.generation_config = value

    @property
    def is_gradient_checkpointing(self) -> bool:
        return bool(getattr(self._parts.hf, "is_gradient_checkpointing", False))

    def gradient_checkpointing_disable(self) -> None:
        self._parts.hf.gradient_checkpointing_disable()

    def gradient_checkpointing_enable(
        self, gradient_checkpointing_kwargs: dict[str, Any] | None = None
    ) -> None:
        self._parts.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs)

    @torch.no_grad()
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The plain model's ``generate`` (its own attention; every rank runs the whole prompt)."""
        disable_sequence_parallel(self.model)
        try:
            return self.model.generate(*args, **kwargs)
        finally:
            enable_sequence_parallel(self.model)
