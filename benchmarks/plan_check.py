"""The planner against measurement: tiny Llama training steps on CPU gloo ranks vs ``--cluster local``.

Run (the driver launches ``torchrun`` once per P under ``flock /tmp/heavy.lock``, then compares)::

    .venv/bin/python -m benchmarks.plan_check                     # measure and compare (≈ 8 min on 2 cores)
    .venv/bin/python -m benchmarks.plan_check --compare-only      # compare the saved measurement again

Measured per (P, S, configuration): the step of ``benchmarks/suites/e2e.py`` (``assets/tiny-llama``'s
config, random weights, fp32, sdpa: forward, SP-group loss, backward, gradient all-reduce, AdamW), the
slowest rank's median of ``--reps`` after a warm-up, and the peak resident-memory growth of one step
(max over ranks). Predicted: ``ds_seqpar.plan`` with the local profile (measured first, cached) for the
same candidate: its step seconds and its in-step bytes (``MemoryEstimate.step_bytes``, no ZeRO: what the
step adds on top of the resting state, as the e2e suite's memory column). Ranking: per (P, S), whether
the configuration the planner predicts fastest is the measured fastest or within 5 % of it. Saves
``benchmarks/results/plan_check.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RAW = RESULTS / "plan_check_raw.json"
MODEL = ROOT / "assets" / "tiny-llama"
SEQ_LENS = (2048, 4096, 8192, 16384)
TOLERANCE = 0.15
RANK_SLACK = 0.05
# (name, Candidate keyword arguments) per P; ranks_per_node = 2 makes R_in = 2 a double ring over 2 "nodes"
CONFIGS = {
    2: [
        ("U1 R2 ring", {"ulysses": 1}),
        ("U1 R2 all_gather", {"ulysses": 1, "schedule": "all_gather"}),
        ("U2 R1", {"ulysses": 2}),
    ],
    4: [
        ("U1 R4 ring", {"ulysses": 1}),
        ("U1 R4 double ring", {"ulysses": 1, "inner": 2}),
        ("U1 R4 all_gather", {"ulysses": 1, "schedule": "all_gather"}),
        ("U2 R2 ring", {"ulysses": 2}),
        ("U2 R2 all_gather", {"ulysses": 2, "schedule": "all_gather"}),
        ("U4 R1", {"ulysses": 4}),
        ("U2 R2 ring, checkpointing+tiled", {"ulysses": 2, "memory": "checkpointing+tiled"}),
    ],
}


def _candidate(size: int, kwargs: dict):
    from ds_seqpar.plan import Candidate

    return Candidate(size, **kwargs)


# ----------------------------------------------------------------------------------------------- worker


def _worker(seq_lens: list[int], reps: int, out: str) -> None:
    """One torchrun process: every configuration of this P at every S (round-robin per S)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks import measure
    from benchmarks.common import gather_floats
    from ds_seqpar import SeqParCausalLM, SeqParMesh, shard_batch

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    systems = []
    for name, kwargs in CONFIGS[world]:
        torch.manual_seed(0)
        cfg = AutoConfig.from_pretrained(MODEL)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
        section = {
            **_candidate(world, kwargs).section(),
            "ranks_per_node": 2 if kwargs.get("inner") else world,
        }
        mesh = SeqParMesh.from_config(section, cfg)
        wrapped = SeqParCausalLM(model, mesh)
        systems.append((name, mesh, wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-4)))
    rows = []
    for seq_len in seq_lens:
        ids = torch.randint(4, 133, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))
        steps = []
        for _, mesh, model, opt in systems:

            def step(mesh=mesh, model=model, opt=opt, ids=ids) -> None:
                loss = model(**shard_batch({"input_ids": ids}, mesh))
                loss.backward()
                grads = [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]
                flat = torch.cat(grads)
                dist.all_reduce(flat)  # the e2e suite's gradient sum over the SP group
                opt.step()
                opt.zero_grad(set_to_none=True)

            step()  # warm-up
            steps.append(step)
        times = measure.round_robin_times(steps, reps)
        for i, step in enumerate(steps):
            with measure.PeakMemory() as mem:
                step()
            peak = max(gather_floats(mem.peak_mib))
            rows.append({"P": world, "S": seq_len, "config": systems[i][0], "time_s": statistics.median(times[i]),
                         "times_s": times[i], "peak_MiB": peak})  # fmt: skip
            if dist.get_rank() == 0:
                print(
                    f"[P={world} S={seq_len}] {systems[i][0]}: {rows[-1]['time_s']:.3f} s, {peak:.1f} MiB",
                    flush=True,
                )
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- driver


def _measure(sizes: list[int], seq_lens: list[int], reps: int) -> list[dict]:
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    for p in sizes:
        out = RESULTS / f"plan_check_p{p}.tmp.json"
        cmd = ["flock", "/tmp/heavy.lock", str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node",
               str(p), "-m", "benchmarks.plan_check", "--worker", "--out", str(out), "--reps", str(reps),
               "--seq-lens", *map(str, seq_lens)]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
        rows += json.loads(out.read_text())
        out.unlink()
    return rows


def _profile(sizes: list[int], profile: str | None) -> None:
    """Measure (or read) the local profile and the latencies of every P, under the heavy-run lock."""
    cmd = ["flock", "/tmp/heavy.lock", sys.executable, "-m", "benchmarks.plan_check", "--profile-only",
           "--sizes", *map(str, sizes), *(["--profile", profile] if profile else [])]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True)


def _profile_here(sizes: list[int], profile: str | None) -> None:
    from ds_seqpar.plan import load_model_config, plan_context

    config, _ = load_model_config(MODEL)
    for p in sizes:
        ctx = plan_context(
            config, world=p, ranks_per_node=p, cluster="local", seq_len=4096, profile_path=profile
        )
        print(f"P={p}: {ctx.profile}", flush=True)


def _predict(rows: list[dict], profile: str | None) -> dict:
    """The planner's prediction for every measured row, and the local profile it used."""
    from ds_seqpar.config import parse_section
    from ds_seqpar.plan import load_model_config, plan_context, predict
    from ds_seqpar.settings import resolve_settings

    config, _ = load_model_config(MODEL)
    profile_json = None
    for row in rows:
        p, s = row["P"], row["S"]
        kwargs = dict(CONFIGS[p])[row["config"]]
        ctx = plan_context(config, world=p, ranks_per_node=p, cluster="local", seq_len=s, zero_stage=0,
                           profile_path=profile, name="tiny-llama")  # fmt: skip
        c = _candidate(p, kwargs)
        section = {**c.section(), "ranks_per_node": 2 if kwargs.get("inner") else p}
        settings = resolve_settings(parse_section(section), config, p)
        pred = predict(ctx, c, settings, float("inf"))
        row["predicted_s"] = pred.step_s
        row["predicted_MiB"] = pred.step_bytes / 2**20
        row["time_error"] = pred.step_s / row["time_s"] - 1
        row["memory_error"] = row["predicted_MiB"] / row["peak_MiB"] - 1
        row["parts_s"] = pred.parts
        profile_json = ctx.profile.to_json()
    return {"profile": profile_json}


def _ranking(rows: list[dict]) -> list[dict]:
    """Per (P, S): the measured fastest, the planner's pick, and whether the pick is within 5 % of it."""
    cases = []
    for key in sorted({(r["P"], r["S"]) for r in rows}):
        group = [r for r in rows if (r["P"], r["S"]) == key]
        fastest = min(group, key=lambda r: r["time_s"])
        pick = min(group, key=lambda r: r["predicted_s"])
        ratio = pick["time_s"] / fastest["time_s"]
        second = sorted(r["time_s"] for r in group)[1] / fastest["time_s"] - 1
        # run-to-run noise: the median over configurations of (slowest - fastest repetition) / median
        noise = statistics.median((max(r["times_s"]) - min(r["times_s"])) / r["time_s"] for r in group)
        cases.append({"P": key[0], "S": key[1], "measured_fastest": fastest["config"], "planner_pick": pick["config"],
                      "pick_over_fastest": ratio, "hit": ratio <= 1 + RANK_SLACK, "runner_up_gap": second,
                      "repeat_spread": noise})  # fmt: skip
    return cases


def _markdown(rows: list[dict], cases: list[dict], meta: dict) -> str:
    t_ok = sum(abs(r["time_error"]) <= TOLERANCE for r in rows)
    m_ok = sum(abs(r["memory_error"]) <= TOLERANCE for r in rows)
    both = sum(abs(r["time_error"]) <= TOLERANCE and abs(r["memory_error"]) <= TOLERANCE for r in rows)
    hits = sum(c["hit"] for c in cases)
    lines = [
        "# The planner against measurement (tiny Llama, CPU, gloo)",
        "",
        "Generated by `python -m benchmarks.plan_check`; see docs/plan.md. Step: forward, loss, backward, gradient",
        "all-reduce, AdamW (fp32, 1 thread per rank, 2 cores); measured = slowest rank's median, peak = resident-",
        "memory growth of one step (max over ranks); predicted = `ds_seqpar.plan` with `--cluster local`",
        f"(profile: {meta['profile']['source']}).",
        "",
        f"Within {TOLERANCE:.0%}: step time {t_ok} of {len(rows)}, memory {m_ok} of {len(rows)}, both {both} of "
        f"{len(rows)}. Ranking: the planner's pick is the measured fastest or within {RANK_SLACK:.0%} of it in "
        f"{hits} of {len(cases)} cases.",
        "",
        "| P | S | configuration | measured s | predicted s | error | measured MiB | predicted MiB | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['P']} | {r['S']} | {r['config']} | {r['time_s']:.3f} | {r['predicted_s']:.3f} | "
                     f"{r['time_error']:+.0%} | {r['peak_MiB']:.1f} | {r['predicted_MiB']:.1f} | "
                     f"{r['memory_error']:+.0%} |")  # fmt: skip
    lines += [
        "",
        "Noise: runner-up gap = the second-fastest configuration's measured time over the fastest's, - 1;",
        "repeat spread = the median over the configurations of (slowest - fastest repetition) / median.",
        "",
        "| P | S | measured fastest | planner's pick | pick / fastest (measured) | hit | runner-up gap | repeat spread |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        lines.append(f"| {c['P']} | {c['S']} | {c['measured_fastest']} | {c['planner_pick']} | "
                     f"{c['pick_over_fastest']:.3f} | {'yes' if c['hit'] else 'no'} | {c['runner_up_gap']:.1%} | "
                     f"{c['repeat_spread']:.1%} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help="(internal) one torchrun process")
    ap.add_argument("--out", default=str(RAW))
    ap.add_argument("--sizes", type=int, nargs="+", default=sorted(CONFIGS))
    ap.add_argument("--seq-lens", type=int, nargs="+", default=list(SEQ_LENS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compare-only", action="store_true", help="compare the saved measurement again")
    ap.add_argument("--profile-only", action="store_true", help="(internal) measure the local profile")
    ap.add_argument(
        "--profile", help="the local profile's cache file (default ~/.cache/ds_seqpar/profile.json)"
    )
    args = ap.parse_args()
    if args.worker:
        _worker(args.seq_lens, args.reps, args.out)
        os._exit(0)
    if args.profile_only:
        _profile_here(args.sizes, args.profile)
        return
    _profile(args.sizes, args.profile)
    if not args.compare_only:
        RAW.write_text(json.dumps(_measure(args.sizes, args.seq_lens, args.reps), indent=1) + "\n")
    rows = json.loads(RAW.read_text())
    meta = _predict(rows, args.profile)
    cases = _ranking(rows)
    text = _markdown(rows, cases, meta)
    (RESULTS / "plan_check.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "ranking": cases}, indent=1) + "\n"
    )
    (RESULTS / "plan_check.md").write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
