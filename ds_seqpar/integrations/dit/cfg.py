"""CFG parallelism: the two classifier-free-guidance branches of a denoising step on two halves of the world.

Diffusers pipelines concatenate the unconditional and conditional inputs along the batch and call the
transformer once with batch 2B. ``CfgParallel(model, team)`` (team = the two ranks that hold the same SP
piece in each half, in branch order) cuts every batched input of that call (tensors, also inside dicts, whose
leading dim is the batch of ``hidden_states``) to this member's B rows, and all-gathers the output's rows
after the call: one all-gather of the output, B·(output's per-row elements)·itemsize to the other member.
Inputs that the model's token plan splits along dim 0 (token-major ids) are not batched. Nothing else moves.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_seqpar.comm.team import TeamComm
from ds_seqpar.integrations.dit.plans import TokenPlan
from ds_seqpar.integrations.hf_model import UnsupportedModelError

__all__ = ["CfgParallel"]


class CfgParallel:
    """See the module docstring; ``remove()`` takes the two hooks away."""

    def __init__(self, model: torch.nn.Module, team: TeamComm, plan: TokenPlan | None = None) -> None:
        self.model, self.team = model, team
        root = (plan.splits.get("", {}) if plan is not None else {}) or {}
        self._token_major = {k for k, v in root.items() if isinstance(k, str) and v.dim == 0}
        self._handles = [
            model.register_forward_pre_hook(self._split, with_kwargs=True, prepend=True),
            model.register_forward_hook(self._gather),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _split(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if not isinstance(hidden, torch.Tensor):
            raise UnsupportedModelError(
                f"cfg_parallel: {type(module).__name__} was called without a hidden_states tensor"
            )
        batch = hidden.shape[0]
        if batch % self.team.size:
            raise UnsupportedModelError(
                f"cfg_parallel={self.team.size}: the transformer was called with batch {batch}, which does not "
                "hold the two guidance branches; CFG parallelism needs a pipeline that batches them in one call "
                "(guidance_scale > 1; FluxPipeline's true CFG runs them as two calls): set dit.cfg_parallel=1"
            )
        self.rows = batch // self.team.size

        def cut(name: str | None, x: Any) -> Any:
            if isinstance(x, dict):
                return {k: cut(k, v) for k, v in x.items()}
            if (
                isinstance(x, torch.Tensor)
                and x.dim() >= 1
                and x.shape[0] == batch
                and name not in self._token_major
            ):
                return x.narrow(0, self.team.index * self.rows, self.rows)
            return x

        return tuple(cut(None, a) for a in args), {k: cut(k, v) for k, v in kwargs.items()}

    def _gather(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, tuple):
            (whole,) = self.team.gather(output[0].contiguous(), dim=0)
            return (whole, *output[1:])
        sample = output.sample
        (output.sample,) = self.team.gather(sample.contiguous(), dim=0)
        return output
