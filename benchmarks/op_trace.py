"""The aten ops of one USP forward + backward per rank, to compare two commits op for op.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.op_trace OUT.json [--compare OLD.json]
    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 8 -m benchmarks.op_trace OUT.json --schedules

Cases: every U x R of the world (zigzag, causal, B = 1, H = 8, D = 64, S = 4096, fp32; H_kv = 8 and 2);
with ``--schedules`` instead every ring schedule of ``benchmarks.bench_schedules`` (U = 1, 8 ranks as two
nodes of 4, S = 896). Each case runs ``ds_seqpar.attention`` once to warm up, then once under a dispatch
mode that records every aten op the forward and backward call, with the shape, strides and dtype of each
tensor argument. Two commits
whose traces agree run the same kernels on the same memory layouts in the same order, so a time
difference between them is the machine's, not the code's. OUT.json holds per case and rank the op count,
the count of each op and a SHA-256 of the whole trace; ``--compare`` exits 1 and names the differing rows.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import ds_seqpar
from benchmarks.bench_schedules import RANKS_PER_NODE, VARIANTS

SEQ_LEN, HEADS, HEAD_DIM = 4096, 8, 64


def _describe(arg: Any) -> str:
    """An op argument as text: tensors by shape, strides and dtype; containers element by element."""
    if isinstance(arg, torch.Tensor):
        return f"T{tuple(arg.shape)}{arg.stride()}{arg.dtype}"
    if isinstance(arg, (list, tuple)):
        return "[" + ",".join(_describe(a) for a in arg) + "]"
    if isinstance(arg, (int, float, bool, str, type(None))):
        return repr(arg)
    return type(arg).__name__


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append((str(func), f"{_describe(list(args))} {_describe(kwargs)}"))
        return func(*args, **kwargs)


def usp_cases(world: int) -> dict[str, tuple[dict, int]]:
    """Label -> (section, S): every U x R of ``world``, zigzag."""
    divisors = sorted((u for u in range(1, world + 1) if world % u == 0), reverse=True)
    return {
        f"U x R {u}x{world // u}": (
            {"size": world, "ulysses_degree": u, "ring": {"layout": "zigzag"}},
            SEQ_LEN,
        )
        for u in divisors
    }


def schedule_cases(world: int) -> dict[str, tuple[dict, int]]:
    """Label -> (section, S): each ring schedule of the schedules benchmark, U = 1, two nodes of 4."""
    if world != 8:
        raise SystemExit(f"--schedules runs on 8 ranks (2 simulated nodes of 4); got {world}")
    return {
        label: (
            {"size": world, "ulysses_degree": 1, "ranks_per_node": RANKS_PER_NODE,
             "ring": {"layout": "zigzag", **ring, **({"inner_size": inner} if inner else {})}},
            896,  # a multiple of 2 x 8 x 7 (zigzag over 8, TASP's 7 pieces)
        )
        for label, ring, inner in VARIANTS
    }  # fmt: skip


def trace(section: dict, seq_len: int, h_kv: int) -> dict:
    """This rank's ops of one fwd+bwd on the mesh of ``section``: count, per-op counts, SHA-256."""
    mesh = ds_seqpar.SeqParMesh.from_config(section)
    n = seq_len // dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, n, HEADS, HEAD_DIM, generator=g, requires_grad=True)
    k, v = (torch.randn(1, n, h_kv, HEAD_DIM, generator=g, requires_grad=True) for _ in range(2))
    dout = torch.randn(1, n, HEADS, HEAD_DIM, generator=g)
    ds_seqpar.attention(q, k, v, mesh=mesh, causal=True).backward(dout)  # warm-up: plans cached
    recorder = _OpRecorder()
    with recorder:
        ds_seqpar.attention(q, k, v, mesh=mesh, causal=True).backward(dout)
    text = "\n".join(f"{name} {args}" for name, args in recorder.ops)
    return {
        "ops": len(recorder.ops),
        "counts": dict(sorted(collections.Counter(name for name, _ in recorder.ops).items())),
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
    }


def compare(new: dict, old: dict) -> list[str]:
    """The (case, rank) rows whose traces differ, with their op counts."""
    bad = []
    for case, ranks in new.items():
        for rank, (a, b) in enumerate(zip(ranks, old.get(case, []), strict=False)):
            if a["sha256"] != b["sha256"]:
                bad.append(f"{case} rank {rank}: {a['ops']} ops vs {b['ops']} before")
        if len(old.get(case, [])) != len(ranks):
            bad.append(f"{case}: {len(ranks)} ranks vs {len(old.get(case, []))} before")
    return bad


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--compare", type=Path, default=None, help="an earlier OUT.json to check against")
    parser.add_argument("--schedules", action="store_true", help="every ring schedule on 8 ranks instead")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    results: dict[str, list[dict]] = {}
    cases = schedule_cases(world) if args.schedules else usp_cases(world)
    for label, (section, seq_len) in cases.items():
        for h_kv in (HEADS, 2):
            gathered: list[dict] = [{} for _ in range(world)]
            dist.all_gather_object(gathered, trace(section, seq_len, h_kv))
            results[f"{label} H_kv={h_kv}"] = gathered
    dist.destroy_process_group()
    if rank != 0:
        return
    args.out.write_text(json.dumps(results, indent=1))
    for case, ranks in results.items():
        print(f"{case}: {', '.join(str(r['ops']) for r in ranks)} ops per rank")
    if args.compare is not None:
        bad = compare(results, json.loads(args.compare.read_text()))
        print("\n".join(bad) if bad else f"every trace equals {args.compare}")
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
