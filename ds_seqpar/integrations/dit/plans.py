"""Where a diffusion transformer's token streams are split over the SP group and gathered back (docs/dit.md).

A ``TokenPlan`` names modules (``"transformer_blocks.0"``, ``"*"`` wildcards, ``""`` = the transformer):
``splits[module][input] = SplitInput`` cuts an input (a forward argument by name, or with ``output=True``
an element of the module's output by index) along ``dim`` into this SP rank's piece; ``gathers[module] =
GatherOutput`` concatenates the module's output over the group. ``joint_order`` is the order in which the
model concatenates its split streams for joint attention (MM-DiT); it is needed only when a stream's length
does not divide the SP size (its padding must be found inside the joint sequence).

``DIT_PLANS`` holds ds_seqpar's plans by transformer class; a class without one uses the model's own
``_cp_plan`` (diffusers' context-parallel plan, same meaning); anything else is refused by name.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch

from ds_seqpar.integrations.hf_model import UnsupportedModelError

__all__ = ["DIT_PLANS", "GatherOutput", "SplitInput", "TokenPlan", "plan_of", "register_dit_plan"]


@dataclass(frozen=True)
class SplitInput:
    """Cut a tensor along ``dim`` into the SP group's pieces (``ndim``: the tensor's expected dims, checked)."""

    dim: int
    ndim: int | None = None
    output: bool = False


@dataclass(frozen=True)
class GatherOutput:
    """Concatenate a module's output tensor along ``dim`` over the SP group."""

    dim: int
    ndim: int | None = None


@dataclass(frozen=True)
class TokenPlan:
    splits: dict[str, dict[str | int, SplitInput]]
    gathers: dict[str, GatherOutput]
    joint_order: tuple[str, ...] | None = None
    source: str = field(default="ds_seqpar", compare=False)

    def modules(self, model: torch.nn.Module, pattern: str) -> list[tuple[str, torch.nn.Module]]:
        """The modules of ``model`` that ``pattern`` names; an empty match is an error naming the pattern."""
        if pattern == "":
            return [("", model)]
        found = [(n, m) for n, m in model.named_modules() if n and fnmatch.fnmatchcase(n, pattern)]
        found = [(n, m) for n, m in found if "*" not in pattern or n.count(".") == pattern.count(".")]
        if not found:
            raise UnsupportedModelError(
                f"{type(model).__name__}: its token plan ({self.source}) names the module {pattern!r}, which the "
                "model does not have; register a plan for this class with ds_seqpar.register_dit_plan"
            )
        return found


DIT_PLANS: dict[str, TokenPlan] = {}


def register_dit_plan(class_name: str, plan: TokenPlan) -> None:
    """Use ``plan`` for transformers of class ``class_name`` (checked before the model's own ``_cp_plan``)."""
    DIT_PLANS[class_name] = plan


def _from_cp_plan(cp_plan: dict[str, Any], name: str) -> TokenPlan:
    """ds_seqpar's reading of diffusers' ``_cp_plan`` (``ContextParallelInput`` / ``ContextParallelOutput``)."""
    splits: dict[str, dict[str | int, SplitInput]] = {}
    gathers: dict[str, GatherOutput] = {}
    for module, spec in cp_plan.items():
        if isinstance(spec, dict):
            entries: dict[str | int, SplitInput] = {}
            for key, value in spec.items():
                if isinstance(value, list | tuple):
                    raise UnsupportedModelError(
                        f"{name}._cp_plan[{module!r}][{key!r}] splits one input in several ways; ds_seqpar reads "
                        "one split per input: register a plan with ds_seqpar.register_dit_plan"
                    )
                entries[key] = SplitInput(value.split_dim, value.expected_dims, bool(value.split_output))
            splits[module] = entries
        elif isinstance(spec, list | tuple):
            raise UnsupportedModelError(
                f"{name}._cp_plan[{module!r}] gathers several outputs; register a plan with "
                "ds_seqpar.register_dit_plan"
            )
        else:
            gathers[module] = GatherOutput(spec.gather_dim, spec.expected_dims)
    return TokenPlan(splits, gathers, None, source=f"{name}._cp_plan")


def plan_of(model: torch.nn.Module) -> TokenPlan:
    """The token plan of a diffusers transformer: ``DIT_PLANS`` by class (MRO), else its ``_cp_plan``."""
    for cls in type(model).__mro__:
        if cls.__name__ in DIT_PLANS:
            return DIT_PLANS[cls.__name__]
    cp_plan = getattr(type(model), "_cp_plan", None)
    if cp_plan:
        return _from_cp_plan(cp_plan, type(model).__name__)
    raise UnsupportedModelError(
        f"{type(model).__name__} has no token plan: ds_seqpar does not know where its image tokens are split "
        f"and gathered (plans: {', '.join(sorted(DIT_PLANS))}, or a diffusers model with a _cp_plan); register "
        "one with ds_seqpar.register_dit_plan (docs/dit.md)"
    )


def _blocks_plan(joint: bool, joint_order: tuple[str, ...] | None = None, out: str = "proj_out") -> TokenPlan:
    inputs: dict[str | int, SplitInput] = {"hidden_states": SplitInput(1, 3)}
    if joint:
        inputs["encoder_hidden_states"] = SplitInput(1, 3)
    return TokenPlan({"transformer_blocks.0": inputs}, {out: GatherOutput(1, 3)}, joint_order)


# PixArt-α / Σ and the DiT family: self-attention on the image tokens, cross-attention to the whole prompt.
register_dit_plan("PixArtTransformer2DModel", _blocks_plan(joint=False))
# DiT (class-conditional): self-attention only; the last projection is proj_out_2.
register_dit_plan("DiTTransformer2DModel", _blocks_plan(joint=False, out="proj_out_2"))
# SD3 / SD3.5 (MM-DiT): the prompt tokens are a second split stream; joint attention is cat([image, text]).
register_dit_plan(
    "SD3Transformer2DModel", _blocks_plan(joint=True, joint_order=("hidden_states", "encoder_hidden_states"))
)
# Flux: both streams and their position ids split at the transformer; every joint sequence is cat([text, image]).
register_dit_plan(
    "FluxTransformer2DModel",
    TokenPlan(
        {
            "": {
                "hidden_states": SplitInput(1, 3),
                "encoder_hidden_states": SplitInput(1, 3),
                "img_ids": SplitInput(0, 2),
                "txt_ids": SplitInput(0, 2),
            }
        },
        {"proj_out": GatherOutput(1, 3)},
        ("encoder_hidden_states", "hidden_states"),
    ),
)
