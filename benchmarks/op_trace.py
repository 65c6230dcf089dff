"""The aten ops of one USP forward + backward per rank, to compare two commits op for op.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.op_trace OUT.json [--compare OLD.json]

For every U x R of the world (zigzag, causal, B = 1, H = 8, D = 64, S = 4096, fp32; H_kv = 8 and 2) it
runs ``ds_seqpar.attention`` once to warm up, then once under a dispatch mode that records every aten op
the forward and backward call, with the shape, strides and dtype of each tensor argument. Two commits
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


def trace(ulysses: int, h_kv: int) -> dict:
    """This rank's ops of one fwd+bwd on the U = ``ulysses`` mesh: count, per-op counts, SHA-256."""
    world = dist.get_world_size()
    section = {"size": world, "ulysses_degree": ulysses, "ring": {"layout": "zigzag"}}
    mesh = ds_seqpar.SeqParMesh.from_config(section)
    n = SEQ_LEN // world
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
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    results: dict[str, list[dict]] = {}
    for ulysses in sorted((u for u in range(1, world + 1) if world % u == 0), reverse=True):
        for h_kv in (HEADS, 2):
            mine = trace(ulysses, h_kv)
            gathered: list[dict] = [{} for _ in range(world)]
            dist.all_gather_object(gathered, mine)
            results[f"U x R {ulysses}x{world // ulysses} H_kv={h_kv}"] = gathered
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
