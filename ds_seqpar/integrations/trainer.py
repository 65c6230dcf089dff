"""HF Trainer with sequence parallelism: ``SeqParTrainer`` instead of ``Trainer``, nothing else changes.

::

    args = TrainingArguments(output_dir="out", deepspeed="ds_configs/usp_zero3.json", use_cpu=True, ...)
    trainer = ds_seqpar.SeqParTrainer(model=model, args=args, train_dataset=dataset)
    trainer.train()

What it does on top of ``transformers.Trainer``:

* reads the ``"sequence_parallel"`` section of ``args.deepspeed``, builds the ``SeqParMesh``, switches
  the model's attention to ds_seqpar and trains ``SeqParCausalLM(model)`` (SP-group loss, chunked
  logits) with the gradient factor of the ZeRO stage;
* ``get_train_dataloader``: the sharding DataLoader (samples split over dp only; each batch padded,
  label-shifted and split over the SP ranks);
* ``train``: runs inside ``sequence_parallel_scope(mesh)``, so accelerate's ``deepspeed.initialize``
  gets ds_seqpar's mpu and a config with ``sequence_parallel_size`` and a dp-based
  ``train_batch_size``;
* saving writes the HF model (``save_pretrained``), not the wrapper.

On CPU pass ``use_cpu=True`` to ``TrainingArguments`` and initialise torch.distributed before creating
them (``ds_seqpar.integrations.deepspeed.init_distributed()``), as for any DeepSpeed Trainer run there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer

from ds_seqpar.config import SeqParConfigError, load_config
from ds_seqpar.data import seqpar_dataloader
from ds_seqpar.integrations.deepspeed import init_distributed, sequence_parallel_scope, zero_stage
from ds_seqpar.integrations.transformers import SeqParCausalLM
from ds_seqpar.loss import sp_grad_scale
from ds_seqpar.mesh import SeqParMesh


class SeqParTrainer(Trainer):
    """``transformers.Trainer`` for causal LMs under sequence parallelism (see the module docstring).

    Args:
        model: a HuggingFace causal LM.
        args: ``TrainingArguments`` whose ``deepspeed`` config has a ``"sequence_parallel"`` section.
        pad_token_id: id used to pad sequences to the layout's multiple.
        loss_chunk_size: tokens per logits chunk in the loss.
        Everything else goes to ``Trainer``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        args: Any,
        *trainer_args: Any,
        pad_token_id: int = 0,
        loss_chunk_size: int = 1024,
        **trainer_kwargs: Any,
    ) -> None:
        if args is None or not getattr(args, "deepspeed", None):
            raise SeqParConfigError(
                "SeqParTrainer needs TrainingArguments(deepspeed=<config with a 'sequence_parallel' section>), "
                "e.g. deepspeed='ds_configs/usp_zero3.json'"
            )
        section, ds_config = load_config(args.deepspeed)
        init_distributed()
        self.seqpar_mesh = SeqParMesh.from_config(section, getattr(model, "config", None))
        self.seqpar_pad_token_id = pad_token_id
        wrapped = SeqParCausalLM(
            model,
            self.seqpar_mesh,
            grad_scale=sp_grad_scale(zero_stage(ds_config), self.seqpar_mesh.sp_size),
            loss_chunk_size=loss_chunk_size,
        )
        super().__init__(wrapped, args, *trainer_args, **trainer_kwargs)
        # the loss is already the SP group's token mean: let the Trainer divide by grad accumulation
        self.model_accepts_loss_kwargs = False

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("SeqParTrainer: training requires a train_dataset")
        return seqpar_dataloader(
            self.train_dataset,
            self.seqpar_mesh,
            self.args.per_device_train_batch_size,
            collate_fn=self.data_collator,
            shuffle=True,
            seed=self.args.seed,
            pad_token_id=self.seqpar_pad_token_id,
            drop_last=self.args.dataloader_drop_last,
        )

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

    def train(self, *args: Any, **kwargs: Any) -> Any:
        with sequence_parallel_scope(self.seqpar_mesh):
            return super().train(*args, **kwargs)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Save the wrapped HF model with ``save_pretrained`` (the wrapper's ``model.`` prefix removed)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        inner = self.accelerator.unwrap_model(self.model).model
        if state_dict is not None:
            state_dict = {k.removeprefix("model."): v for k, v in state_dict.items()}
        if self.args.should_save:
            inner.save_pretrained(output_dir, state_dict=state_dict)
