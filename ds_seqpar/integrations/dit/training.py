"""``SeqParDiT``: a diffusion transformer's training step under SP — the denoising loss of one batch.

The batch is whole on every SP rank (latents are small; the tokens and their attention are what SP splits):
the transformer's keyword inputs (noisy latents as ``hidden_states``, ``timestep``, the prompt embeddings...)
plus ``target`` (the flow-matching velocity or the noise, ``ds_seqpar.dit.losses``). The transformer runs
with its streams split (``DitParallel``; ``dit.attention: block_sparse`` is honoured, CFG parallel and
PipeFusion are refused: inference only); its gathered output is the same on every rank, so is the loss
(mean squared error over every element; a model that predicts a variance beside each channel — PixArt,
DiT: out_channels = 2 x in_channels — is trained on its prediction half, as diffusers' PixArt scripts do). Each rank's backward reaches the parameters through its own tokens
only; DeepSpeed's reduction over the group (``grad_scale``, ``loss.sp_grad_scale``) sums those parts.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_seqpar.integrations.dit.hooks import DitParallel, check_dit_settings, sparse_settings
from ds_seqpar.loss import scale_grad
from ds_seqpar.mesh import SeqParMesh

__all__ = ["SeqParDiT"]


def _config_value(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


class SeqParDiT(torch.nn.Module):
    """``forward(target=..., **inputs) -> loss`` (0-d, float32); see the module docstring."""

    def __init__(self, model: torch.nn.Module, mesh: SeqParMesh, grad_scale: float = 1.0, **_: Any) -> None:
        super().__init__()
        self.model, self.mesh, self.grad_scale = model, mesh, float(grad_scale)
        check_dit_settings(mesh.settings, type(model).__name__, training=True)
        self.parallel = DitParallel(model, mesh, sparse=sparse_settings(mesh.settings))
        self.whole_inputs: tuple[str, ...] = ()

    def loader(self, dataset: Any, micro: int, collate_fn: Any, shuffle: bool, seed: int) -> Any:
        """Whole batches of ``micro`` examples (the transformer's keyword inputs and ``target``), the same on
        every rank of an SP group, different per data-parallel replica."""
        from torch.utils.data import default_collate

        from ds_seqpar.data import dp_dataloader

        return dp_dataloader(dataset, self.mesh, micro, collate_fn or default_collate, shuffle, seed, False)

    @property
    def config(self) -> Any:
        return self.model.config

    def _learned_sigma(self) -> bool:
        """The model predicts a variance beside each output channel (PixArt, DiT: out = 2 x in channels)."""
        config = self.model.config
        out, inp = _config_value(config, "out_channels"), _config_value(config, "in_channels")
        return out is not None and inp is not None and out == 2 * inp

    def forward(self, target: torch.Tensor, **inputs: Any) -> torch.Tensor:
        inputs.pop("return_dict", None)
        out = self.model(**inputs, return_dict=False)[0]
        if out.dim() == target.dim() and out.shape[1] == 2 * target.shape[1] and self._learned_sigma():
            out = out.narrow(1, 0, target.shape[1])  # (prediction, variance): the loss trains the prediction
        if out.shape != target.shape:
            raise ValueError(
                f"SeqParDiT: the transformer's output has shape {tuple(out.shape)} but target has "
                f"{tuple(target.shape)}; pass the target in the output's layout (ds_seqpar.dit.losses)"
            )
        loss = torch.nn.functional.mse_loss(out.float(), target.float())
        return scale_grad(loss, self.grad_scale)
