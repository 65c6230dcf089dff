"""How a vision tower's call splits into independent units, and how its outputs join again (docs/multimodal.md).

A vision tower (the encoder a VLM runs on its images and video frames) is split over the SP group by UNITS:
pieces of its input that it encodes independently of each other, so that running them on different ranks and
concatenating the outputs in unit order gives exactly what one call on all of them gives. A ``TowerRule``
says, for one kind of tower, what its units are, what each costs, how to make the call of a subset of them,
and how many output rows each unit owns. ``TOWER_RULES`` is the registry (``register_tower_rule``); a tower
that no rule claims runs whole on every rank (exact, not split).

Rules:
    frames   towers called as ``tower(patches [N, C·p·p], grid_thw [n, 3])`` whose attention never crosses a
             temporal patch (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: per-frame attention runs): every temporal patch
             ``(1, h, w)`` of every image / video is a unit of cost h·w patches; outputs keep rows in unit order.
    images   towers called as ``tower(pixel_values [N, C, H, W])`` that encode every batch row alone (CLIP,
             SigLIP and the ViTs of LLaVA, LLaVA-OneVision, LLaVA-NeXT-Video, Gemma 3): every row (an image,
             an image tile or a video frame) is a unit of cost 1.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TOWER_RULES", "TowerCall", "TowerRule", "register_tower_rule", "tower_rule_of"]


@dataclass(frozen=True)
class TowerCall:
    """One call of a tower, its arguments bound by name, cut into ``costs`` units (one cost per unit, in the
    order the outputs keep them); ``subset(units)`` gives the keyword arguments of the call on those units
    (in increasing unit order); ``rows(units, field_rows, all_units_rows)`` splits an output field's rows."""

    kwargs: dict[str, Any]
    costs: tuple[int, ...]
    subset: Callable[[list[int]], dict[str, Any]]
    unit_rows: tuple[int, ...]  # input rows of every unit; an output field's rows are proportional to them


@dataclass(frozen=True)
class TowerRule:
    """A kind of vision tower: ``claims(module)`` says whether the rule applies; ``split(kwargs)`` cuts a call
    (the tower's arguments bound by name) into a ``TowerCall``, or raises naming what it cannot split."""

    name: str
    summary: str
    claims: Callable[[torch.nn.Module], bool]
    split: Callable[[dict[str, Any]], TowerCall]


TOWER_RULES: dict[str, TowerRule] = {}


def register_tower_rule(rule: TowerRule) -> TowerRule:
    """Add ``rule`` (replacing one of the same name); rules are tried in registration order."""
    TOWER_RULES[rule.name] = rule
    return rule


def tower_rule_of(module: torch.nn.Module) -> TowerRule | None:
    """The first registered rule that claims ``module``, or None (the tower then runs whole on every rank)."""
    return next((rule for rule in TOWER_RULES.values() if rule.claims(module)), None)


def bind_call(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The tower's call arguments by name (positional ones bound to the forward's parameter names)."""
    params = [p for p in inspect.signature(type(module).forward).parameters if p != "self"]
    named = dict(zip(params, args, strict=False))
    clash = sorted(set(named) & set(kwargs))
    if clash or len(args) > len(params):
        raise TypeError(
            f"{type(module).__name__} got arguments {clash or args} twice or beyond its signature"
        )
    return named | kwargs


# ---- frames: grid_thw towers (Qwen-VL) --------------------------------------------------------------------

_GRID_KEYS = ("grid_thw",)


def _claims_frames(module: torch.nn.Module) -> bool:
    params = inspect.signature(type(module).forward).parameters
    return "grid_thw" in params and "hidden_states" in params and getattr(module, "_ds_seqpar_frames", True)


def _split_frames(kwargs: dict[str, Any]) -> TowerCall:
    patches, grid = kwargs["hidden_states"], kwargs["grid_thw"]
    extra = sorted(
        k for k, v in kwargs.items() if k not in ("hidden_states", "grid_thw") and torch.is_tensor(v)
    )
    if extra:
        raise ValueError(
            f"the vision tower got {extra} besides hidden_states and grid_thw; ds_seqpar splits it by temporal "
            "patches and cannot cut those inputs: leave them unset"
        )
    grid = torch.as_tensor(grid).long()
    units: list[tuple[int, int, int]] = []  # (first row, rows, grid row)
    start = 0
    for i, (t, h, w) in enumerate(grid.tolist()):
        for _ in range(t):
            units.append((start, h * w, i))
            start += h * w
    if start != patches.shape[0]:
        raise ValueError(
            f"grid_thw {grid.tolist()} describes {start} patches but the tower got {patches.shape[0]}: "
            "pass the processor's pixel values and grid together"
        )

    def subset(chosen: list[int]) -> dict[str, Any]:
        rows = torch.cat([torch.arange(units[u][0], units[u][0] + units[u][1]) for u in chosen])
        sub_grid = torch.stack([torch.tensor([1, *grid[units[u][2], 1:].tolist()]) for u in chosen])
        return kwargs | {
            "hidden_states": patches.index_select(0, rows.to(patches.device)),
            "grid_thw": sub_grid.to(grid.device),
        }

    costs = tuple(u[1] for u in units)
    return TowerCall(kwargs, costs, subset, costs)


register_tower_rule(
    TowerRule(
        "frames",
        "tower(patches, grid_thw) with attention inside each temporal patch: one unit per temporal patch",
        _claims_frames,
        _split_frames,
    )
)

# ---- images: batch-row towers (CLIP, SigLIP) --------------------------------------------------------------

ROW_TOWERS = frozenset({"CLIPVisionModel", "SiglipVisionModel", "Siglip2VisionModel"})


def _claims_rows(module: torch.nn.Module) -> bool:
    return type(module).__name__ in ROW_TOWERS


def _split_rows(kwargs: dict[str, Any]) -> TowerCall:
    pixels = kwargs["pixel_values"]
    n = pixels.shape[0]
    per_row = {
        k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n
    }

    def subset(chosen: list[int]) -> dict[str, Any]:
        index = torch.tensor(chosen, device=pixels.device)
        return kwargs | {k: v.index_select(0, index.to(v.device)) for k, v in per_row.items()}

    ones = (1,) * n
    return TowerCall(kwargs, ones, subset, ones)


register_tower_rule(
    TowerRule(
        "images",
        "tower(pixel_values [N, C, H, W]) encoding each row alone: one unit per row",
        _claims_rows,
        _split_rows,
    )
)
