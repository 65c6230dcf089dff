"""The vision tower split over the SP group by whole units (docs/multimodal.md "The vision tower").

Every rank of the group holds the same images and video frames. ``split_towers(model, mesh)`` patches, for the
length of one forward, every tower a ``TowerRule`` claims (``towers.py``): a call cuts its input into units,
``assign_units`` gives each unit to one rank (largest first, to the least loaded rank), each rank runs the
tower's own forward on its units only, and every output field is all-gathered (``comm/row_gather.py``) and put
back in unit order, so every rank continues with exactly the outputs one call on all units gives. Backward:
the gradients of every rank's uses of a unit are summed on the rank that encoded it (one all-reduce).

A rank that owns no unit (fewer units than ranks) still runs the tower once, on unit 0, and contributes zero
rows: every rank makes the same calls, which ZeRO-3's parameter gathering needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ds_seqpar.comm.row_gather import gather_rows
from ds_seqpar.comm.team import TeamComm
from ds_seqpar.integrations.hf_model import UnsupportedModelError
from ds_seqpar.integrations.vision.towers import TowerCall, TowerRule, bind_call, tower_rule_of
from ds_seqpar.mesh import SeqParMesh

__all__ = ["assign_units", "split_towers", "vision_towers"]

TOWER_ATTRIBUTES = ("visual", "vision_tower", "vision_model", "vision_encoder")


def assign_units(costs: Sequence[int], parts: int) -> list[int]:
    """The owner rank of every unit: units by decreasing cost (ties: lower index first) each go to the rank
    with the least cost so far (ties: lower rank). The most loaded rank carries at most total/parts + max(cost)."""
    load = [0] * parts
    owners = [0] * len(costs)
    for u in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(parts), key=lambda r: (load[r], r))
        owners[u] = rank
        load[rank] += costs[u]
    return owners


def vision_towers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, TowerRule | None]]:
    """``(attribute path, tower, rule or None)`` of every vision tower of a VLM (its base model's ``visual`` /
    ``vision_tower`` / ... attribute)."""
    found = []
    for owner_name, owner in (("", model), ("model.", getattr(model, "model", None))):
        for attr in TOWER_ATTRIBUTES:
            tower = getattr(owner, attr, None) if owner is not None else None
            if isinstance(tower, torch.nn.Module) and all(t is not tower for _, t, _ in found):
                found.append((owner_name + attr, tower, tower_rule_of(tower)))
    return found


class _LazyGathered(tuple):
    """A tuple of local per-unit tensors whose entries are all-gathered when read (hidden states of every
    layer: the model reads one or two of them). Every rank reads the same entries in the same order."""

    def __new__(cls, local: Sequence[torch.Tensor], gather: Any = None) -> Any:
        if gather is None:  # rebuilt from an iteration (type(x)(...)): its entries are gathered already
            return tuple(local)
        obj = super().__new__(cls, local)
        obj._gather, obj._done = gather, {}
        return obj

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(len(self))[index])
        i = range(len(self))[index]
        if i not in self._done:
            local = tuple.__getitem__(self, i)
            self._done[i] = None if local is None else self._gather(local)
        return self._done[i]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(len(self)))


def _field_gather(call: TowerCall, owners: list[int], mine: list[int], team: TeamComm) -> Any:
    """A function ``local field [rows of my units, ...] -> [rows of all units, ...]`` in unit order."""
    my_in = sum(call.unit_rows[u] for u in (mine or [0]))
    order = [u for r in range(team.size) for u in range(len(owners)) if owners[u] == r]

    def gather(local: torch.Tensor) -> torch.Tensor:
        rows = local.shape[0]
        if (rows * min(call.unit_rows)) % my_in or any((rows * n) % my_in for n in call.unit_rows):
            raise UnsupportedModelError(
                f"a vision tower output has {rows} rows for {my_in} input rows: not a whole number of rows per "
                "unit, so ds_seqpar cannot split this tower; register a TowerRule that describes it"
            )
        unit_out = [call.unit_rows[u] * rows // my_in for u in range(len(owners))]
        counts = [sum(unit_out[u] for u in range(len(owners)) if owners[u] == r) for r in range(team.size)]
        joined = gather_rows(local if mine else local[:0], counts, team)
        starts, at = {}, 0
        for u in order:
            starts[u] = at
            at += unit_out[u]
        index = torch.cat([torch.arange(starts[u], starts[u] + unit_out[u]) for u in range(len(owners))])
        return joined.index_select(0, index.to(joined.device))

    return gather


def _split_call(module: torch.nn.Module, rule: TowerRule, team: TeamComm, args: tuple, kwargs: dict) -> Any:
    """One call of ``module`` split over ``team`` by ``rule`` (see the module docstring)."""
    call = rule.split(bind_call(module, args, kwargs))
    owners = assign_units(call.costs, team.size)
    mine = [u for u, r in enumerate(owners) if r == team.index]
    out = type(module).forward(module, **call.subset(mine or [0]))
    gather = _field_gather(call, owners, mine, team)
    fields = {}
    for name, value in out.items():
        if isinstance(value, torch.Tensor):
            fields[name] = gather(value)
        elif isinstance(value, (list, tuple)) and all(
            v is None or isinstance(v, torch.Tensor) for v in value
        ):
            fields[name] = (
                _LazyGathered(value, gather) if name == "hidden_states" else [gather(v) for v in value]
            )
        elif value is not None:
            raise UnsupportedModelError(
                f"{type(module).__name__} returned {name}={type(value).__name__}, which ds_seqpar cannot gather "
                "over the split tower's units"
            )
    return type(out)(**fields)


@contextlib.contextmanager
def split_towers(model: torch.nn.Module, mesh: SeqParMesh) -> Iterator[list[str]]:
    """While open, every rule-claimed vision tower of ``model`` runs split over the SP group (see the module);
    yields the attribute paths of the split towers."""
    team = TeamComm(mesh.group("sp"), mesh.members["sp"], mesh.coords.sp_rank, mesh.comm_stats)
    patched = []
    if team.size > 1:
        for path, tower, rule in vision_towers(model):
            if rule is not None:
                tower.forward = (lambda t, r: lambda *a, **k: _split_call(t, r, team, a, k))(tower, rule)
                patched.append((path, tower))
    try:
        yield [path for path, _ in patched]
    finally:
        for _, tower in patched:
            del tower.forward
