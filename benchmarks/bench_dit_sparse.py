"""Block-sparse DiT attention on CPU gloo ranks: ρ_s per balancing and factorisation, fwd+bwd time vs dense SP.

Run with PyTorch's launcher (one process per rank)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.bench_dit_sparse [--quick]

Patterns: the shipped ones (``assets/dit_patterns``, ``ops/sparse/dit_patterns.SHIPPED``): ``image`` (S = 4096,
8 x 8 blocks of G = 64) and ``video`` (S = 8192, 4 frames of 4 x 8 blocks), H = 8 heads with different densities.

1. ρ_s (docs/dit_sparse.md "ρ_s") of each pattern for every U x R of P = 4 and P = 8, with the ring
   layouts of ``balancing: none`` (contiguous, zigzag), ``stripe`` and ``dbsp``, computed by the planning
   code the call runs (``plan_dit_balance`` / ``dit_balance_rho``; no ranks needed); and the degree the
   predictor picks (``choose_degrees``, its pair cost calibrated by the dense run of step 2).
2. At P = world, U x R = 2 x 2, B = 1, H = H_kv = 8, D = 64, fp32, the same random q, k, v: fwd+bwd time
   (median of the slowest rank over ``reps`` after one warm-up) of dense SP
   (``ds_seqpar.attention(causal=False)``) and of ``block_sparse_attention`` with the shipped pattern
   under each balancing, with the pattern estimated in the call (keep = the pattern's density), and
   with ``degrees="auto"``.
Prints markdown on rank 0 and saves ``benchmarks/results/dit_sparse.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

import ds_seqpar
from benchmarks.common import RESULTS, slowest_rank_median
from ds_seqpar import DitSparseSettings, SeqParMesh, block_sparse_attention, dit_sparse_stats
from ds_seqpar.comm.all_to_all import HeadPlan
from ds_seqpar.layout import ring_layout
from ds_seqpar.ops.sparse.dit_patterns import SHIPPED, load_shipped
from ds_seqpar.parallel.dit_balance import dit_balance_rho, plan_dit_balance
from ds_seqpar.parallel.dit_degrees import DegreeCost, allowed_degrees, choose_degrees

H, D = 8, 64


def rho_rows(name: str) -> list[dict]:
    """ρ_s of the shipped pattern ``name`` for each (P, U x R, balancing)."""
    pattern, rows = load_shipped(name), []
    g = pattern.block_size
    for p in (4, 8):
        for u, r in allowed_degrees(p, H, pattern.seq_len, g, "dbsp"):
            heads = HeadPlan.build(H, H, u)
            runs = {
                "none (contiguous)": ("none", ring_layout("contiguous", r)),
                "none (zigzag)": ("none", ring_layout("zigzag", r)),
                "stripe": ("stripe", None),
                "dbsp": ("dbsp", None),
            }
            row = {"pattern": name, "P": p, "UxR": f"{u}x{r}"}
            for label, (balancing, layout) in runs.items():
                plan = plan_dit_balance(pattern, layout or ring_layout("stripe", r, g), H, heads, balancing)
                row[label] = dit_balance_rho(pattern, plan, r)
                row["moved" if balancing == "dbsp" else "_"] = plan.blocks_moved
            rows.append(row)
    return rows


def timed(mesh: SeqParMesh, q, k, v, dout, reps: int, call) -> float:
    me, layout = mesh.coords.sp_rank, ds_seqpar.input_layout(mesh)
    ql, kl, vl = (layout.shard(t, me).detach().clone().requires_grad_() for t in (q, k, v))
    dl = layout.shard(dout, me)
    return slowest_rank_median(lambda: call(ql, kl, vl, mesh).backward(dl), reps)


def time_pattern(name: str, base: SeqParMesh, reps: int) -> list[dict]:
    pattern = load_shipped(name)
    s, g = pattern.seq_len, pattern.block_size
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, s, H, D, generator=gen) for _ in range(4))
    mesh = base.with_section(
        {"size": base.sp_size, "ulysses_degree": base.ulysses_size, "ring": {"layout": "zigzag"}}
    )
    rows = [{"run": "dense SP (zigzag)", "time_s": timed(mesh, q, k, v, dout, reps, lambda a, b, c, m: ds_seqpar.attention(a, b, c, mesh=m, causal=False)), "density": 1.0, "rho_s": None, "degrees": f"{base.ulysses_size}x{base.ring_size}"}]  # fmt: skip
    density = pattern.density()
    runs = [(f"sparse {b}", DitSparseSettings(g, balancing=b), pattern) for b in ("none", "stripe", "dbsp")]
    runs.append(
        ("sparse dbsp, estimated", DitSparseSettings(g, keep=round(density, 3), balancing="dbsp"), None)
    )
    runs.append(
        ("sparse dbsp, degrees auto", DitSparseSettings(g, balancing="dbsp", degrees="auto"), pattern)
    )
    for label, settings, given in runs:

        def call(a, b, c, m, settings=settings, given=given):
            return block_sparse_attention(a, b, c, mesh=m, pattern=given, budget=settings, layer=0)

        t = timed(mesh, q, k, v, dout, reps, call)
        st = dit_sparse_stats(mesh)[0]
        rows.append({"run": label, "time_s": t, "density": st.density, "rho_s": st.rho_s,
                     "degrees": f"{st.degrees[0]}x{st.degrees[1]}"})  # fmt: skip
        if dist.get_rank() == 0:
            print(name, rows[-1], flush=True)
    for row in rows:
        row["pattern"], row["S"], row["speedup"] = name, s, rows[0]["time_s"] / row["time_s"]
    return rows


def _table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    def cell(value, spec):
        return "-" if value is None else format(value, spec)

    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(key), spec) for _, key, spec in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


RHO_COLS = [("pattern", "pattern", "s"), ("P", "P", "d"), ("U x R", "UxR", "s"),
            ("none (contiguous)", "none (contiguous)", ".3f"), ("none (zigzag)", "none (zigzag)", ".3f"),
            ("stripe", "stripe", ".3f"), ("dbsp", "dbsp", ".3f"), ("dbsp blocks moved", "moved", "d")]  # fmt: skip
TIME_COLS = [("pattern", "pattern", "s"), ("S", "S", "d"), ("run", "run", "s"), ("U x R", "degrees", "s"),
             ("time (s)", "time_s", ".2f"), ("speed-up vs dense", "speedup", ".2f"), ("density", "density", ".4f"),
             ("rho_s", "rho_s", ".3f")]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the image pattern only, one repetition")
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, rank0 = dist.get_world_size(), dist.get_rank() == 0
    reps = args.reps or (1 if args.quick else 3)
    names = ["image"] if args.quick else list(SHIPPED)
    base = SeqParMesh.build(world, 2 if world % 2 == 0 else 1)
    timed_rows = [row for name in names for row in time_pattern(name, base, reps)]
    if rank0:
        rho = [row for name in names for row in rho_rows(name)]
        choices = []
        for name in names:  # pair cost from the dense run: its time over the pairs each rank computes
            pattern, dense = load_shipped(name), next(r for r in timed_rows if r["pattern"] == name)
            cost = DegreeCost(pair_s=dense["time_s"] / (pattern.seq_len**2 * H / world))
            for p in (4, 8):
                choice = choose_degrees(pattern, H, p, D, cost=cost)
                choices.append({"pattern": name, "P": p, "pair_s": cost.pair_s, "elem_s": cost.elem_s,
                                "chosen": f"{choice.degrees[0]}x{choice.degrees[1]}",
                                "table": {f"{t.ulysses}x{t.ring}": [t.rho_s, t.total_s] for t in choice.table}})  # fmt: skip
        meta = {"world": world, "H": H, "D": D, "reps": reps, "dtype": "float32", "B": 1,
                "patterns": {n: SHIPPED[n].__dict__ for n in names}}  # fmt: skip
        md = (
            "## rho_s of the shipped patterns (pure arithmetic on the pattern)\n\n" + _table(rho, RHO_COLS)
            + f"\n## fwd+bwd, non-causal, fp32, B=1, H=H_kv={H}, D={D}, P={world} gloo CPU ranks (1 thread each),"
            f" median of {reps}\n\n" + _table(timed_rows, TIME_COLS)
            + "\n## degree choice (choose_degrees, pair cost from the dense run)\n\n"
            + _table(choices, [("pattern", "pattern", "s"), ("P", "P", "d"), ("chosen U x R", "chosen", "s")])
        )  # fmt: skip
        out = "dit_sparse_quick" if args.quick else "dit_sparse"
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{out}.md").write_text(md)
        payload = {"meta": meta, "rho": rho, "timed": timed_rows, "choices": choices}
        (RESULTS / f"{out}.json").write_text(json.dumps(payload, indent=2, default=str))
        print(md + f"\nresults in {RESULTS}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
