"""TRL's GRPO and DPO trainers under sequence parallelism: ``with_sequence_parallel(GRPOTrainer)`` / ``(DPOTrainer)``.

Legend: W = world, P = SP degree, dp = W / P data-parallel replicas.

In one process TRL's trainers treat every process as a replica with samples of its own: the sampler splits
prompts (pairs) over ``accelerator.num_processes``, the rewards are gathered over every process and sliced
back by ``accelerator.process_index``. Under sequence parallelism the P ranks of an SP group share their
samples and split each sequence instead. So, for these trainers only:

* **data-parallel view** (:func:`data_parallel_view`): the trainer's accelerator reports
  ``num_processes = dp`` and ``process_index = dp rank``, and its ``gather`` / ``gather_for_metrics`` /
  ``reduce`` run over the dp group (the ranks with the same SP rank); TRL's module-level ``gather`` and
  ``gather_object`` are rebound to the same dp collectives while the trainer trains or evaluates
  (:func:`dp_collectives`). Every rank of an SP group then holds its replica's prompts, completions,
  rewards and advantages, exactly those one process of a dp-process run would hold. ``is_main_process``
  (logging, saving) stays the world's rank 0.
* **the model**: ``SeqParFusedLM`` (``integrations/fused_head.py``) answers TRL's fused-head calls
  (``model(input_ids, attention_mask, labels, fused_lm_head=True).log_probs``) by sharding the rows over the
  group and gathering the log-probs; the reference model (``ref_model``, prepared by TRL) gets the same
  wrapper. TRL's loss then runs unchanged on every rank of the group, on identical tensors.
* **generation** stays TRL's: ``generate`` of the plain model (ZeRO-3 gathers its parameters), then the SP
  group's first rank broadcasts its completions to the others, so the group scores one set of samples.

What SP cannot honour is refused by name at construction (:data:`REFUSED_OPTIONS`, tested).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ds_seqpar.config import SeqParConfigError
from ds_seqpar.integrations.fused_head import SeqParFusedLM
from ds_seqpar.integrations.trainer import SeqParTrainerMixin, reconcile_training_arguments, trainer_argument
from ds_seqpar.integrations.trainer_eval import SeqParEvaluationMixin
from ds_seqpar.mesh import SeqParMesh

__all__ = ["DPOSeqParMixin", "GRPOSeqParMixin", "data_parallel_view", "dp_collectives"]

# (trainer, option, the value SP honours, why) for options that change what is computed
REFUSED_OPTIONS: tuple[tuple[str, str, Any, str], ...] = (
    ("GRPO", "use_vllm", False, "vLLM generation is not wired to the SP group's broadcast in this release"),
    (
        "GRPO",
        "use_transformers_continuous_batching",
        False,
        "continuous batching generates outside generate()",
    ),
    ("GRPO", "top_entropy_quantile", 1.0, "the entropy quantile is taken over TRL's world gather"),
    ("GRPO", "cast_lm_head_to_fp32", False, "the SP log-probs run the model's own head in its dtype"),
    (
        "DPO",
        "precompute_ref_log_probs",
        False,
        "the precompute pass runs the plain model outside the SP group",
    ),
    ("DPO", "use_liger_kernel", False, "Liger's fused loss replaces the fused head"),
    ("GRPO", "use_liger_kernel", False, "Liger's fused loss replaces the fused head"),
    ("DPO", "padding_free", False, "TRL disables it; ds_seqpar shards padded rows"),
)


def _dp_gather(data: Any, group: Any, size: int) -> Any:
    """accelerate's ``gather`` over ``group``: tensors concatenated along dim 0 (scalars stacked), nested."""
    if isinstance(data, torch.Tensor):
        t = (data if data.dim() else data[None]).contiguous()
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t, group=group)
        return torch.cat(parts)
    if isinstance(data, Mapping):
        return type(data)({k: _dp_gather(v, group, size) for k, v in data.items()})
    if isinstance(data, (list, tuple)):
        return type(data)(_dp_gather(v, group, size) for v in data)
    return data


def _dp_gather_object(obj: Any, group: Any, size: int) -> list[Any]:
    """accelerate's ``gather_object`` over ``group``: every member's list, concatenated in member order."""
    parts: list[Any] = [None] * size
    dist.all_gather_object(parts, obj, group=group)
    return [x for part in parts for x in part]


class _DataParallelView:
    """Mixed into the trainer's accelerator class: its data-level view is the dp group (module docstring)."""

    _seqpar_mesh: SeqParMesh

    @property
    def num_processes(self) -> int:
        return self._seqpar_mesh.dp_size

    @property
    def process_index(self) -> int:
        return self._seqpar_mesh.coords.dp_rank

    def gather(self, tensor: Any) -> Any:
        mesh = self._seqpar_mesh
        return _dp_gather(tensor, mesh.group("dp"), mesh.dp_size)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        mesh = self._seqpar_mesh
        if use_gather_object or not isinstance(input_data, (torch.Tensor, Mapping, list, tuple)):
            return _dp_gather_object(input_data if isinstance(input_data, list) else [input_data],
                                     mesh.group("dp"), mesh.dp_size)  # fmt: skip
        return self.gather(input_data)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"reduce under sequence parallelism takes a tensor; got {type(tensor).__name__}")
        out = tensor.clone()
        dist.all_reduce(out, group=self._seqpar_mesh.group("dp"))
        if reduction == "mean":
            out = out / self._seqpar_mesh.dp_size
        return out * scale


def data_parallel_view(accelerator: Any, mesh: SeqParMesh) -> None:
    """Give ``accelerator`` (this trainer's own) the data-parallel view of the module docstring."""
    base = type(accelerator)
    if not issubclass(base, _DataParallelView):
        accelerator.__class__ = type(f"SeqPar{base.__name__}", (_DataParallelView, base), {})
    accelerator._seqpar_mesh = mesh


@contextlib.contextmanager
def dp_collectives(trainer_class: type, mesh: SeqParMesh) -> Iterator[None]:
    """While inside, the module-level ``gather`` / ``gather_object`` of the TRL modules that define
    ``trainer_class``'s methods run over the dp group (restored on exit)."""
    group, size = mesh.group("dp"), mesh.dp_size
    replacements = {
        "gather": lambda data: _dp_gather(data, group, size),
        "gather_object": lambda obj: _dp_gather_object(obj, group, size),
    }
    saved: list[tuple[Any, str, Any]] = []
    modules = {sys.modules[c.__module__] for c in trainer_class.__mro__ if c.__module__.startswith("trl.")}
    for module in modules:
        for name, fn in replacements.items():
            if name in vars(module):
                saved.append((module, name, vars(module)[name]))
                setattr(module, name, fn)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def refuse_unhonoured_options(kind: str, args: Any) -> None:
    """Every TRL option of :data:`REFUSED_OPTIONS` set to another value raises, naming all of them."""
    problems = [
        f"{option}={getattr(args, option)!r} ({why})"
        for trainer, option, honoured, why in REFUSED_OPTIONS
        if trainer == kind and hasattr(args, option) and getattr(args, option) != honoured
    ]
    if problems:
        valid = ", ".join(f"{o}={v!r}" for t, o, v, _ in REFUSED_OPTIONS if t == kind)
        raise SeqParConfigError(
            f"{kind} options that sequence parallelism does not honour: "
            + "; ".join(problems)
            + f"; valid: {valid}"
        )


class TRLSeqParMixin(SeqParTrainerMixin):
    """What GRPO and DPO share: the data-parallel view, TRL's own data and loss, the fused-head wrappers."""

    seqpar_wrapper = SeqParFusedLM
    seqpar_owns_loss = False
    seqpar_kind = ""  # "GRPO" / "DPO": the rows of REFUSED_OPTIONS that apply

    def __init__(self, *trainer_args: Any, **trainer_kwargs: Any) -> None:
        args = trainer_argument(self, "args", trainer_args, trainer_kwargs)
        if args is not None and getattr(args, "deepspeed", None):
            refuse_unhonoured_options(self.seqpar_kind, args)
            # values the JSON owns (micro batch, accumulation, ...) adopted before TRL derives its batches from them
            reconcile_training_arguments(args)
            self._seqpar_arguments(args)
        super().__init__(*trainer_args, **trainer_kwargs)
        mesh = self.seqpar_mesh
        data_parallel_view(self.accelerator, mesh)
        self.model.pad_token_id = self.seqpar_pad_token_id
        if hasattr(self.model.model, "disable_adapter") and self.args.hf_deepspeed_config.is_zero3():
            raise SeqParConfigError(
                f"{self.seqpar_kind} with a PEFT adapter under ZeRO-3 is not supported under sequence parallelism yet "
                "(the frozen LM head's recomputed log-prob chunks meet a released ZeRO-3 partition in backward); "
                "valid: zero_optimization.stage 1 or 2 for adapter training (tested equal to TRL), or full fine-tuning"
            )
        ref = getattr(self, "ref_model", None)
        if ref is not None:
            inner = getattr(ref, "module", ref)
            self.ref_model = SeqParFusedLM(inner, mesh, loss_chunk_size=self.model.loss_chunk_size)
            self.ref_model.pad_token_id = self.seqpar_pad_token_id
            self.ref_model.fused_outputs = ("log_probs",)
        elif self._seqpar_needs_reference() and hasattr(self.model.model, "disable_adapter"):
            self.ref_model = _AdapterOffReference(self)

    def _seqpar_needs_reference(self) -> bool:
        return True

    def _seqpar_arguments(self, args: Any) -> None:
        """Check or adjust the TRL config once its values are final, before the base ``__init__``."""

    # TRL's own data (whole rows on every rank of the group, split over dp by the view), loss and evaluation:
    # the base trainer's methods, past SeqParTrainerMixin's sharding loader and SeqParEvaluationMixin's loop
    def get_train_dataloader(self) -> Any:
        return super(SeqParEvaluationMixin, self).get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        return super(SeqParEvaluationMixin, self).get_eval_dataloader(eval_dataset)

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        return super(SeqParEvaluationMixin, self).evaluation_loop(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        return super(SeqParEvaluationMixin, self).predict(*args, **kwargs)

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        return super(SeqParEvaluationMixin, self).compute_loss(*args, **kwargs)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        with dp_collectives(type(self), self.seqpar_mesh):
            return super().train(*args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        with dp_collectives(type(self), self.seqpar_mesh):
            return super(SeqParEvaluationMixin, self).evaluate(*args, **kwargs)


class _AdapterOffReference:
    """The reference model of a PEFT run: the policy with its adapters disabled (what TRL does in one process),
    called like a fused-head model; TRL's own branch would look for the adapters on the SP wrapper."""

    def __init__(self, trainer: Any) -> None:
        peft = trainer.model.model
        if "ref" in getattr(peft, "peft_config", {}):
            raise SeqParConfigError(
                "a PEFT model with a 'ref' adapter (TRL's copy of an adapter being re-trained) is not supported under "
                "sequence parallelism; valid: train a new adapter (peft_config=...) or pass ref_model"
            )
        self.trainer = trainer

    def __call__(self, **kwargs: Any) -> Any:
        trainer = self.trainer
        runner = getattr(trainer, "deepspeed", None) or trainer.model  # the engine once train() made one
        with torch.no_grad(), trainer.model.model.disable_adapter():
            return runner(**kwargs)


class GRPOSeqParMixin(TRLSeqParMixin):
    """``with_sequence_parallel(GRPOTrainer)``: generation batches over dp, completions shared by the SP group."""

    seqpar_kind = "GRPO"

    def _seqpar_needs_reference(self) -> bool:
        return self.beta != 0.0

    def __init__(self, *trainer_args: Any, **trainer_kwargs: Any) -> None:
        super().__init__(*trainer_args, **trainer_kwargs)
        self.model.temperature = self.temperature
        self.model.fused_outputs = ("log_probs", "entropy")
        if isinstance(self.ref_model, SeqParFusedLM):
            self.ref_model.temperature = self.temperature

    def _seqpar_arguments(self, args: Any) -> None:
        _generation_batches_over_dp(args)

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's generation on every rank, then the SP group's first rank's completions for the whole group (the
        reward functions see the same completions on every rank)."""
        return tuple(_from_sp_leader(list(super()._generate_single_turn(*args, **kwargs)), self.seqpar_mesh))

    def _prepare_inputs(self, generation_batch: Any) -> Any:
        """TRL's step inputs (the rows, advantages, old and reference log-probs) of the SP group's first rank on
        every rank of the group: TRL shuffles the generation batch with each rank's own random state."""
        return _from_sp_leader([super()._prepare_inputs(generation_batch)], self.seqpar_mesh)[0]


def _from_sp_leader(objects: list[Any], mesh: SeqParMesh) -> list[Any]:
    """``objects`` as the SP group's first rank holds them (one pickled broadcast over the group)."""
    if mesh.sp_size > 1:
        dist.broadcast_object_list(objects, src=mesh.members["sp"][0], group=mesh.group("sp"))
    return objects


def _generation_batches_over_dp(args: Any) -> None:
    """GRPOConfig counted its generation batch over every process; under SP the replicas are the dp ranks."""
    section = reconcile_training_arguments(args)[0]
    dp = (dist.get_world_size() if dist.is_initialized() else args.world_size) // section.size
    args.generation_batch_size = args.per_device_train_batch_size * dp * args.steps_per_generation
    if args.generation_batch_size % args.num_generations:
        raise SeqParConfigError(
            f"GRPO generation batch {args.generation_batch_size} (per_device_train_batch_size "
            f"{args.per_device_train_batch_size} x dp {dp} x steps_per_generation {args.steps_per_generation}; the "
            f"{section.size} SP ranks of a replica share its prompts) is not a multiple of num_generations="
            f"{args.num_generations}; valid: make per_device_train_batch_size x dp x steps_per_generation a multiple of it"
        )
    evals = args.num_generations_eval or args.num_generations
    if (args.per_device_eval_batch_size * dp) % evals:
        raise SeqParConfigError(
            f"GRPO eval batch per_device_eval_batch_size {args.per_device_eval_batch_size} x dp {dp} is not a multiple "
            f"of num_generations_eval={evals}; valid: a per_device_eval_batch_size that makes it one"
        )


class DPOSeqParMixin(TRLSeqParMixin):
    """``with_sequence_parallel(DPOTrainer)``: chosen / rejected log-probs over the SP group."""

    seqpar_kind = "DPO"

    def __init__(self, *trainer_args: Any, **trainer_kwargs: Any) -> None:
        super().__init__(*trainer_args, **trainer_kwargs)
        outputs = ("log_probs", "entropy", "mean_logits", "is_top1")
        if getattr(self.args, "use_weighting", False):
            outputs += ("log_sum_sq_probs",)
        self.model.fused_outputs = outputs
