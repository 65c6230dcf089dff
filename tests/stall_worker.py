"""One rank of the stall sweep (tests/test_faults.py): a tiny HF model trained through
``ds_seqpar.initialize`` with ZeRO-3, every step (and a checkpoint save) inside ``StepWatch``; the
culprit rank sends itself SIGSTOP at a chosen stall point.

A stall point is ``"STEP:PHASE:FUNCTION:K"``: the K-th call of ``torch.distributed.FUNCTION`` during
PHASE (``forward``, ``backward``, ``step`` = DeepSpeed's optimizer step, ``save`` = ``save_checkpoint``)
of training step STEP. Every communication function is wrapped before DeepSpeed starts (DeepSpeed keeps
references to some), so its calls are counted per (step, phase); the scan's ``isend`` / ``irecv`` are
counted through ``ds_seqpar.comm.scan``'s own ``dist`` (``P2POp`` needs the real functions).

Run as ``python -m tests.stall_worker SPEC_JSON`` with the torch.distributed environment variables set;
SPEC: ``model``, ``sp``, ``u``, ``timeout`` (``fault_timeout_s``), ``culprit``, ``point`` (or null: no
stall), ``steps``, ``save_at`` (the step after which the checkpoint is saved), ``seq_len``, ``out`` (a
directory). Files written to ``out``: ``stall.json`` (the culprit, just before it stops: time, point),
``fail<rank>.json`` (a survivor's ``StepFailed``: time, message), ``groups<rank>.json`` (every process
group torch knows of after ``ds_seqpar.initialize`` and a ring subgroup: ranks, timeout),
``trace<rank>.json`` (calls per (step, phase, function) of a run without stall). A survivor exits 3.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

COUNTED = (
    "all_to_all_single",
    "batch_isend_irecv",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "broadcast",
    "barrier",
    "all_gather_object",
    "broadcast_object_list",
)
SCAN_COUNTED = ("isend", "irecv")


class Stalls:
    """Counts communication calls per (step, phase, function); the culprit stops at its point."""

    def __init__(self, spec: dict[str, Any], rank: int) -> None:
        self.spec, self.rank = spec, rank
        self.step, self.phase = 0, "init"
        self.counts: collections.Counter = collections.Counter()
        point = spec.get("point")
        self.point = None if point is None else tuple(point.split(":"))

    def wrap(self, name: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            key = (str(self.step), self.phase, name)
            self.counts[key] += 1
            if self.rank == self.spec["culprit"] and self.point == (*key, str(self.counts[key])):
                self.stop()
            return fn(*args, **kwargs)

        return counted

    def stop(self) -> None:
        out = Path(self.spec["out"])
        tmp = out / "stall.json.tmp"  # written whole, then renamed: the test polls the file while this runs
        tmp.write_text(json.dumps({"time": time.time(), "rank": self.rank, "point": self.spec["point"]}))
        os.replace(tmp, out / "stall.json")
        os.kill(os.getpid(), signal.SIGSTOP)

    def install(self) -> None:
        for name in COUNTED:
            setattr(dist, name, self.wrap(name, getattr(dist, name)))
        from ds_seqpar.comm import scan

        scan.dist = _ScanDist(self)

    def trace(self) -> dict[str, int]:
        return {":".join(key): n for key, n in sorted(self.counts.items())}


class _ScanDist:
    """``torch.distributed`` as ``ds_seqpar.comm.scan`` sees it, with ``isend`` / ``irecv`` counted."""

    def __init__(self, stalls: Stalls) -> None:
        self._wrapped = {name: stalls.wrap(name, getattr(dist, name)) for name in SCAN_COUNTED}

    def __getattr__(self, name: str) -> Any:
        return self._wrapped.get(name) or getattr(dist, name)


def _groups() -> list[dict[str, Any]]:
    """Every process group torch knows of on this rank: its ranks and its timeout in seconds."""
    from ds_seqpar.mesh import group_timeout_s

    c10d = dist.distributed_c10d
    return [
        {"ranks": dist.get_process_group_ranks(pg), "timeout_s": group_timeout_s(pg)}
        for pg in list(c10d._world.pg_map)
        if pg is not None and pg is not c10d.GroupMember.NON_GROUP_MEMBER
    ]


def _config(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "sequence_parallel": {
            "size": spec["sp"],
            "ulysses_degree": spec["u"],
            "fault_timeout_s": spec["timeout"],
        },
    }


def _file_barrier(out: Path, rank: int, world: int, limit_s: float = 600.0) -> None:
    """Wait until every rank has written its ready file: on a loaded machine the imports of the ranks end
    far apart, and the rendezvous and every collective wait only ``fault_timeout_s`` for a peer."""
    (out / f"ready{rank}").touch()
    deadline = time.time() + limit_s
    while not all((out / f"ready{r}").exists() for r in range(world)):
        if time.time() > deadline:
            raise TimeoutError(f"rank {rank}: not every rank got ready within {limit_s:.0f} s")
        time.sleep(0.05)


def _train(spec: dict[str, Any], stalls: Stalls) -> None:
    import ds_seqpar
    from ds_seqpar import shard_batch
    from tests.helpers.hf_models import batches, tiny_model

    model = tiny_model(spec["model"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = Path(spec["out"])
    _file_barrier(out, stalls.rank, spec["sp"])  # imports and model built: start together
    engine, _, _, _ = ds_seqpar.initialize(model=model, config=_config(spec), optimizer=optimizer)
    mesh = engine.seqpar_mesh
    mesh.ring_subgroup("stall_worker", [list(range(mesh.ring_size))])  # a schedule's subgroup, as StarTrail's
    (out / f"groups{stalls.rank}.json").write_text(json.dumps(_groups()))
    watch = ds_seqpar.StepWatch()
    data = batches(spec["steps"], 1, spec["seq_len"], seed=3)
    for step in range(1, spec["steps"] + 1):
        stalls.step = step
        shard = shard_batch(dict(data[step - 1]), mesh, objective=engine.module.objective)
        with watch.step(step):
            stalls.phase = "forward"
            loss = engine(**shard)
            stalls.phase = "backward"
            engine.backward(loss)
            stalls.phase = "step"
            engine.step()
        if step == spec["save_at"]:
            with watch.step(step, what="checkpoint save"):
                stalls.phase = "save"
                engine.save_checkpoint(str(out / "ckpt"), tag=f"step{step}")
        stalls.phase = "between"
    watch.close()
    (out / f"trace{stalls.rank}.json").write_text(json.dumps(stalls.trace(), indent=1))
    dist.barrier()


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    stalls = Stalls(spec, rank)
    stalls.install()
    from ds_seqpar.comm.step_watch import StepFailed

    try:
        _train(spec, stalls)
    except StepFailed as exc:
        at = time.time()
        (Path(spec["out"]) / f"fail{rank}.json").write_text(json.dumps({"time": at, "message": str(exc)}))
        print(f"StepFailed: {exc}", file=sys.stderr, flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
