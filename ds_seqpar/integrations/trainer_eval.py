"""``SeqParTrainer``'s evaluation: ``trainer.evaluate()`` and ``eval_strategy`` under sequence parallelism.

::

    trainer = ds_seqpar.SeqParTrainer(model=model, args=TrainingArguments(..., eval_strategy="steps",
                                      eval_steps=50), train_dataset=train, eval_dataset=held_out)
    trainer.evaluate()  # {"eval_loss": ..., "eval_accuracy": ..., "eval_runtime": ..., ...}

What runs (docs/integration.md, "Evaluation"):

* ``get_eval_dataloader``: ``ds_seqpar.evaluation.EvenShares`` around the trainer's data collator at
  ``per_device_eval_batch_size``: samples split over the dp replicas, none repeated, every rank the same
  number of forwards (ZeRO-3), each batch sharded over the SP ranks;
* ``evaluation_loop`` (called by the base ``evaluate``, so a dict of eval datasets, ``metric_key_prefix``,
  the runtime fields, ``log`` and the ``on_evaluate`` callbacks are the base trainer's): the wrapped
  model's ``evaluate`` per batch, no gradients, logits ``loss_chunk_size`` tokens at a time;
  ``{prefix}_loss`` is the token-weighted mean cross-entropy over every labelled token of the set and
  ``{prefix}_accuracy`` the next-token accuracy (masked-token accuracy for a masked LM), summed over the SP
  group and the dp replicas. Before ``train()`` (no DeepSpeed engine yet) the wrapped model runs as it is
  on every rank; after, the engine's module (ZeRO-3 gathers its parameters). The train/eval mode is
  restored after.

Refused by name (``SeqParConfigError``, before any collective): ``compute_metrics`` and
``preprocess_logits_for_metrics`` (they take the logits ``[N, S, V]`` of the whole set, which no rank
holds), ``include_for_metrics`` (only ``compute_metrics`` reads it), ``fp16_full_eval`` / ``bf16_full_eval``
(evaluation runs at the DeepSpeed config's precision), ``dataloader_drop_last=True`` when the set would lose
samples, an eval set without a length, and ``predict()``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from transformers.trainer_utils import EvalLoopOutput

from ds_seqpar.errors import SeqParConfigError
from ds_seqpar.evaluation import EvenShares, evaluate_shards

__all__ = ["SeqParEvaluationMixin", "refuse_unhonoured_evaluation"]


def refuse_unhonoured_evaluation(trainer: Any) -> None:
    """Trainer settings that sharded evaluation cannot honour raise by name (see the module docstring)."""
    args = trainer.args
    problems = []
    for name in ("compute_metrics", "preprocess_logits_for_metrics"):
        if getattr(trainer, name, None) is not None:
            problems.append(
                f"{name}={getattr(trainer, name)!r} (it takes the logits [N, S, V] of the whole eval set; under "
                "sequence parallelism no rank holds them)"
            )
    include = list(getattr(args, "include_for_metrics", None) or [])
    if include:
        problems.append(f"include_for_metrics={include!r} (only compute_metrics reads it)")
    for flag in ("fp16_full_eval", "bf16_full_eval"):
        if getattr(args, flag, False):
            problems.append(f"{flag}=True (evaluation runs at the DeepSpeed config's precision)")
    if problems:
        raise SeqParConfigError(
            "evaluation under sequence parallelism cannot honour: "
            + "; ".join(problems)
            + "; valid: compute_metrics=None, preprocess_logits_for_metrics=None, include_for_metrics=[], "
            "fp16_full_eval=bf16_full_eval=False (eval_loss and eval_accuracy are computed sharded, "
            "token-weighted; docs/integration.md 'Evaluation')"
        )


def _whole_parameters(model: torch.nn.Module) -> Any:
    """Before ``train()`` (no DeepSpeed engine) a model created after ``TrainingArguments`` with a ZeRO-3
    config is partitioned (``deepspeed.zero.Init``) and nothing gathers its parameters in the forward:
    gather them all on every rank for the evaluation (read-only; one all-gather per parameter over the
    ZeRO group). Whole parameters: nothing to do."""
    params = list(model.parameters())
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


class SeqParEvaluationMixin:
    """The evaluation half of ``SeqParTrainerMixin`` (module docstring); expects ``seqpar_mesh``,
    ``seqpar_pad_token_id`` and ``seqpar_objective`` set by it."""

    def _seqpar_runner(self) -> Any:
        """The DeepSpeed engine once ``train()`` made one, else the wrapped model."""
        return self.deepspeed if getattr(self, "deepspeed", None) is not None else self.model

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """The base ``evaluate`` (a subclass's too: TRL prepares a passed dataset there), then the model's
        train/eval mode as it was before."""
        runner = self._seqpar_runner()
        training = getattr(runner, "module", runner).training
        try:
            return super().evaluate(*args, **kwargs)  # type: ignore[misc]
        finally:
            runner.train(training)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> EvenShares:
        """The sharded batches of ``eval_dataset`` (a dataset, the name of one in ``self.eval_dataset``, or
        None: ``self.eval_dataset``) for this rank."""
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError(f"{type(self).__name__}: evaluation requires an eval_dataset")
        if isinstance(eval_dataset, str):
            dataset = self.eval_dataset[eval_dataset]
        else:
            dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        args = self.args
        try:
            size = len(dataset)
        except TypeError:
            raise SeqParConfigError(
                f"eval_dataset {type(dataset).__name__} has no length: sharded evaluation splits the set over the "
                "dp replicas by index; valid: a map-style dataset (datasets.Dataset, a list, a torch Dataset)"
            ) from None
        per_step = args.per_device_eval_batch_size * self.seqpar_mesh.dp_size
        if args.dataloader_drop_last and size % per_step:
            raise SeqParConfigError(
                f"dataloader_drop_last=True with an eval set of {size} samples, not a multiple of "
                f"per_device_eval_batch_size {args.per_device_eval_batch_size} x dp {self.seqpar_mesh.dp_size}: "
                "sharded evaluation counts every sample once; valid: dataloader_drop_last=False, or an eval set "
                f"of a multiple of {per_step} samples"
            )
        workers = {"num_workers": args.dataloader_num_workers, "pin_memory": args.dataloader_pin_memory}
        return EvenShares(
            dataset,
            self.seqpar_mesh,
            args.per_device_eval_batch_size,
            collate_fn=self.data_collator,
            pad_token_id=self.seqpar_pad_token_id,
            objective=self.seqpar_objective,
            **workers,
        )

    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        """``{prefix}_loss`` and ``{prefix}_accuracy`` over ``dataloader`` (``get_eval_dataloader``'s); no
        predictions are gathered (``prediction_loss_only`` and ``ignore_keys`` change nothing)."""
        refuse_unhonoured_evaluation(self)
        if not isinstance(dataloader, EvenShares):
            raise SeqParConfigError(
                f"{type(self).__name__}.evaluation_loop got a {type(dataloader).__name__}; sharded evaluation "
                "runs on the batches of get_eval_dataloader() (trainer.evaluate()); predict() is not supported"
            )
        runner = self._seqpar_runner()
        module = getattr(runner, "module", runner)  # the SeqParCausalLM (inside the engine after train())
        runner.eval()  # as the base loop: the mode stays "eval" through its log() (TRL reads it); evaluate() restores it
        self.callback_handler.eval_dataloader = dataloader
        engine = getattr(self, "deepspeed", None) is not None  # its hooks gather ZeRO-3 parameters
        with torch.no_grad(), contextlib.nullcontext() if engine else _whole_parameters(runner):
            result = evaluate_shards(
                module.evaluate, dataloader, self.seqpar_mesh, self.args.device, self._prepare_inputs
            )
        metrics = {
            f"{metric_key_prefix}_loss": result["loss"],
            f"{metric_key_prefix}_accuracy": result["accuracy"],
        }
        return EvalLoopOutput(
            predictions=None, label_ids=None, metrics=metrics, num_samples=len(dataloader.dataset)
        )

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        raise SeqParConfigError(
            f"{type(self).__name__}.predict() returns the logits [N, S, V] of every sample, which sequence "
            "parallelism never gathers on one rank; valid: trainer.evaluate() (eval_loss, eval_accuracy), or "
            "predict with the saved model (trainer.save_model()) without sequence parallelism"
        )
