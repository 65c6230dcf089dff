"""Forward + backward time of one causal attention block per kernel on this machine's CPU.

Legend: B=1, H=8, D=64, fp32, causal, S in {1k, 4k, 16k} (``--quick``: 256, 512, 1k).
Rows:
    torch      chunked pure-PyTorch kernel, causal flag (the reference kernel)
    sdpa       PyTorch's CPU flash op, causal flag (what a CAUSAL block runs)
    sdpa+mask  same op with an explicit [S, S] mask (what a PARTIAL block costs)
    dense      naive materialised softmax + autograd (dense_attention_reference), S <= 4k only

Rows run interleaved (round by round, so load from other processes hits every kernel alike), at
least ``--reps`` rounds and more for short blocks (until about 2 s per row). Reported: median fwd,
median bwd, their sum, and the fastest single fwd+bwd run ("min"). A row whose estimate (last
size's time scaled by S²) exceeds ``--budget`` seconds is skipped. Writes
``benchmarks/results/block_attention_cpu.json`` and checks that ``auto`` picks the fastest kernel.

Usage: python benchmarks/bench_block_attention.py [--quick] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="small sizes (256, 512, 1024) for a smoke run")
    p.add_argument("--sizes", type=int, nargs="+", help="sequence lengths (overrides the defaults)")
    p.add_argument("--reps", type=int, default=3, help="timed runs per measurement (median is reported)")
    p.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads")
    p.add_argument("--budget", type=float, default=60.0, help="skip a measurement estimated above this (s)")
    p.add_argument("--dense-max", type=int, default=4096, help="largest S for the naive dense reference")
    p.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "block_attention_cpu.json",
        help="JSON output path",
    )
    return p.parse_args()


ARGS = _parse()
os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)  # before torch is imported

import torch  # noqa: E402

from ds_seqpar.ops import (  # noqa: E402
    block_attn_backward,
    block_attn_forward,
    dense_attention_reference,
    resolve_kernel,
)

B, H, D = 1, 8, 64
DTYPE = torch.float32
EXACT_KERNELS = ("torch", "sdpa")  # candidates for `auto` on CPU
MIN_TOTAL_S, MAX_RUNS = 2.0, 50


def _kernel_step(kernel: str, explicit_mask: bool) -> Callable[..., tuple[float, float]]:
    def step(q, k, v, dout, mask):
        kw = {"mask": mask} if explicit_mask else {"causal": True}
        t0 = time.perf_counter()
        out, lse = block_attn_forward(q, k, v, kernel=kernel, **kw)
        t1 = time.perf_counter()
        block_attn_backward(dout, q, k, v, out, lse, kernel=kernel, **kw)
        return t1 - t0, time.perf_counter() - t1

    return step


def _dense_step(q, k, v, dout, mask) -> tuple[float, float]:
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    t0 = time.perf_counter()
    out, _ = dense_attention_reference(q, k, v, mask)
    t1 = time.perf_counter()
    out.backward(dout)
    return t1 - t0, time.perf_counter() - t1


ROWS: dict[str, tuple[Callable[..., tuple[float, float]], bool]] = {
    # name: (step, needs an explicit bool mask)
    "torch": (_kernel_step("torch", explicit_mask=False), False),
    "sdpa": (_kernel_step("sdpa", explicit_mask=False), False),
    "sdpa+mask": (_kernel_step("sdpa", explicit_mask=True), True),
    "dense": (_dense_step, True),
}


def _measure(
    steps: dict[str, tuple[Callable[..., tuple[float, float]], torch.Tensor | None]],
    inputs: list[torch.Tensor],
    reps: int,
    warm_up: set[str],
) -> dict[str, list[tuple[float, float]]]:
    """(fwd, bwd) seconds of every run, per row. Rows run interleaved, round by round, so load from
    other processes hits all of them alike; at least ``reps`` rounds, more (up to ``MAX_RUNS``)
    until the rounds add up to ``MIN_TOTAL_S`` per row. Rows in ``warm_up`` get an untimed run first."""
    for name in warm_up:
        step, mask = steps[name]
        step(*inputs, mask)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    while True:
        for name, (step, mask) in steps.items():
            runs[name].append(step(*inputs, mask))
        rounds = len(next(iter(runs.values())))
        spent = sum(f + b for r in runs.values() for f, b in r)
        if rounds >= reps and (spent >= MIN_TOTAL_S * len(steps) or rounds >= MAX_RUNS):
            return runs


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> int:
    torch.set_num_threads(ARGS.threads)
    load_start = os.getloadavg()
    sizes = ARGS.sizes or ([256, 512, 1024] if ARGS.quick else [1024, 4096, 16384])
    reps = 2 if ARGS.quick and ARGS.reps == 3 else ARGS.reps
    auto = resolve_kernel("auto", "cpu", DTYPE)
    print(
        f"torch {torch.__version__}, {ARGS.threads} threads, B={B} H={H} D={D} {DTYPE}, causal; auto -> {auto}"
    )
    print(
        f"{'S':>6} {'kernel':<10} {'fwd s':>8} {'bwd s':>8} {'fwd+bwd s':>10} {'min s':>9} {'runs':>5}  note"
    )

    results: list[dict] = []
    last: dict[str, tuple[int, float]] = {}  # row -> (S, fwd+bwd) of its last measurement
    gen = torch.Generator().manual_seed(0)
    for s in sizes:
        inputs = [torch.randn(B, s, H, D, generator=gen, dtype=DTYPE) for _ in range(4)]
        bool_mask = torch.ones(s, s, dtype=torch.bool).tril()
        rows: dict[str, dict] = {}
        steps: dict[str, tuple[Callable[..., tuple[float, float]], torch.Tensor | None]] = {}
        warm_up: set[str] = set()
        for name, (step, needs_mask) in ROWS.items():
            row = rows[name] = {"S": s, "kernel": name, "status": "ok"}
            estimate = last[name][1] * (s / last[name][0]) ** 2 if name in last else None
            if name == "dense" and s > ARGS.dense_max:
                row["status"] = f"skipped (dense reference only up to S={ARGS.dense_max})"
            elif estimate is not None and estimate > ARGS.budget:
                row["status"] = f"skipped (too slow: estimated {estimate:.0f} s per fwd+bwd)"
                row["estimate_s"] = round(estimate, 1)
            else:
                steps[name] = (step, bool_mask if needs_mask else None)
                if estimate is None or estimate < 5.0:
                    warm_up.add(name)
        for name, runs in _measure(steps, inputs, reps, warm_up).items():
            fwd = statistics.median(f for f, _ in runs)
            bwd = statistics.median(b for _, b in runs)
            best = min(f + b for f, b in runs)
            rows[name].update(
                fwd_s=round(fwd, 4),
                bwd_s=round(bwd, 4),
                total_s=round(fwd + bwd, 4),
                min_total_s=round(best, 4),
            )
            rows[name]["runs"] = len(runs)
            last[name] = (s, fwd + bwd)
        for name, row in rows.items():
            results.append(row)
            if "total_s" in row:
                print(
                    f"{s:>6} {name:<10} {row['fwd_s']:>8.3f} {row['bwd_s']:>8.3f} {row['total_s']:>10.3f}"
                    f" {row['min_total_s']:>9.3f} {row['runs']:>5}"
                )
            else:
                print(f"{s:>6} {name:<10} {'-':>8} {'-':>8} {'-':>10} {'-':>9} {'-':>5}  {row['status']}")

    fastest: dict[int, str] = {}
    for s in sizes:
        timed = [r for r in results if r["S"] == s and r["kernel"] in EXACT_KERNELS and "total_s" in r]
        fastest[s] = min(timed, key=lambda r: r["total_s"])["kernel"]
    auto_ok = all(name == auto for name in fastest.values())
    print(f"auto picks {auto!r} for cpu/{DTYPE}; fastest exact kernel per S: {fastest}")
    print("auto is the fastest everywhere" if auto_ok else "WARNING: auto is NOT the fastest for every S")

    ARGS.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "block attention fwd+bwd, one causal block",
        "config": {"B": B, "H": H, "D": D, "dtype": str(DTYPE), "causal": True, "reps": reps, "median": True},
        "machine": {
            "torch": torch.__version__,
            "threads": ARGS.threads,
            "cpu": _cpu_name(),
            "python": platform.python_version(),
            "loadavg_start_end": [load_start, os.getloadavg()],  # other processes skew timings
        },
        "auto": auto,
        "fastest_exact": {str(s): k for s, k in fastest.items()},
        "auto_is_fastest": auto_ok,
        "results": results,
    }
    ARGS.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {ARGS.out}")
    return 0 if auto_ok else 1


if __name__ == "__main__":
    sys.exit(main())
