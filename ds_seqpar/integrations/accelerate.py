"""Your own training loop under ``accelerate launch`` with the DeepSpeed plugin: ``ds_seqpar.accelerate_prepare``.

::

    accelerator = Accelerator()  # accelerate launch --use_deepspeed --deepspeed_config_file ds_configs/usp_zero3.json
    model, optimizer, loader = ds_seqpar.accelerate_prepare(accelerator, model, train_dataset=dataset)
    for batch in loader:
        loss = model(**batch)          # token-weighted loss of the whole SP group
        accelerator.backward(loss)     # DeepSpeed's backward and optimizer step
        optimizer.step(); optimizer.zero_grad()

The ``"sequence_parallel"`` section lives in the DeepSpeed JSON that accelerate's plugin carries. It is
validated and resolved by ds_seqpar and removed from the plugin's config before ``accelerator.prepare``,
so accelerate's own ``"auto"`` handling never sees it. accelerate's ``ParallelismConfig``
(``Accelerator(parallelism_config=...)`` or ``parallelism_config_*`` launch settings) may state the SP size
with ``sp_size=N, sp_backend="deepspeed"``; the section still chooses the algorithm, and accelerate runs no
ALST Ulysses of its own next to it (``integrations/parallelism_config.py``: what is accepted and refused).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ds_seqpar.config import SECTION, SeqParConfigError, load_config
from ds_seqpar.integrations.deepspeed import (
    init_distributed,
    sequence_parallel_scope,
    sharding_loader,
    wrap_for_training,
)
from ds_seqpar.integrations.parallelism_config import accelerate_parallelism, section_with_parallelism
from ds_seqpar.mesh import SeqParMesh


def _deepspeed_config(accelerator: Any) -> dict[str, Any]:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None or getattr(plugin, "hf_ds_config", None) is None:
        raise SeqParConfigError(
            "accelerate_prepare needs accelerate's DeepSpeed plugin with a config that has a "
            f"'{SECTION}' section; valid: accelerate launch --use_deepspeed --deepspeed_config_file "
            "ds_configs/usp_zero3.json ..., or Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=PATH))"
        )
    return plugin.hf_ds_config.config


def _count_cpu_processes(accelerator: Any) -> None:
    """On CPU, give accelerate's state the ranks of the running gloo group.

    accelerate 1.15 has no CPU DeepSpeed mode (``accelerate launch`` refuses ``--cpu`` with
    ``--use_deepspeed``): without a GPU its state reports one process on every rank, so
    ``accelerator.print`` and ``is_main_process`` would hold on all of them. DeepSpeed itself runs on
    the gloo group, so the state is set from it (rank, world, local rank).
    """
    import os

    import torch.distributed as dist
    from accelerate.state import PartialState

    if torch.cuda.is_available() or not dist.is_initialized():
        return
    for state in (PartialState(), accelerator.state):  # two shared-state objects: both read these fields
        state.num_processes = dist.get_world_size()
        state.process_index = dist.get_rank()
        state.local_process_index = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        state.backend = dist.get_backend()


def accelerate_prepare(
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: Any = None,
    train_dataset: Any = None,
    *,
    collate_fn: Callable[..., dict[str, Any]] | None = None,
    pad_token_id: int = 0,
    shuffle: bool = True,
    seed: int = 0,
    loss_chunk_size: int = 1024,
) -> tuple[Any, Any, Any]:
    """Sequence-parallel ``accelerator.prepare``; returns ``(model, optimizer, dataloader)``.

    Args:
        accelerator: an ``accelerate.Accelerator`` with the DeepSpeed plugin (``accelerate launch
            --use_deepspeed --deepspeed_config_file X``).
        model: a HuggingFace causal LM (or a PEFT wrapper of one).
        optimizer: a torch optimizer over ``model``'s parameters, or None when the JSON has an
            ``"optimizer"`` (accelerate's ``DummyOptim`` is made for it).
        train_dataset: map-style dataset of examples with ``input_ids`` (and optionally ``labels``,
            ``attention_mask``, ``position_ids``); wrapped in the sharding DataLoader, which is NOT
            passed through accelerate (accelerate would split batches over every rank, SP ranks
            included; the sampler here splits over dp only).

    The returned model is DeepSpeed's engine around ``SeqParCausalLM``: ``model(**batch)`` takes the
    sharded batch and returns the SP-group loss.
    """
    config = _deepspeed_config(accelerator)
    if SECTION in config:  # HF's ParallelismConfig may state the SP size (integrations/parallelism_config.py)
        config[SECTION] = section_with_parallelism(
            config[SECTION], getattr(accelerator, "parallelism_config", None)
        )
    section, ds_config = load_config(config)
    if not section.enabled:
        raise SeqParConfigError(
            f"{SECTION}.enabled is false; call accelerator.prepare instead of accelerate_prepare"
        )
    init_distributed(section.fault_timeout_s)
    _count_cpu_processes(accelerator)
    mesh = SeqParMesh.from_config(section, getattr(model, "config", None))  # validates before any collective
    config.pop(SECTION)  # accelerate's "auto" handling must not see the section; ds_seqpar owns it now
    wrapped = wrap_for_training(model, mesh, ds_config, loss_chunk_size)
    if optimizer is None:
        if "optimizer" not in ds_config:
            raise SeqParConfigError(
                "accelerate_prepare got no optimizer and the DeepSpeed config has no 'optimizer' section; valid: "
                "pass optimizer=torch.optim.AdamW(model.parameters(), ...) or add an 'optimizer' to the JSON"
            )
        from accelerate.utils import DummyOptim

        optimizer = DummyOptim(wrapped.parameters())
    with sequence_parallel_scope(mesh), accelerate_parallelism(accelerator):  # no ALST next to ds_seqpar
        engine, optimizer = accelerator.prepare(wrapped, optimizer)
    engine.seqpar_mesh = mesh
    return (
        engine,
        optimizer,
        sharding_loader(train_dataset, wrapped, ds_config, collate_fn, shuffle, seed, pad_token_id),
    )
