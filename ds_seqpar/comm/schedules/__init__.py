"""Ring schedules: how K/V blocks reach every rank of the ring axis, one module per schedule.

``SCHEDULES = {spec.name: spec}`` (``base.py``) is the only list of schedule names; the config validates
``sequence_parallel.ring.schedule`` through it, the byte model and the report ask the specs. A new
schedule is a module with a ``ScheduleSpec`` subclass and one ``register_schedule`` call below (or in
user code: the registry takes specs from anywhere), docs/architecture.md "How to add a schedule".
"""

import dataclasses
from typing import Any

from ds_seqpar.comm.schedules.all_gather import AllGatherSchedule, AllGatherSpec
from ds_seqpar.comm.schedules.attention2d import Attention2DSpec, GridColumnSchedule
from ds_seqpar.comm.schedules.base import (
    SCHEDULES,
    RingParams,
    Schedule,
    ScheduleSpec,
    TeamSchedule,
    register_schedule,
    schedule_spec,
)
from ds_seqpar.comm.schedules.ring import RingSchedule, RingSpec
from ds_seqpar.comm.schedules.startrail import StarTrailSchedule, StarTrailSpec
from ds_seqpar.comm.schedules.tasp import TaspSchedule, TaspSpec

for _spec in (RingSpec(), AllGatherSpec(), TaspSpec(), StarTrailSpec(), Attention2DSpec()):
    register_schedule(_spec)
del _spec


def build_schedule(mesh: Any, kind: str | None = None, overlap: bool | None = None) -> Schedule:
    """The runtime schedule ``kind`` (default: the mesh's ``ring.schedule``) over ``mesh``'s ring axis, with
    the mesh's ring settings (``overlap`` overrides theirs). ``mesh.schedule()`` builds the configured one
    once per mesh; this builds a new one each call."""
    spec = schedule_spec(kind or mesh.settings.ring.schedule)
    params = mesh.settings.ring_params()
    if overlap is not None:
        params = dataclasses.replace(params, overlap=overlap)
    return spec.build(mesh, params)


__all__ = [
    "SCHEDULES",
    "AllGatherSchedule",
    "GridColumnSchedule",
    "RingParams",
    "RingSchedule",
    "Schedule",
    "ScheduleSpec",
    "StarTrailSchedule",
    "TaspSchedule",
    "TeamSchedule",
    "build_schedule",
    "register_schedule",
    "schedule_spec",
]
