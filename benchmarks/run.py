"""One entry for every benchmark: ds_seqpar and its peers side by side, in the same run.

    python -m benchmarks.run --suite attention|e2e|memory|sparse|linear|all [--quick]

Each suite launches gloo ranks with ``torchrun`` (NCCL is not used on CPU), one thread per rank,
collects per-rank measurements, and writes ``benchmarks/results/<suite>.json``, ``<suite>.md`` and
``<suite>.png``; ``docs/performance.md`` is regenerated from whatever results exist. Peers
(``bash benchmarks/peers/install.sh``) that are missing or fail are reported in the tables with
the reason, never silently dropped.

Suites:
    attention  fwd+bwd of one attention layer, S in {4k, 16k} (64k with --seq-lens), H=8, H_kv in {8, 2},
               D=64, bf16, P in {2, 4}: time, efficiency vs T_limit, ratio to the fastest peer, bytes
               sent per rank, work balance, max abs error vs an fp64 single-process reference
    e2e        tiny Llama training step, ds_seqpar vs DeepSpeed ALST: tokens/s and peak memory per rank
    memory     largest S whose step fits --budget-mib per rank, at P = 1, 2, 4 (ds_seqpar and ALST)
    sparse     benchmarks.bench_sparse (rho_s per balancing, sparse vs dense time at P=4)
    linear     benchmarks.bench_linear (All-Scan vs all-gather bytes and time at P=4)

T_limit = T_single(S) / min(P, cores): T_single is the single-process, single-thread time of the same
local kernel (ds_seqpar's ``sdpa`` kernel: PyTorch's CPU flash op) on the whole sequence, measured
in this run; efficiency = T_limit / T. T_ceiling is a no-communication reference: P processes at once,
each running the kernel on 1/P of the work (H/P heads), i.e. what the cores deliver together without
any SP overhead; vs ceiling = T_ceiling / T (on a shared VM it varies ~10 %, so values above 1 occur).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import report

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SUITES = ("attention", "e2e", "memory", "sparse", "linear")
# e2e/memory: large blocks are mmapped and returned on free, so resident memory tracks live tensors
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _torchrun(world: int, module: str, args: list[str], timeout: int, env: dict | None = None) -> None:
    cmd = [TORCHRUN, "--nproc_per_node", str(world), "--master_port", str(29500 + world), "-m", module, *args]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    started = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{module} on {world} ranks exited with {proc.returncode} after {time.time() - started:.0f} s"
        )


def _worker_rows(
    world: int, module: str, args: list[str], timeout: int, env: dict | None = None
) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        _torchrun(world, module, [*args, "--out", str(out)], timeout, env)
        return json.loads(out.read_text())


def _machine() -> dict:
    return {
        "torch": torch.__version__,
        "cores": os.cpu_count(),
        "cpu": next(
            (
                ln.split(":", 1)[1].strip()
                for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if "model name" in ln
            ),
            "?",
        ),
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def _kernel_times(
    seq_len: int, h: int, h_kv: int, d: int, dtype: torch.dtype, reps: int, before_each=None
) -> list[float]:
    """One thread, ds_seqpar's sdpa kernel fwd+bwd on the whole causal sequence; times after one warm-up.
    ``before_each()`` runs before every repetition (a barrier for concurrent processes)."""
    from ds_seqpar.ops.attention import block_attn_backward, block_attn_forward

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seq_len)
    q, dout = (torch.randn(1, seq_len, h, d, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, seq_len, h_kv, d, generator=g).to(dtype) for _ in range(2))
    times = []
    for _ in range(reps + 1):
        if before_each is not None:
            before_each()
        start = time.perf_counter()
        out, lse = block_attn_forward(q, k, v, causal=True, kernel="sdpa", out_dtype=dtype)
        block_attn_backward(dout, q, k, v, out, lse, causal=True, kernel="sdpa", grad_dtype=dtype)
        times.append(time.perf_counter() - start)
    return times[1:]


def single_kernel_time(seq_len: int, h: int, h_kv: int, d: int, dtype: torch.dtype, reps: int) -> float:
    """T_single: one process, one thread, the local kernel on the whole causal sequence (median)."""
    return statistics.median(_kernel_times(seq_len, h, h_kv, d, dtype, reps))


def _ceiling_rank(
    barrier, queue, seq_len: int, h: int, h_kv: int, d: int, dtype: torch.dtype, reps: int
) -> None:
    queue.put(_kernel_times(seq_len, h, h_kv, d, dtype, reps, before_each=barrier.wait))


def concurrent_kernel_time(
    seq_len: int, world: int, h: int, h_kv: int, d: int, dtype: torch.dtype, reps: int
) -> float:
    """The machine's ceiling for P ranks: P processes (one thread each) run, at the same moment, the
    local kernel on 1/P of the work (H/P heads of the whole causal sequence) with no communication.
    Median over repetitions of the slowest process."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(world), ctx.Queue()
    heads, kv_heads = max(1, h // world), max(1, h_kv // world)
    procs = [
        ctx.Process(target=_ceiling_rank, args=(barrier, queue, seq_len, heads, kv_heads, d, dtype, reps))
        for _ in range(world)
    ]
    for p in procs:
        p.start()
    per_rank = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    return statistics.median(max(ts) for ts in zip(*per_rank))


# ---------------------------------------------------------------------------------------------- suites


def suite_attention(args: argparse.Namespace) -> dict:
    seq_lens = args.seq_lens or ([1024, 4096] if args.quick else [4096, 16384])
    worlds = [2] if args.quick else [2, 4]
    reps = 1 if args.quick else args.reps
    kv_heads = [8, 2]
    # short cases are cheap and noisier: more repetitions for them
    short_reps = reps if args.quick else max(reps, 9)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    rows = []
    for world in worlds:
        for seq_len in seq_lens:
            extra = ["--seq-lens", str(seq_len), "--kv-heads", *map(str, kv_heads)]
            extra += ["--reps", str(short_reps if seq_len <= 4096 else reps), "--dtype", args.dtype]
            rows += _worker_rows(world, "benchmarks.suites.attention", extra, timeout=args.timeout)
    single = {}
    for seq_len in seq_lens:
        for h_kv in kv_heads:
            n = short_reps if seq_len <= 4096 else reps
            single[(seq_len, h_kv)] = single_kernel_time(seq_len, 8, h_kv, 64, dtype, n)
            print(
                f"[attention] T_single S={seq_len} H_kv={h_kv}: {single[(seq_len, h_kv)]:.3f} s", flush=True
            )
    ceiling = {}
    for world in worlds:
        for seq_len in seq_lens:
            for h_kv in kv_heads:
                n = short_reps if seq_len <= 4096 else reps
                ceiling[(world, seq_len, h_kv)] = concurrent_kernel_time(
                    seq_len, world, 8, h_kv, 64, dtype, n
                )
                print(
                    f"[attention] ceiling P={world} S={seq_len} H_kv={h_kv}: {ceiling[(world, seq_len, h_kv)]:.3f} s",
                    flush=True,
                )
    cores = os.cpu_count() or 1
    for row in rows:
        if row["status"] != "ok":
            continue
        row["T_ceiling_s"] = ceiling[(row["P"], row["S"], row["H_kv"])]
        row["vs_ceiling"] = row["T_ceiling_s"] / row["time_s"]
        t_single = single[(row["S"], row["H_kv"])]
        row["T_single_s"] = t_single
        row["T_limit_s"] = t_single / min(row["P"], cores)
        row["efficiency"] = row["T_limit_s"] / row["time_s"]
    for row in rows:
        peers = [
            r["time_s"]
            for r in rows
            if r["status"] == "ok"
            and r["peer"] != "ds_seqpar"
            and (r["P"], r["S"], r["H_kv"]) == (row["P"], row["S"], row["H_kv"])
        ]
        if row["status"] == "ok" and peers:
            row["vs_fastest_peer"] = row["time_s"] / min(peers)
    return {
        "meta": {
            "machine": _machine(),
            "dtype": args.dtype,
            "reps": f"{short_reps} (S <= 4096), {reps} (longer)",
            "seq_lens": seq_lens,
            "worlds": worlds,
            "T_single_s": {f"{s}/{h}": t for (s, h), t in single.items()},
        },
        "rows": rows,
    }


def suite_e2e(args: argparse.Namespace) -> dict:
    seq_lens = args.seq_lens or ([2048, 4096] if args.quick else [4096, 16384, 32768])
    worlds = [2] if args.quick else [1, 2, 4]
    reps = 1 if args.quick else args.reps
    rows = []
    for world in worlds:
        extra = ["--mode", "e2e", "--seq-lens", *map(str, seq_lens), "--reps", str(reps)]
        rows += _worker_rows(world, "benchmarks.suites.e2e", extra, timeout=args.timeout, env=MEMORY_ENV)
    return {
        "meta": {"machine": _machine(), "model": "assets/tiny-llama (random init), fp32", "reps": reps},
        "rows": rows,
    }


def suite_memory(args: argparse.Namespace) -> dict:
    worlds = [1, 2] if args.quick else [1, 2, 4]
    budget = args.budget_mib / (4 if args.quick else 1)
    rows = []
    for world in worlds:
        extra = ["--mode", "memory", "--budget-mib", str(budget), "--first-len", "2048"]
        rows += _worker_rows(world, "benchmarks.suites.e2e", extra, timeout=args.timeout, env=MEMORY_ENV)
    largest = {}
    for row in rows:
        if row["status"] == "ok" and row["fits"]:
            key = (row["peer"], row["P"])
            largest[key] = max(largest.get(key, 0), row["S"])
    summary = [
        {
            "peer": peer,
            "P": world,
            "largest_S": s,
            "vs_P1": s / largest[(peer, 1)] if (peer, 1) in largest else float("nan"),
        }
        for (peer, world), s in sorted(largest.items())
    ]
    return {
        "meta": {
            "machine": _machine(),
            "budget_MiB_per_rank": budget,
            "model": "assets/tiny-llama (random init), fp32",
        },
        "rows": rows,
        "summary": summary,
    }


def _existing_bench(module: str, world: int, quick: bool, timeout: int) -> dict:
    _torchrun(world, module, ["--quick"] if quick else [], timeout)
    return {"meta": {"machine": _machine(), "script": module}, "rows": []}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--suite", choices=[*SUITES, "all"], required=True)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes, one repetition: a smoke run (results get a _quick suffix)",
    )
    parser.add_argument(
        "--seq-lens", type=int, nargs="+", default=None, help="override the suite's sequence lengths"
    )
    parser.add_argument(
        "--reps", type=int, default=3, help="timed repetitions per case (median; one warm-up first)"
    )
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="attention suite dtype")
    parser.add_argument("--budget-mib", type=float, default=64.0, help="memory suite: per-rank budget")
    parser.add_argument("--timeout", type=int, default=5400, help="seconds per torchrun launch")
    args = parser.parse_args()

    RESULTS.mkdir(exist_ok=True)
    for suite in SUITES if args.suite == "all" else (args.suite,):
        name = f"{suite}_quick" if args.quick else suite
        if suite in ("sparse", "linear"):
            _existing_bench(f"benchmarks.bench_{suite}", 4, args.quick, args.timeout)
            continue
        result = globals()[f"suite_{suite}"](args)
        (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
        table = report.write_suite(suite, name, result)
        print(table)
    report.write_performance_doc()
    print(f"results in {RESULTS}; docs/performance.md regenerated")


if __name__ == "__main__":
    main()
