"""HF Trainer with sequence parallelism: ``SeqParTrainer`` instead of ``Trainer``, nothing else changes.

::

    args = TrainingArguments(output_dir="out", deepspeed="ds_configs/usp_zero3.json", use_cpu=True, ...)
    trainer = ds_seqpar.SeqParTrainer(model=model, args=args, train_dataset=dataset)
    trainer.train()

Any ``Trainer`` subclass gets the same behaviour through :func:`with_sequence_parallel`, e.g. TRL's
``with_sequence_parallel(SFTTrainer)(model=..., args=SFTConfig(...), train_dataset=...)``.

What it does on top of the base trainer, after the base ``__init__`` has run (so a subclass such as
TRL's ``SFTTrainer`` prepares its data, collator and arguments first):

* **the DeepSpeed config**: reads the ``"sequence_parallel"`` section of ``args.deepspeed``
  (``size: "auto"`` and every other ``"auto"`` of the section resolved by ds_seqpar) and removes it
  from the config that transformers and accelerate process, so their own ``"auto"`` handling never
  sees it; values that both the JSON and ``TrainingArguments`` own (learning rate, betas, eps,
  weight decay, clipping, micro batch, accumulation, precision) are reconciled by
  :func:`reconcile_training_arguments`;
* **HF's** ``ParallelismConfig`` (``args.parallelism_config``, ``sp_backend="deepspeed"``, ``sp_size=N``)
  states the SP size; the base Trainer's Accelerator never sees it, so no ALST runs
  (``integrations/parallelism_config.py``);
* builds the ``SeqParMesh``, switches the model's attention to ds_seqpar and trains
  ``SeqParCausalLM(model)`` (SP-group loss, chunked logits) with the gradient factor of the ZeRO stage;
* ``get_train_dataloader``: the sharding DataLoader (samples split over dp only; each batch padded,
  label-shifted and split over the SP ranks) around the trainer's own data collator;
* ``train``: runs inside ``sequence_parallel_scope(mesh)``, so accelerate's ``deepspeed.initialize``
  gets ds_seqpar's mpu and a config with ``sequence_parallel_size`` and a dp-based ``train_batch_size``;
  every training step runs under ``StepWatch`` (a failing, dead or hung rank is named with its step);
* saving writes the HF model (``save_pretrained``), not the wrapper;
* evaluation (``trainer.evaluate()``, ``eval_strategy``): sharded over the SP ranks and the dp replicas,
  token-weighted ``eval_loss`` and ``eval_accuracy`` (``trainer_eval.py``).

On CPU pass ``use_cpu=True`` to ``TrainingArguments`` and initialise torch.distributed before creating
them (``ds_seqpar.integrations.deepspeed.init_distributed()``), as for any DeepSpeed Trainer run there.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import json
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import Trainer

from ds_seqpar.comm.step_watch import StepWatch
from ds_seqpar.config import SECTION, SequenceParallelConfig, load_config, with_overrides
from ds_seqpar.data import seqpar_dataloader
from ds_seqpar.errors import SeqParConfigError
from ds_seqpar.integrations.deepspeed import init_distributed, sequence_parallel_scope, wrap_for_training
from ds_seqpar.integrations.parallelism_config import TrainerSizes, trainer_parallelism
from ds_seqpar.integrations.trainer_eval import SeqParEvaluationMixin, refuse_unhonoured_evaluation
from ds_seqpar.integrations.vision import whole_inputs_of
from ds_seqpar.mesh import SeqParMesh

# DeepSpeed keys that TrainingArguments also sets (transformers' HfTrainerDeepSpeedConfig checks them).
TRAINER_OWNED_KEYS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("train_micro_batch_size_per_gpu", ("per_device_train_batch_size",)),
    ("gradient_accumulation_steps", ("gradient_accumulation_steps",)),
    ("gradient_clipping", ("max_grad_norm",)),
    ("optimizer.params.lr", ("learning_rate",)),
    ("optimizer.params.betas", ("adam_beta1", "adam_beta2")),
    ("optimizer.params.eps", ("adam_epsilon",)),
    ("optimizer.params.weight_decay", ("weight_decay",)),
    ("scheduler.params.warmup_max_lr", ("learning_rate",)),
)
PRECISION_KEYS = (("fp16.enabled", "fp16"), ("bf16.enabled", "bf16"))
_SECTION_ATTR = "_ds_seqpar_section"


def _get(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(config: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
        node = node[part]
    node[last] = value


def _raw_config(deepspeed: Any) -> dict[str, Any]:
    """The DeepSpeed JSON as the user wrote it (transformers has replaced its "auto" values since)."""
    if isinstance(deepspeed, dict):
        return deepspeed
    with open(deepspeed, encoding="utf-8") as fh:
        return json.load(fh)


def _field_default(args: Any, name: str) -> Any:
    for f in dataclasses.fields(type(args)):
        if f.name == name:
            return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    raise KeyError(name)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def reconcile_training_arguments(args: Any) -> tuple[SequenceParallelConfig, dict[str, Any], list[str]]:
    """Make ``args`` (processed ``TrainingArguments`` with ``deepspeed=...``) and its config agree.

    Returns ``(section, ds_config, notices)``. In order:

    1. the ``"sequence_parallel"`` section is validated (``"auto"`` values resolved) and removed from
       ``args.hf_deepspeed_config.config``, the dict transformers and accelerate process;
    2. a key both sides own (``TRAINER_OWNED_KEYS``) that the JSON sets explicitly and
       ``TrainingArguments`` leaves at its default is adopted from the JSON, with a notice; when both
       are set and differ, :class:`SeqParConfigError` names every pair and the fix (write ``"auto"``
       in the JSON, HF's rule, or make them agree). Precision flags are never adopted: a mismatch
       raises;
    3. an explicit ``train_batch_size`` must equal micro batch x accumulation x dp (dp = world / size),
       not transformers' world-based product; it is then left to ds_seqpar, which sets it per mesh.

    Idempotent: a second call on the same ``args`` returns the section stored by the first.
    """
    hf = getattr(args, "hf_deepspeed_config", None)
    if hf is None:
        raise SeqParConfigError(
            "TrainingArguments has no processed DeepSpeed config; valid: TrainingArguments(deepspeed=<path or "
            "dict with a 'sequence_parallel' section>)"
        )
    config: dict[str, Any] = hf.config
    section, ds_config = _take_section(args, config)
    raw = _raw_config(args.deepspeed)
    was_auto = {key for key, _ in TRAINER_OWNED_KEYS if _get(raw, key) == "auto"}
    notices: list[str] = []
    conflicts: list[str] = []
    section = _checkpointing_flags(args, section, notices)
    _adopt_owned_keys(args, config, was_auto, notices, conflicts)
    _check_precision(args, config, conflicts)
    for key, fields in TRAINER_OWNED_KEYS:  # transformers filled these from TrainingArguments: refill them
        if key in was_auto:
            values = [getattr(args, f) for f in fields]
            _set(config, key, values[0] if len(fields) == 1 else values)
    _check_train_batch(args, config, raw, section, conflicts)
    if conflicts:
        raise SeqParConfigError(
            "the DeepSpeed config and TrainingArguments disagree: "
            + "; ".join(conflicts)
            + '; valid: write "auto" for these keys in the JSON (transformers fills them from TrainingArguments), '
            "or set the same values on both sides"
        )
    hf.mismatches.clear()
    hf.trainer_config_process(args)  # re-check with the adopted values; fills nothing that is set
    if hf.mismatches:
        raise SeqParConfigError(
            "the DeepSpeed config and TrainingArguments disagree:\n" + "\n".join(hf.mismatches)
        )
    return section, ds_config, notices


def _take_section(args: Any, config: dict[str, Any]) -> tuple[SequenceParallelConfig, dict[str, Any]]:
    """The validated section (removed from ``config``, remembered on ``args``) and the DeepSpeed dict."""
    stored = getattr(args, _SECTION_ATTR, None)
    if stored is not None and SECTION not in config:
        _, ds_config = load_config({**config, SECTION: stored.model_dump(exclude_unset=True)})
        return stored, ds_config
    section, ds_config = load_config(config)
    config.pop(SECTION, None)
    setattr(args, _SECTION_ATTR, section)
    return section, ds_config


def _checkpointing_flags(
    args: Any, section: SequenceParallelConfig, notices: list[str]
) -> SequenceParallelConfig:
    """``activation_checkpointing`` / ``gradient_checkpointing`` run as the section's layer checkpointing."""
    flags = [f for f in ("activation_checkpointing", "gradient_checkpointing") if getattr(args, f, False)]
    if not flags:
        return section
    # transformers would wrap the decoder layers itself; ds_seqpar's own layer checkpointing re-runs
    # each layer's sequence-parallel exchanges in backward and can offload the saved inputs
    kwargs = dict(
        getattr(args, "activation_checkpointing_kwargs", None)
        or getattr(args, "gradient_checkpointing_kwargs", None)
        or {}
    )
    if kwargs.get("every_n_layers", 1) != 1:
        raise SeqParConfigError(
            f"TrainingArguments.activation_checkpointing_kwargs every_n_layers={kwargs['every_n_layers']}: "
            "ds_seqpar checkpoints every layer; valid: remove every_n_layers"
        )
    memory = {**section.memory.model_dump(exclude_unset=True), "activation_checkpointing": True}
    if kwargs.get("offload"):
        memory["offload"] = True
    section = with_overrides(section, {"memory": memory}, section.size * (section.data_parallel_size or 1))
    setattr(args, _SECTION_ATTR, section)
    for f in flags:
        setattr(args, f, False)
    notices.append(
        f"TrainingArguments.{flags[0]}=True runs as sequence_parallel.memory.activation_checkpointing "
        f"(ds_seqpar's layer checkpointing{', offloaded' if kwargs.get('offload') else ''}); the Trainer's "
        "own wrapper is switched off"
    )
    return section


def _adopt_owned_keys(
    args: Any, config: dict[str, Any], was_auto: set[str], notices: list[str], conflicts: list[str]
) -> None:
    """A key both sides own that only the JSON sets is adopted from it; both set and different: a conflict."""
    for key, fields in TRAINER_OWNED_KEYS:
        if key in was_auto:  # transformers filled it from TrainingArguments; refilled after adoptions
            continue
        ds_val = _get(config, key)
        hf_val = [getattr(args, f) for f in fields]
        hf_val = hf_val[0] if len(fields) == 1 else hf_val
        if ds_val is None or ds_val == "auto" or _same(ds_val, hf_val):
            continue
        defaults = [_field_default(args, f) for f in fields]
        if not _same(hf_val, defaults[0] if len(fields) == 1 else defaults):
            conflicts.append(
                f"{key}={ds_val!r} in the DeepSpeed config vs TrainingArguments.{'+'.join(fields)}={hf_val!r}"
            )
            continue
        values = ds_val if len(fields) > 1 else [ds_val]
        if len(values) != len(fields):
            conflicts.append(f"{key}={ds_val!r} needs {len(fields)} values for TrainingArguments {fields}")
            continue
        for f, v in zip(fields, values, strict=True):
            setattr(args, f, v)
        notices.append(
            f"TrainingArguments.{'+'.join(fields)} follows the DeepSpeed config's {key}={ds_val!r} "
            f'(TrainingArguments had its default {hf_val!r}; write "auto" there to use TrainingArguments)'
        )


def _check_precision(args: Any, config: dict[str, Any], conflicts: list[str]) -> None:
    """Precision flags are never adopted: a mismatch is a conflict."""
    for key, flag in PRECISION_KEYS:
        ds_val = _get(config, key)
        hf_val = bool(getattr(args, flag) or getattr(args, f"{flag}_full_eval"))
        if isinstance(ds_val, bool) and ds_val != hf_val:
            conflicts.append(f"{key}={ds_val} in the DeepSpeed config vs TrainingArguments.{flag}={hf_val}")


def _check_train_batch(
    args: Any, config: dict[str, Any], raw: Any, section: SequenceParallelConfig, conflicts: list[str]
) -> None:
    """An explicit ``train_batch_size`` must be micro x accumulation x dp; it is then left to ds_seqpar."""
    micro, gas = int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps)
    explicit_batch = config.pop("train_batch_size", None)
    if _get(raw, "train_batch_size") == "auto":
        explicit_batch = None  # transformers filled world x micro x accumulation; ds_seqpar sets it over dp
    world = dist.get_world_size() if dist.is_initialized() else args.world_size
    dp = world // section.size
    if explicit_batch is not None and explicit_batch != micro * gas * dp:
        conflicts.append(
            f"train_batch_size={explicit_batch} in the DeepSpeed config vs micro batch {micro} x accumulation {gas} "
            f"x dp {dp} = {micro * gas * dp} (dp = world {world} / sequence_parallel.size {section.size})"
        )


def _refuse_unhonoured_arguments(args: Any, eval_dataset: Any) -> None:
    """``TrainingArguments`` that the sharded data path does not honour raise by name, before training."""
    problems = []
    sampling = getattr(args, "train_sampling_strategy", "random")
    if sampling != "random":
        problems.append(
            f"train_sampling_strategy={sampling!r} (the sampler splits samples over dp in a seeded random order)"
        )
    if problems:
        raise SeqParConfigError(
            "TrainingArguments the sequence-parallel trainer does not honour: "
            + "; ".join(problems)
            + "; valid: train_sampling_strategy='random'"
        )


def trainer_argument(trainer: Any, name: str, trainer_args: tuple, trainer_kwargs: dict[str, Any]) -> Any:
    """The value of the base trainer's ``__init__`` argument ``name`` in this call (positional or keyword)."""
    if name in trainer_kwargs:
        return trainer_kwargs[name]
    base = next(
        c for c in type(trainer).__mro__ if issubclass(c, Trainer) and not issubclass(c, SeqParTrainerMixin)
    )
    params = [p for p in inspect.signature(base.__init__).parameters.values() if p.name != "self"]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    index = positional.index(name) if name in positional else len(trainer_args)
    return trainer_args[index] if index < len(trainer_args) else None


def _model_config(model: Any) -> Any:
    """The HF config of the trainer's ``model`` argument (a model, or a path TRL loads), or None."""
    if isinstance(model, str):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model)
    return getattr(model, "config", None)


class SeqParTrainerMixin(TrainerSizes, SeqParEvaluationMixin):
    """The sequence-parallel behaviour of :class:`SeqParTrainer`, for any ``transformers.Trainer`` subclass.

    Args (on top of the base trainer's):
        pad_token_id: id used to pad sequences to the layout's multiple (default: the processing
            class's pad token, else 0).
        loss_chunk_size: tokens per logits chunk in the loss.

    The mesh is built before the base ``__init__`` runs, which runs inside ``sequence_parallel_scope`` (a
    reference model that a TRL trainer prepares with DeepSpeed gets the mesh's config). Subclasses for
    trainers that compute their own loss from log-probs (``integrations/trl_trainers.py``) set
    ``seqpar_wrapper`` (the model wrapper class) and ``seqpar_owns_loss = False``.
    """

    seqpar_wrapper: type | None = None  # None: wrap_for_training's choice for the model
    seqpar_owns_loss = True  # the wrapper's forward returns the SP group's loss

    def __init__(
        self,
        *trainer_args: Any,
        pad_token_id: int | None = None,
        loss_chunk_size: int = 1024,
        **trainer_kwargs: Any,
    ) -> None:
        args = trainer_argument(self, "args", trainer_args, trainer_kwargs)
        if args is None or not getattr(args, "deepspeed", None):
            raise SeqParConfigError(
                f"{type(self).__name__} needs TrainingArguments(deepspeed=<config with a 'sequence_parallel' "
                "section>), e.g. deepspeed='ds_configs/usp_zero3.json'"
            )
        # HF's ParallelismConfig may state the SP size; the base Trainer's Accelerator never sees it
        with trainer_parallelism(args) as first:  # (integrations/parallelism_config.py)
            # the section's fault_timeout_s bounds every collective (an existing process group keeps its own)
            init_distributed(first.fault_timeout_s)
            model_config = _model_config(trainer_argument(self, "model", trainer_args, trainer_kwargs))
            mesh = SeqParMesh.from_config(first, model_config)
            with sequence_parallel_scope(mesh):
                super().__init__(*trainer_args, **trainer_kwargs)
        section, ds_config, notices = reconcile_training_arguments(self.args)
        _refuse_unhonoured_arguments(self.args, self.eval_dataset)
        if self.eval_dataset is not None and self.seqpar_owns_loss:  # evaluation: trainer_eval.py
            refuse_unhonoured_evaluation(self)
        self._train_batch_size = self.args.train_batch_size  # the base read it before the JSON's micro batch
        if dist.get_rank() == 0:
            for line in notices:
                print(f"ds_seqpar: {line}", flush=True)
        model = self.model
        self.seqpar_mesh = mesh.with_section(section, getattr(model, "config", None))
        if pad_token_id is None:
            pad_token_id = getattr(getattr(self, "processing_class", None), "pad_token_id", None)
        self.seqpar_pad_token_id = 0 if pad_token_id is None else int(pad_token_id)
        wrapped = wrap_for_training(model, self.seqpar_mesh, ds_config, loss_chunk_size, self.seqpar_wrapper)
        self.model = self.model_wrapped = wrapped
        self.seqpar_objective = wrapped.objective  # how the data loader shards labels
        if (
            self.seqpar_owns_loss
        ):  # the loss is already the SP group's token mean: the Trainer divides by accumulation
            self.model_accepts_loss_kwargs = False
        self.seqpar_watch: StepWatch | None = None

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError(f"{type(self).__name__}: training requires a train_dataset")
        args = self.args
        workers = {"num_workers": args.dataloader_num_workers, "pin_memory": args.dataloader_pin_memory}
        if args.dataloader_num_workers > 0:
            workers.update(
                persistent_workers=args.dataloader_persistent_workers,
                prefetch_factor=args.dataloader_prefetch_factor,
            )
        return seqpar_dataloader(
            self.train_dataset,
            self.seqpar_mesh,
            args.per_device_train_batch_size,
            collate_fn=self.data_collator,
            shuffle=True,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            pad_token_id=self.seqpar_pad_token_id,
            drop_last=args.dataloader_drop_last,
            objective=self.seqpar_objective,
            whole=whole_inputs_of(self.model),
            **workers,
        )

    def get_total_train_batch_size(self, args: Any) -> int:
        """Samples per optimizer step: micro batch x accumulation x dp (the SP ranks share each sample)."""
        return args.per_device_train_batch_size * args.gradient_accumulation_steps * self.seqpar_mesh.dp_size

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        wrapped = getattr(model, "module", model)
        if hasattr(wrapped, "step"):
            wrapped.step = self.state.global_step  # sparse.dense_warmup_steps counts optimizer steps
        loss = model(**inputs)
        return (loss, None) if return_outputs else loss

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The base step (forward, backward, DeepSpeed's optimizer step) under ``StepWatch``."""
        if self.seqpar_watch is None:
            return super().training_step(*args, **kwargs)
        with self.seqpar_watch.step(self.state.global_step + 1):
            return super().training_step(*args, **kwargs)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        self.seqpar_watch = StepWatch()
        try:
            with sequence_parallel_scope(self.seqpar_mesh):
                return super().train(*args, **kwargs)
        finally:
            self.seqpar_watch.close()
            self.seqpar_watch = None

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Save the wrapped HF model with ``save_pretrained`` (the wrapper's ``model.`` prefix removed)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        inner = self.accelerator.unwrap_model(self.model).model
        if state_dict is not None:
            state_dict = {k.removeprefix("model."): v for k, v in state_dict.items()}
        if self.args.should_save:
            inner.save_pretrained(output_dir, state_dict=state_dict)
            if getattr(self, "processing_class", None) is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, f"{output_dir}/training_args.bin")


# trainer classes (module, name) whose training needs more than the SP loss: where the mixin that adds it lives
# ("module:attribute", imported on first use: TRL is a heavy import)
TRAINER_MIXINS: dict[tuple[str, str], str] = {
    ("trl.trainer.grpo_trainer", "GRPOTrainer"): "ds_seqpar.integrations.trl_trainers:GRPOSeqParMixin",
    ("trl.trainer.dpo_trainer", "DPOTrainer"): "ds_seqpar.integrations.trl_trainers:DPOSeqParMixin",
}
# TRL trainers that train with the plain SP loss (the sharding DataLoader, SeqParCausalLM's forward)
PLAIN_TRL_TRAINERS = ("SFTTrainer",)


def register_trainer_mixin(module: str, name: str, mixin: str) -> None:
    """Make ``with_sequence_parallel`` add the mixin at ``mixin`` (``"package.module:Class"``, a
    ``SeqParTrainerMixin`` subclass) for the trainer class ``module.name`` and its subclasses."""
    TRAINER_MIXINS[(module, name)] = mixin


def _mixin_for(trainer_class: type) -> type:
    for cls in trainer_class.__mro__:
        found = TRAINER_MIXINS.get((cls.__module__, cls.__name__))
        if found is not None:
            module, _, attribute = found.partition(":")
            return getattr(importlib.import_module(module), attribute)
    trl = [c.__name__ for c in trainer_class.__mro__ if c.__module__.startswith("trl.")]  # most derived first
    if trl and not set(trl) & set(PLAIN_TRL_TRAINERS):
        supported = sorted({*PLAIN_TRL_TRAINERS, *(n for m, n in TRAINER_MIXINS if m.startswith("trl."))})
        raise SeqParConfigError(
            f"with_sequence_parallel({trainer_class.__name__}): TRL's {trl[0]} is not supported under sequence "
            f"parallelism (its data, generation or loss would not be split over the SP group); valid: "
            f"{', '.join(supported)}"
        )
    return SeqParTrainerMixin


@functools.cache
def with_sequence_parallel(trainer_class: type) -> type:
    """``trainer_class`` (a ``transformers.Trainer`` subclass, e.g. TRL's ``SFTTrainer``, ``GRPOTrainer``,
    ``DPOTrainer``) with sequence parallelism.

    ``with_sequence_parallel(SFTTrainer)(model=..., args=SFTConfig(deepspeed=...), ...)`` is the one-line
    change; the returned class is cached, so repeated calls give the same class. TRL's GRPO and DPO trainers
    get their mixins from ``TRAINER_MIXINS`` (``integrations/trl_trainers.py``); other TRL trainers are refused
    by name.
    """
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(
            f"with_sequence_parallel() takes a transformers.Trainer subclass; got {trainer_class!r}"
        )
    if issubclass(trainer_class, SeqParTrainerMixin):
        return trainer_class
    return type(f"SeqPar{trainer_class.__name__}", (_mixin_for(trainer_class), trainer_class), {})


class SeqParTrainer(SeqParTrainerMixin, Trainer):
    """``transformers.Trainer`` for causal LMs under sequence parallelism (see the module docstring)."""
