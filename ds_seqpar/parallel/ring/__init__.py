"""The ring engine (docs/ring.md), split by job:

* ``tasks.py``: the kernel calls of one step as data (pure functions of positions, documents, a mask spec);
* ``plan.py``: ``RingPlan`` and the planning entry points with the one plan cache;
* ``execute.py``: one step's calls through the kernel-call table shared by forward and backward;
* ``engine.py``: the forward / backward loops, the autograd Function and ``ring_attention``.

The names below are what users import from ``ds_seqpar.parallel.ring``.
"""

from ds_seqpar.comm.schedules import Schedule, build_schedule
from ds_seqpar.parallel.ring.engine import (
    OutputDelta,
    check_qkv,
    check_sinks,
    engine_backward,
    engine_forward,
    engine_pair_backward,
    ring_attention,
)
from ds_seqpar.parallel.ring.plan import RingPlan
from ds_seqpar.parallel.work import WorkCounter

__all__ = [
    "OutputDelta",
    "RingPlan",
    "Schedule",
    "WorkCounter",
    "build_schedule",
    "check_qkv",
    "check_sinks",
    "engine_backward",
    "engine_forward",
    "engine_pair_backward",
    "ring_attention",
]
