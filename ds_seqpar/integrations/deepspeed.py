"""``ds_seqpar.initialize``: ``deepspeed.initialize`` with the ``"sequence_parallel"`` section honoured.

Same arguments and returns as ``deepspeed.initialize`` (``engine, optimizer, training_dataloader,
lr_scheduler``). In order, before anything trains:

1. read and validate the section (``load_config``), initialise torch.distributed if needed (gloo on
   CPU, NCCL on GPU, DeepSpeed's launcher environment), check the world size and the model's heads;
2. build the ``SeqParMesh``, switch the model's attention to ds_seqpar and wrap it in
   ``SeqParCausalLM`` (sharded batch in, SP-group loss out) with the gradient factor of the ZeRO
   stage;
3. call ``deepspeed.initialize`` with the mesh's ``mpu``, so ZeRO-1/2/3 partition and reduce over
   dp x sp while the data sampler uses dp only;
4. wrap ``training_data`` into the sharding DataLoader (``ds_seqpar.data.seqpar_dataloader``).

A JSON optimizer of type Adam/AdamW on CPU gets ``"torch_adam": true`` unless the config says
otherwise, because DeepSpeed's CPU Adam is a JIT-compiled op (minutes on a fresh machine).

``import ds_seqpar`` also guards plain ``deepspeed.initialize``: a config that carries a
``"sequence_parallel"`` section and reaches it directly fails with a message pointing here,
instead of training silently without sequence parallelism. Inside ``sequence_parallel_scope(mesh)``
(what ``SeqParTrainer.train`` uses) calls made by others, e.g. accelerate for the HF Trainer, get the
mesh's mpu and a config rewritten for it instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ds_seqpar.config import SECTION, SeqParConfigError, load_config
from ds_seqpar.data import seqpar_dataloader
from ds_seqpar.integrations.causal_lm import SeqParCausalLM, SeqParMaskedLM
from ds_seqpar.integrations.dit import SeqParDiT, check_no_dit_settings, dit_section, is_dit
from ds_seqpar.integrations.hf_model import objective_of, unwrap_hf_model
from ds_seqpar.integrations.parallelism_config import install_trainer_guard
from ds_seqpar.integrations.vision import SeqParVisionLM, is_vision_lm
from ds_seqpar.loss import sp_grad_scale
from ds_seqpar.mesh import SeqParMesh, group_timeout_s

_GUARD_BYPASS = "_ds_seqpar_initialize"


def init_distributed(timeout_s: float | None = None) -> None:
    """Initialise torch.distributed through DeepSpeed (gloo on CPU, NCCL on CUDA), once.

    ``timeout_s`` (``sequence_parallel.fault_timeout_s``) is the default group's timeout: it bounds every
    collective on it (ZeRO's gathers and reduce-scatters, the checkpoint barriers) and the rendezvous
    store's waits; the mesh gives its own groups the same timeout. An existing process group keeps its own
    timeout; a warning says so when it is longer. On NCCL the timeout is the watchdog's: by default a rank
    whose collective times out is aborted by torch's watchdog (no ``StepFailed``); with
    ``TORCH_NCCL_BLOCKING_WAIT=1`` the collective raises in Python instead, so ``StepWatch`` names the
    rank at fault (docs/reliability.md "A failed, dead or hung rank is named, within a bounded time").
    """
    import datetime
    import warnings

    import deepspeed

    # DeepSpeed 0.19.8 calls torch.distributed functions that torch 2.13 renamed: one warning per call is noise
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )

    if not torch.cuda.is_available():
        # DeepSpeed JIT-builds a shared-memory comm op on CPU (~1 min on a fresh machine) the first
        # time its comm layer starts, even over an existing process group; gloo needs none.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not dist.is_initialized():
        kwargs = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", **kwargs)
    elif timeout_s is not None:
        _warn_longer_timeout(timeout_s)


def _warn_longer_timeout(timeout_s: float) -> None:
    """Warn when the existing default group waits longer than ``fault_timeout_s`` for a peer."""
    existing = group_timeout_s()
    if existing is not None and existing > timeout_s:
        logging.getLogger("ds_seqpar").warning(
            "torch.distributed was initialised before ds_seqpar with a timeout of %g s, longer than "
            "sequence_parallel.fault_timeout_s=%g s: collectives on the default group (ZeRO's gathers, "
            "checkpoint barriers) wait up to %g s for a failed peer; pass timeout=datetime.timedelta("
            "seconds=%g) to init_process_group (HF Trainer: --ddp_timeout %g)",
            existing, timeout_s, existing, timeout_s, timeout_s,
        )  # fmt: skip


def _avoid_jit_optimizer(ds_config: dict[str, Any]) -> None:
    opt = ds_config.get("optimizer")
    if not isinstance(opt, dict) or torch.cuda.is_available():
        return
    if str(opt.get("type", "")).lower() in {"adam", "adamw"}:
        params = opt.setdefault("params", {})
        params.setdefault("torch_adam", True)


def zero_stage(ds_config: dict[str, Any]) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def initialize(
    model: torch.nn.Module,
    config: str | os.PathLike[str] | dict[str, Any],
    model_parameters: Any = None,
    optimizer: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    *,
    collate_fn: Callable[..., dict[str, Any]] | None = None,
    pad_token_id: int = 0,
    shuffle: bool = True,
    seed: int = 0,
    loss_chunk_size: int = 1024,
    **deepspeed_kwargs: Any,
) -> tuple[Any, Any, Any, Any]:
    """Sequence-parallel ``deepspeed.initialize``; returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    Args:
        model: a HuggingFace causal LM (random-init or ``from_pretrained``).
        config: DeepSpeed config path or dict with a ``"sequence_parallel"`` section.
        model_parameters, optimizer, lr_scheduler: as for ``deepspeed.initialize`` (a client
            optimizer such as ``torch.optim.AdamW`` needs no compiled op).
        training_data: a map-style dataset of examples with ``input_ids`` (and optionally
            ``labels``, ``attention_mask``, ``position_ids``); wrapped in the sharding DataLoader.
        collate_fn: builds a full batch from examples (default: stack), before sharding.
        deepspeed_kwargs: passed to ``deepspeed.initialize``.

    The engine's forward takes the sharded batch (``engine(**batch)``) and returns the SP-group loss.
    """
    import deepspeed

    section, ds_config = load_config(config)
    if not section.enabled:
        raise SeqParConfigError(
            f"{SECTION}.enabled is false; call deepspeed.initialize with the config instead of ds_seqpar.initialize"
        )
    init_distributed(section.fault_timeout_s)
    if is_dit(model):
        section = dit_section(section)
    mesh = SeqParMesh.from_config(section, getattr(model, "config", None))  # validates before any collective
    _avoid_jit_optimizer(ds_config)
    wrapped = wrap_for_training(model, mesh, ds_config, loss_chunk_size)
    if model_parameters is None and optimizer is None:
        model_parameters = wrapped.parameters()
    engine, opt, _, sched = deepspeed.initialize(
        model=wrapped,
        model_parameters=model_parameters,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        config={**ds_config, _GUARD_BYPASS: True},
        mpu=mesh.mpu(),
        **deepspeed_kwargs,
    )
    loader = sharding_loader(training_data, wrapped, ds_config, collate_fn, shuffle, seed, pad_token_id)
    engine.seqpar_mesh = mesh
    return engine, opt, loader, sched


def wrap_for_training(
    model: torch.nn.Module,
    mesh: SeqParMesh,
    ds_config: dict[str, Any],
    loss_chunk_size: int,
    cls: type | None = None,
) -> SeqParCausalLM:
    """``SeqParCausalLM(model)`` (``SeqParMaskedLM`` for a masked-LM model, see ``objective_of``;
    ``SeqParSeq2SeqLM`` for an encoder-decoder; ``SeqParVisionLM`` for a vision-language model; ``SeqParDiT`` for a diffusers transformer; ``cls`` when given) with the gradient factor of the config's
    ZeRO stage (``sp_grad_scale``)."""
    from ds_seqpar.integrations.seq2seq import SeqParSeq2SeqLM

    grad_scale = sp_grad_scale(zero_stage(ds_config), mesh.sp_size)
    if cls is None:
        cls = SeqParMaskedLM if objective_of(model) == "masked" else SeqParCausalLM
        if is_vision_lm(model):
            cls = SeqParVisionLM
        if getattr(getattr(unwrap_hf_model(model), "config", None), "is_encoder_decoder", False):
            cls = SeqParSeq2SeqLM
        if is_dit(model):
            cls = SeqParDiT
    if cls is not SeqParDiT:
        check_no_dit_settings(mesh.settings, type(model).__name__)
    return cls(model, mesh, grad_scale=grad_scale, loss_chunk_size=loss_chunk_size)


def sharding_loader(
    dataset: Any,
    wrapped: SeqParCausalLM,
    ds_config: dict[str, Any],
    collate_fn: Callable[..., dict[str, Any]] | None,
    shuffle: bool,
    seed: int,
    pad_token_id: int,
) -> Any:
    """The sharding DataLoader over ``dataset`` for the model wrapper ``wrapped`` (its mesh, its objective, its
    ``whole_inputs`` passed on unsharded) at the config's micro batch (None without a dataset)."""
    if dataset is None:
        return None
    micro = int(ds_config.get("train_micro_batch_size_per_gpu", 1))
    if isinstance(wrapped, SeqParDiT):
        return wrapped.loader(dataset, micro, collate_fn, shuffle, seed)
    return seqpar_dataloader(
        dataset,
        wrapped.mesh,
        micro,
        collate_fn=collate_fn,
        shuffle=shuffle,
        seed=seed,
        pad_token_id=pad_token_id,
        objective=wrapped.objective,
        whole=wrapped.whole_inputs,
    )


# The mesh of a SeqParTrainer while it trains: set only inside ``sequence_parallel_scope`` so that
# accelerate's own call of deepspeed.initialize (which takes no mpu) gets ours.
_SCOPED_MESH: contextvars.ContextVar[SeqParMesh | None] = contextvars.ContextVar(
    "ds_seqpar_mesh", default=None
)


@contextlib.contextmanager
def sequence_parallel_scope(mesh: SeqParMesh) -> Iterator[None]:
    """Inside this block, ``deepspeed.initialize`` calls made by others (accelerate, the HF Trainer) run
    with ds_seqpar's mpu and a DeepSpeed config rewritten for the mesh (see ``_rewrite_for_mesh``)."""
    token = _SCOPED_MESH.set(mesh)
    try:
        yield
    finally:
        _SCOPED_MESH.reset(token)


def _rewrite_for_mesh(config: dict[str, Any], mesh: SeqParMesh) -> dict[str, Any]:
    """Drop the section, set ``sequence_parallel_size`` and a ``train_batch_size`` over dp (not world)."""
    config = {k: v for k, v in config.items() if k not in (SECTION, _GUARD_BYPASS)}
    config["sequence_parallel_size"] = mesh.sp_size
    micro = config.get("train_micro_batch_size_per_gpu")
    gas = config.get("gradient_accumulation_steps", 1)
    if isinstance(micro, int) and isinstance(gas, int):
        config["train_batch_size"] = micro * gas * mesh.dp_size
    _avoid_jit_optimizer(config)
    return config


def _config_dict(config: Any) -> dict[str, Any] | None:
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        with open(config, encoding="utf-8") as fh:
            try:
                return json.load(fh)
            except ValueError:
                return None
    return config if isinstance(config, dict) else None


def _guarded(initialize_fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(initialize_fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        key = "config" if kwargs.get("config") is not None else "config_params"
        config = _config_dict(kwargs.get(key))
        if config is None:
            return initialize_fn(*args, **kwargs)
        if config.get(_GUARD_BYPASS):
            kwargs[key] = {k: v for k, v in config.items() if k != _GUARD_BYPASS}
            return initialize_fn(*args, **kwargs)
        mesh = _SCOPED_MESH.get()
        if mesh is not None:
            kwargs[key] = _rewrite_for_mesh(config, mesh)
            kwargs["mpu"] = mesh.mpu()
            return initialize_fn(*args, **kwargs)
        if SECTION in config:
            raise SeqParConfigError(
                f"this DeepSpeed config has a '{SECTION}' section, which deepspeed.initialize ignores (it would "
                "train without sequence parallelism); call ds_seqpar.initialize(model=..., config=...) instead, "
                "or use ds_seqpar.SeqParTrainer with the HF Trainer"
            )
        return initialize_fn(*args, **kwargs)

    guarded._ds_seqpar_guard = True
    return guarded


def install_deepspeed_guard() -> None:
    """Make plain ``deepspeed.initialize`` (and a plain HF Trainer) refuse configs with a ``sequence_parallel`` section (idempotent)."""
    import deepspeed

    if not getattr(deepspeed.initialize, "_ds_seqpar_guard", False):
        deepspeed.initialize = _guarded(deepspeed.initialize)
    install_trainer_guard()  # and a plain transformers.Trainer, which reaches it after its own checks
