"""ds_seqpar and xfuser 0.7.0 side by side on the tiny DiTs: the same pipeline, weights and inputs
(``benchmarks/peers/xfuser_dit.py: make_inputs``), the same byte counter (``benchmarks/peers/comm_count.py``,
installed before either system communicates), time per step and the final latents against one process.

    bash benchmarks/peers/install.sh
    .venv/bin/python -m benchmarks.dit_vs_xfuser            # every case, both systems; writes the table

One case of ds_seqpar alone (what the driver launches; the flags are those of the xfuser runner)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 2 -m benchmarks.dit_vs_xfuser --family pixart \\
        --mode usp --ulysses 2 --out /tmp/ds_pixart_u2.json

ds_seqpar runs the degrees through ``ds_seqpar.dit.parallelize`` with the section
``{"size": U·R, "ulysses_degree": U, "dit": {"cfg_parallel": C, "pipefusion": {"degree": P, "patches": M,
"warmup_steps": W}}}`` (the pipefusion part only when P > 1); the seconds per step are the pipeline call over the steps (rank 0 also times the
one-process run). Results: ``benchmarks/results/dit_vs_xfuser.{md,json}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.peers import comm_count
from benchmarks.peers.xfuser_dit import (
    FAMILIES,
    _clock,
    call_kwargs,
    diffusers_pipeline,
    parse_args,
    step_seconds,
)

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results"
CASES = [  # (family, mode, flags); xfuser's ring needs its flash backend (served by the CPU shim)
    ("pixart", "usp", ["--ulysses", "2"]),
    ("pixart", "usp", ["--ulysses", "2", "--ring", "2", "--attention", "flash"]),
    ("pixart", "cfg", ["--cfg", "2"]),
    ("pixart", "cfg", ["--cfg", "2", "--ulysses", "2"]),
    ("pixart", "pipefusion", ["--pipefusion", "2", "--patches", "2", "--warmup", "1"]),
    ("pixart", "pipefusion", ["--pipefusion", "2", "--patches", "2", "--warmup", "8"]),
    ("sd3", "usp", ["--ulysses", "2"]),
    ("sd3", "usp", ["--ring", "2", "--attention", "flash"]),
    ("sd3", "cfg", ["--cfg", "2"]),
    ("flux", "usp", ["--ulysses", "2"]),
    ("flux", "usp", ["--ulysses", "2", "--ring", "2", "--attention", "flash"]),
]


def timed(pipe, args) -> tuple[torch.Tensor, float]:
    """Final latents and seconds per step, timed as the xfuser runner does: the scheduler's ``step`` calls
    timestamped, the median over steps 2..N (the first step pays the one-off costs)."""
    kwargs = call_kwargs(args.family, args, FAMILIES[args.family][4])
    pipe.set_progress_bar_config(disable=True)
    stamps = _clock(pipe.scheduler)
    start = time.perf_counter()
    with torch.no_grad():
        latents = pipe(**kwargs).images
    steps = step_seconds([start, *stamps], [1] * args.steps)
    return latents, float(torch.tensor(steps[1:]).median())


def run_ds_seqpar(argv: list[str]) -> None:
    """One case under torchrun: the reference on rank 0, then ds_seqpar on every rank; rank 0 writes the JSON.
    The byte counter is installed before ds_seqpar is imported (ds_seqpar binds its collectives at import)."""
    if "ds_seqpar" in sys.modules:
        raise RuntimeError("dit_vs_xfuser: ds_seqpar was imported before the byte counter")
    comm_count.install()
    from ds_seqpar.dit import parallelize

    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ref, ref_step = timed(diffusers_pipeline(args.family, args.seed), args) if rank == 0 else (None, None)
    dist.barrier()
    pipe = diffusers_pipeline(args.family, args.seed)
    dit: dict = {"cfg_parallel": args.cfg}
    if args.pipefusion > 1:
        dit["pipefusion"] = {
            "degree": args.pipefusion,
            "patches": args.patches or 2,
            "warmup_steps": args.warmup,
        }
    section = {"size": args.ulysses * args.ring, "ulysses_degree": args.ulysses, "dit": dit}
    run = parallelize(pipe, {"sequence_parallel": section})
    dist.barrier()
    comm_count.COUNTS.clear()
    run.mesh.comm_stats.reset()
    latents, step = timed(pipe, args)
    sent = sum(b for b, _ in comm_count.COUNTS.values()) / args.steps
    own = run.mesh.comm_stats.total_bytes / args.steps
    totals = [None] * dist.get_world_size()
    dist.all_gather_object(totals, (sent, step, own))
    run.remove()
    if rank == 0:
        diff = float((latents - ref).abs().max())
        record = {"system": "ds_seqpar", "args": {k: str(v) for k, v in vars(args).items()}, "status": "ok",
                  "seconds_per_step": max(t[1] for t in totals), "one_process_seconds_per_step": ref_step,
                  "bytes_per_step": sum(t[0] for t in totals), "commstats_bytes_per_step": sum(t[2] for t in totals),
                  "max_abs_diff": diff, "max_rel_diff": diff / float(ref.abs().max())}  # fmt: skip
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def launch(module: str, family: str, mode: str, flags: list[str], out: Path) -> dict:
    ranks = 1
    for name in ("--ulysses", "--ring", "--cfg", "--pipefusion"):
        if name in flags:
            ranks *= int(flags[flags.index(name) + 1])
    cmd = [str(REPO / ".venv" / "bin" / "torchrun"), "--nproc_per_node", str(ranks), "-m", module,
           "--family", family, "--mode", mode, *flags, "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if out.exists():
        return json.loads(out.read_text())
    return {"status": "failed", "returncode": done.returncode, "tail": (done.stdout + done.stderr)[-1500:]}


def main() -> None:
    rows = []
    for family, mode, flags in CASES:
        tag = f"{family}-{mode}-{'-'.join(f.strip('-') for f in flags)}"
        ds = launch("benchmarks.dit_vs_xfuser", family, mode, flags, Path(f"/tmp/ds_{tag}.json"))
        xf = launch("benchmarks.peers.xfuser_dit", family, mode, flags, Path(f"/tmp/xf_{tag}.json"))
        rows.append({"family": family, "mode": mode, "flags": " ".join(flags), "ds_seqpar": ds, "xfuser": xf})
        print(tag, ds.get("status"), xf.get("status"), flush=True)

    def cell(r: dict, key: str, fmt: str) -> str:
        return (
            fmt.format(r[key]) if r.get("status") == "ok" and r.get(key) is not None else r.get("status", "-")
        )

    lines = ["| family | degrees | ms / step ds_seqpar | ms / step xfuser | KiB / step ds_seqpar | KiB / step xfuser "
             "| max rel diff ds_seqpar | max rel diff xfuser |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        ds, xf = row["ds_seqpar"], row["xfuser"]
        ms = [cell(r, "seconds_per_step", "{:.4f}") for r in (ds, xf)]
        ms = [f"{float(m) * 1000:.1f}" if m.replace(".", "").isdigit() else m for m in ms]
        kib = [cell(r, "bytes_per_step", "{:.0f}") for r in (ds, xf)]
        kib = [f"{int(k) / 1024:.1f}" if k.isdigit() else k for k in kib]
        rel = [cell(r, "max_rel_diff", "{:.1e}") for r in (ds, xf)]
        lines.append(
            f"| {row['family']} | {row['flags']} | {ms[0]} | {ms[1]} | {kib[0]} | {kib[1]} | {rel[0]} | {rel[1]} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "dit_vs_xfuser.md").write_text(text)
    (OUT / "dit_vs_xfuser.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    if "--family" in sys.argv:
        run_ds_seqpar(sys.argv[1:])
    else:
        main()
