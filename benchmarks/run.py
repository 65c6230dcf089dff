"""One entry for every benchmark: ds_seqpar and its peers side by side, in the same run.

    python -m benchmarks.run --suite attention|e2e|memory|sparse|linear|all [--quick]

Each suite launches gloo ranks with ``torchrun`` (NCCL is not used on CPU), one thread per rank,
collects per-rank measurements, and writes ``benchmarks/results/<suite>.json``, ``<suite>.md`` and
``<suite>.png``; ``docs/performance.md`` is regenerated from whatever results exist. Peers
(``bash benchmarks/peers/install.sh``) that are missing or fail are reported in the tables with
the reason, never silently dropped.

Suites:
    attention  fwd+bwd of one attention layer, S in {4k, 16k} (64k with --seq-lens), H=8, H_kv in {8, 2},
               D=64, bf16 (--dtype fp32: results attention_fp32.*), P in {2, 4}: time, efficiency vs
               T_limit, ratio to the fastest peer, bytes sent per rank, work balance, max abs error vs an
               fp64 single-process reference (rows beyond it are timed but marked "wrong result")
    packed     the same on packed documents (512 + 1024 + 2560, and 16 x 256 tokens at S = 4096), fp32,
               P in {2, 4}: ds_seqpar vs ring-flash-attn's varlen functions
    e2e        tiny Llama training step, ds_seqpar vs DeepSpeed ALST: tokens/s and peak memory per rank
    memory     largest S whose step fits --budget-mib per rank, at P = 1, 2, 4 (ds_seqpar and ALST)
    sparse     benchmarks.bench_sparse (rho_s per balancing, sparse vs dense time at P=4)
    linear     benchmarks.bench_linear (All-Scan vs all-gather bytes and time at P=4)

T_limit = T_single(S) / min(P, cores): T_single is the single-process, single-thread time of the same
local kernel (ds_seqpar's ``sdpa`` kernel: PyTorch's CPU flash op) on the whole sequence; efficiency =
T_limit / T. T_ceiling is a no-communication reference: the P ranks at once, each running the kernel
on 1/P of the work (H/P heads), i.e. what the cores deliver together without any SP overhead;
vs ceiling = T_ceiling / T. Both references are timed inside the attention worker, round-robin with
the systems, so the drifts of a shared machine reach them and the systems alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import report
from benchmarks.suites.attention import REFERENCE_NO_COMM, REFERENCE_ONE_PROCESS

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SUITES = ("attention", "packed", "e2e", "memory", "sparse", "linear")
# e2e/memory: large blocks are mmapped and returned on free, so resident memory tracks live tensors
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
MEMORY_SYSTEMS = "ds_seqpar,alst,ds_seqpar_savings,alst_savings"


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


# ---------------------------------------------------------------------------------------------- suites


def _case(row: dict) -> tuple:
    """The case a row belongs to: (P, S, H_kv, packed-documents row or None)."""
    return row["P"], row["S"], row["H_kv"], row.get("docs")


def score_attention_rows(rows: list[dict], cores: int) -> dict:
    """Add efficiency, vs ceiling and vs fastest peer to the attention rows, from the two reference rows
    of the same case (P, S, H_kv, documents); return the reference times by (*case, reference name)."""
    refs = {
        (*_case(r), r["system"]): r["time_s"]
        for r in rows
        if r["peer"] == "reference" and r["status"] == "ok"
    }
    for row in rows:
        if row["status"] != "ok" or row["system"] == REFERENCE_ONE_PROCESS:
            continue
        case = _case(row)
        t_single, ceiling = refs.get((*case, REFERENCE_ONE_PROCESS)), refs.get((*case, REFERENCE_NO_COMM))
        if t_single is None or ceiling is None:
            continue  # a reference failed: nothing to score against
        row["T_ceiling_s"] = ceiling
        row["vs_ceiling"] = ceiling / row["time_s"]
        row["T_single_s"] = t_single
        row["T_limit_s"] = t_single / min(row["P"], cores)
        row["efficiency"] = row["T_limit_s"] / row["time_s"]
    for row in rows:
        peers = [
            r["time_s"]
            for r in rows
            if r["status"] == "ok" and r["peer"] not in ("ds_seqpar", "reference") and _case(r) == _case(row)
        ]
        if row["status"] == "ok" and row["peer"] != "reference" and peers:
            row["vs_fastest_peer"] = row["time_s"] / min(peers)
    return refs


def suite_attention(args: argparse.Namespace) -> dict:
    seq_lens = args.seq_lens or ([1024, 4096] if args.quick else [4096, 16384])
    worlds = [2] if args.quick else [2, 4]
    reps = 1 if args.quick else args.reps
    kv_heads = [8, 2]
    # short cases are cheap and noisier: more repetitions for them
    short_reps = reps if args.quick else max(reps, 15)
    rows = []
    for world in worlds:
        for seq_len in seq_lens:
            extra = ["--seq-lens", str(seq_len), "--kv-heads", *map(str, kv_heads)]
            extra += ["--reps", str(short_reps if seq_len <= 4096 else reps), "--dtype", args.dtype]
            rows += _worker_rows(world, "benchmarks.suites.attention", extra, timeout=args.timeout)
    refs = score_attention_rows(rows, os.cpu_count() or 1)
    return {
        "meta": {
            "machine": _machine(),
            "dtype": args.dtype,
            "reps": f"{short_reps} (S <= 4096), {reps} (longer)",
            "seq_lens": seq_lens,
            "worlds": worlds,
            "T_single_s": {
                f"P={p} S={s} H_kv={h}": t
                for (p, s, h, _, name), t in refs.items()
                if name == REFERENCE_ONE_PROCESS
            },
        },
        "rows": rows,
    }


def suite_packed(args: argparse.Namespace) -> dict:
    """Packed documents (``PACKED_ROWS``: 512 + 1024 + 2560 tokens, and 16 equal documents) at S = 4096:
    ds_seqpar's default and pure ring against ring-flash-attn's varlen functions, fp32 unless --dtype."""
    seq_len = (args.seq_lens or [4096])[0]
    worlds = [2] if args.quick else [2, 4]
    reps = 1 if args.quick else max(args.reps, 15)
    dtype = args.dtype
    rows = []
    for world in worlds:
        extra = [
            "--packed",
            "--seq-lens",
            str(seq_len),
            "--kv-heads",
            "8",
            "--reps",
            str(reps),
            "--dtype",
            dtype,
        ]
        rows += _worker_rows(world, "benchmarks.suites.attention", extra, timeout=args.timeout)
    score_attention_rows(rows, os.cpu_count() or 1)
    return {"meta": {"machine": _machine(), "dtype": dtype, "reps": reps, "seq_len": seq_len}, "rows": rows}


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


def memory_summary(rows: list[dict]) -> list[dict]:
    """Per (system, P): the largest S that fit, its ratio to P = 1 and to the ALST row of the same savings."""
    largest = {}
    for row in rows:
        if row["status"] == "ok" and row["fits"]:
            key = (row["peer"], row["P"])
            largest[key] = max(largest.get(key, 0), row["S"])
    return [
        {
            "peer": peer,
            "P": world,
            "largest_S": s,
            "vs_P1": s / largest[(peer, 1)] if (peer, 1) in largest else float("nan"),
            "vs_alst": s / largest[(peer.replace("ds_seqpar", "alst"), world)]
            if peer.startswith("ds_seqpar") and (peer.replace("ds_seqpar", "alst"), world) in largest
            else None,
        }
        for (peer, world), s in sorted(largest.items())
    ]


def suite_memory(args: argparse.Namespace) -> dict:
    worlds = [1, 2] if args.quick else [1, 2, 4]
    budget = args.budget_mib / (4 if args.quick else 1)
    rows = []
    for world in worlds:
        extra = [
            "--mode",
            "memory",
            "--budget-mib",
            str(budget),
            "--first-len",
            "2048",
            "--systems",
            MEMORY_SYSTEMS,
        ]
        rows += _worker_rows(world, "benchmarks.suites.e2e", extra, timeout=args.timeout, env=MEMORY_ENV)
    summary = memory_summary(rows)
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
    parser.add_argument(
        "--dtype",
        choices=["bf16", "fp32"],
        default=None,
        help="attention (default bf16) / packed (default fp32) dtype",
    )
    parser.add_argument("--budget-mib", type=float, default=64.0, help="memory suite: per-rank budget")
    parser.add_argument("--timeout", type=int, default=5400, help="seconds per torchrun launch")
    args = parser.parse_args()

    RESULTS.mkdir(exist_ok=True)
    dtype = args.dtype
    for suite in SUITES if args.suite == "all" else (args.suite,):
        default_dtype = "fp32" if suite == "packed" else "bf16"
        args.dtype = dtype or default_dtype
        name = suite + ("" if args.dtype == default_dtype else f"_{args.dtype}")
        name = f"{name}_quick" if args.quick else name
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
