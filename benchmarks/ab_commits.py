"""CPU speed of two commits, side by side: the same benchmarks, run alternately on clones of both.

    .venv/bin/python -m benchmarks.ab_commits OLD_REV NEW_REV [--rounds 3] [--bench usp attention schedules]

Each round runs every benchmark once on each commit, the order flipping every round so that drifts of a
shared machine reach both. A row's time per commit is the median over rounds of the benchmark's own
number (each already the median of its repetitions, slowest rank); the ratio is new / old. Benchmarks:

    usp        benchmarks.bench_usp: dense USP fwd+bwd, S = 16k, H = H_kv = 8, fp32, every U x R of 4 ranks
    attention  the attention suite's worker (benchmarks.suites.attention), ds_seqpar rows only, fp32,
               S in {4096, 16384}, H_kv in {8, 2}, 4 ranks
    schedules  benchmarks.bench_schedules: every ring schedule at S = 3584, 8 ranks

Both clones run with this checkout's ``.venv`` (``PYTHONPATH`` set to the clone), one thread per rank.
Prints a markdown table and writes ``benchmarks/results/ab_<old>_<new>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _usp(clone: Path, out: Path) -> dict[str, float]:
    lines = _torchrun(clone, 4, ["-m", "benchmarks.bench_usp", "--reps", "3"])
    rows = [ast.literal_eval(line) for line in lines if line.startswith("{")]
    return {f"usp U x R {r['UxR']} S={r['S']}": r["time_s"] for r in rows}


def _attention(clone: Path, out: Path) -> dict[str, float]:
    args = ["-m", "benchmarks.suites.attention", "--seq-lens", "4096", "16384", "--dtype", "fp32"]
    _torchrun(clone, 4, [*args, "--only", "ds_seqpar", "--reps", "3", "--out", str(out)])
    rows = [r for r in json.loads(out.read_text()) if r.get("peer") == "ds_seqpar" and r["status"] == "ok"]
    return {f"attention {r['system']} H_kv={r['H_kv']} S={r['S']}": r["time_s"] for r in rows}


def _schedules(clone: Path, out: Path) -> dict[str, float]:
    _torchrun(clone, 8, ["-m", "benchmarks.bench_schedules", "--reps", "3"])
    rows = json.loads((clone / "benchmarks" / "results" / "schedules_cpu.json").read_text())["rows"]
    return {f"schedules {r['schedule']} H_kv={r['H_kv']} S={r['S']}": r["time_s"] for r in rows}


BENCHES = {"usp": _usp, "attention": _attention, "schedules": _schedules}


def _torchrun(clone: Path, ranks: int, args: list[str]) -> list[str]:
    """Run a benchmark module on ``ranks`` gloo ranks in ``clone``; its stdout lines."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(clone)}
    cmd = [TORCHRUN, "--nproc_per_node", str(ranks), "--master_port", "29611", *args]
    done = subprocess.run(cmd, cwd=clone, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed in {clone}:\n{done.stderr[-3000:]}")
    return done.stdout.splitlines()


def _clone(rev: str, into: Path) -> Path:
    subprocess.run(["git", "clone", "-q", str(ROOT), str(into)], check=True)
    subprocess.run(["git", "-C", str(into), "checkout", "-q", rev], check=True)
    return into


def _table(old: str, new: str, times: dict[str, dict[str, list[float]]]) -> tuple[list[dict], str]:
    rows = []
    for key in times[old]:
        a, b = statistics.median(times[old][key]), statistics.median(times[new][key])
        rows.append({"row": key, "old_s": times[old][key], "new_s": times[new][key], "ratio": b / a})
    geo = math.exp(statistics.mean(math.log(r["ratio"]) for r in rows))
    lines = [f"| row | {old} runs (s) | {new} runs (s) | new / old (medians) |", "|---|---|---|---|"]
    for r in rows:
        runs = [", ".join(f"{t:.3f}" for t in r[k]) for k in ("old_s", "new_s")]
        lines.append(f"| {r['row']} | {runs[0]} | {runs[1]} | {r['ratio']:.3f} |")
    lines.append(f"| geometric mean of the ratios | | | {geo:.3f} |")
    return rows, "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bench", nargs="+", choices=list(BENCHES), default=list(BENCHES))
    args = parser.parse_args()
    revs = [
        subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", r], capture_output=True, text=True, check=True
        ).stdout.strip()
        for r in (args.old, args.new)
    ]
    old, new = revs
    times: dict[str, dict[str, list[float]]] = {old: {}, new: {}}
    with tempfile.TemporaryDirectory() as work:
        clones = {rev: _clone(rev, Path(work) / rev) for rev in revs}
        for i in range(args.rounds):
            for rev in revs if i % 2 == 0 else revs[::-1]:
                for bench in args.bench:
                    got = BENCHES[bench](clones[rev], Path(work) / f"{bench}_{rev}.json")
                    for key, seconds in got.items():
                        times[rev].setdefault(key, []).append(seconds)
                    print(
                        f"round {i + 1} {rev} {bench}: " + ", ".join(f"{s:.3f}" for s in got.values()),
                        flush=True,
                    )
    rows, table = _table(old, new, times)
    title = (
        f"# CPU speed, {old} (old) vs {new} (new)\n\n`python -m benchmarks.ab_commits {old} {new} --rounds "
        f"{args.rounds} --bench {' '.join(args.bench)}`: {args.rounds} rounds, the order flipping every round; "
        "each number is the benchmark's own median of 3 repetitions (slowest rank).\n\n"
    )
    results = ROOT / "benchmarks" / "results"
    (results / f"ab_{old}_{new}.json").write_text(
        json.dumps({"old": old, "new": new, "rows": rows}, indent=1)
    )
    (results / f"ab_{old}_{new}.md").write_text(title + table)
    print(title + table)


if __name__ == "__main__":
    main()
