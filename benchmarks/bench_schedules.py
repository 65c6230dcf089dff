"""Every ring-axis schedule on CPU gloo ranks: fwd+bwd time, bytes by link class, busiest link, balance, error.

Run with PyTorch's launcher (one process per rank), 8 ranks simulated as 2 nodes of 4::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 8 -m benchmarks.bench_schedules [--quick]

Prints a markdown table on rank 0 and saves ``benchmarks/results/schedules_cpu.json`` and ``.md``.
Per schedule (through ``ds_seqpar.attention``, U = 1, zigzag): the median over repetitions of the slowest
rank's fwd+bwd time; the most intra-node and the most inter-node bytes any rank sends (forward + backward;
link classes from ``sequence_parallel.ranks_per_node`` = 4), and the most bytes on one directed link;
causal work max / mean over ranks (``WorkCounter``). Exactness is the tests' job
(``tests/test_schedules.py``).
On one CPU machine every "link" is shared memory, so time shows the schedules' overhead, not their
topology gains (those are modelled in benchmarks/project.py, docs/comm_model.md).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from benchmarks.common import gather_floats, save_results, slowest_rank_median
from ds_seqpar import SeqParMesh, input_layout
from ds_seqpar.parallel.ring import WorkCounter
from ds_seqpar.parallel.usp import attention

RANKS_PER_NODE = 4
VARIANTS = [  # (label, ring section, inner size of the mesh)
    ("ring", {"schedule": "p2p"}, None),
    ("double ring 2x4", {"schedule": "p2p", "inner_size": 4}, 4),
    ("all-gather", {"schedule": "all_gather"}, None),
    ("TASP d=8", {"schedule": "tasp"}, None),
    ("StarTrail C=2 (kv)", {"schedule": "startrail", "team_size": 2, "startrail_backward": "kv"}, None),
    ("StarTrail C=2 (query)", {"schedule": "startrail", "team_size": 2, "startrail_backward": "query"}, None),
    ("ATTENTION2D 2x4", {"schedule": "attention2d", "grid": [2, 4]}, None),
    ("ATTENTION2D 4x2", {"schedule": "attention2d", "grid": [4, 2]}, None),
]


def measure(mesh: SeqParMesh, seq_len: int, h: int, h_kv: int, d: int, reps: int) -> dict:
    layout = input_layout(mesh)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, seq_len, x, d, generator=g) for x in (h, h_kv, h_kv, h)]
    q, k, v, dout = (layout.shard(t, mesh.coords.sp_rank) for t in full)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    work = WorkCounter()

    def step() -> None:
        work.reset()
        with mesh.comm_stats.measure() as region:
            out = attention(q, k, v, mesh=mesh, causal=True, work=work)
            out.backward(dout)
        step.region = region

    seconds = slowest_rank_median(step, reps)
    links = step.region.link_bytes()
    busiest = max(step.region.peer_bytes().values())
    counts = gather_floats(work.forward_pairs)
    intra, inter, link = (gather_floats(x) for x in (links["intra"], links["inter"], busiest))
    return {
        "time_s": seconds,
        "intra_MiB": max(intra) / 2**20,
        "inter_MiB": max(inter) / 2**20,
        "busiest_link_MiB": max(link) / 2**20,
        "balance_max_over_mean": max(counts) / (sum(counts) / len(counts)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, one repetition (smoke run)")
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    if world != 8:
        raise SystemExit(f"benchmarks.bench_schedules runs on 8 ranks (2 simulated nodes of 4); got {world}")
    seq_lens = [448] if args.quick else [3584]  # multiples of 2 x 8 x 7 (zigzag over 8, TASP's 7 pieces)
    reps = args.reps or (1 if args.quick else 3)
    meshes = {inner: SeqParMesh.build(world, 1, inner) for inner in (None, 4)}
    rows = []
    for seq_len in seq_lens:
        for h_kv in (8, 2):
            for label, ring, inner in VARIANTS:
                section = {"size": world, "ulysses_degree": 1, "ring": {"layout": "zigzag", **ring}}
                mesh = meshes[inner].with_section({**section, "ranks_per_node": RANKS_PER_NODE})
                res = measure(mesh, seq_len, 8, h_kv, 64, reps)
                rows.append(
                    {"schedule": label, "S": seq_len, "H": 8, "H_kv": h_kv, "D": 64, "P": world, **res}
                )
                if dist.get_rank() == 0:
                    print(
                        f"S={seq_len} H_kv={h_kv} {label:22s} {res['time_s']:7.3f} s  intra {res['intra_MiB']:7.2f} "
                        f"inter {res['inter_MiB']:7.2f} link {res['busiest_link_MiB']:7.2f} MiB  balance "
                        f"{res['balance_max_over_mean']:.3f}",
                        flush=True,
                    )
    if dist.get_rank() == 0:
        title = (
            f"Schedules, fwd+bwd, causal, fp32, zigzag, B=1, H=8, D=64, P={world} gloo CPU ranks (1 thread each), "
            f"{RANKS_PER_NODE} ranks per simulated node"
        )
        meta = {"world": world, "ranks_per_node": RANKS_PER_NODE, "dtype": "float32", "causal": True}
        columns = [
            ("S", "S", "d"),
            ("H_kv", "H_kv", "d"),
            ("schedule", "schedule", "s"),
            ("time (s)", "time_s", ".3f"),
            ("intra MiB", "intra_MiB", ".2f"),
            ("inter MiB", "inter_MiB", ".2f"),
            ("busiest link MiB", "busiest_link_MiB", ".2f"),
            ("work max/mean", "balance_max_over_mean", ".3f"),
        ]
        print(
            save_results("schedules_cpu_quick" if args.quick else "schedules_cpu", title, meta, rows, columns)
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
