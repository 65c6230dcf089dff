"""Kill loop: SIGKILL the whole ``train.py`` job at random moments, resume, and check nothing was lost.

For each ZeRO stage: one uninterrupted run gives the reference losses (and how long its saves take);
then cycles of (a fresh run with ``--overwrite``, then ``--resume`` after every kill) until ``--kills``
kills have landed. Each kill is aimed, with probability ``--aim-saves`` (drawn per launch), at a save: the script watches
the checkpoint directory, and when the launch's k-th save (k drawn at random) makes its ``<tag>.partial``
directory, it kills the job after a delay drawn over the reference's save duration, so the kill hits the
checkpoint files, their hashing, the manifest or the rename. Otherwise the kill lands at a time drawn
uniformly over the reference run's time from its first step to its last line, counted from the launch's
own first step (start-up varies with the machine's load), so it hits steps, evaluations and saves alike.
After every kill the script checks that ``latest`` names a complete checkpoint (its manifest verified,
file by file); the next launch is ``--resume`` when a complete tag exists, else ``--overwrite``. Each
cycle runs until the job finishes; its ``metrics.jsonl`` must then hold one row per step with the
reference's losses, bit for bit. A kill landed in a save when the launch left a ``.partial`` directory, or
when a tag newer than ``latest`` is complete (killed after the rename, before ``latest`` moved on).

    python benchmarks/kill_loop.py --kills 20 --stages 2 3

Writes ``benchmarks/results/kill_loop.json`` and ``.md`` (one row per launch).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import save_results  # noqa: E402
from ds_seqpar.checkpoint_manifest import verify_tag  # noqa: E402

SAVE_EVERY = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(out: Path, stage: int) -> Path:
    config = json.loads((ROOT / "ds_configs" / "usp_zero3.json").read_text())
    config["sequence_parallel"]["size"] = 2
    config["zero_optimization"] = {"stage": stage}
    path = out / f"zero{stage}.json"
    path.write_text(json.dumps(config))
    return path


def _model(out: Path, hidden: int) -> Path:
    """The shipped tiny Llama widened to ``hidden`` (random init): its saves last long enough to be hit."""
    model = out / f"llama-h{hidden}"
    model.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "assets" / "tiny-llama" / name, model / name)
    config = json.loads((ROOT / "assets" / "tiny-llama" / "config.json").read_text())
    config.update(hidden_size=hidden, intermediate_size=2 * hidden)
    (model / "config.json").write_text(json.dumps(config))
    return model


def _launch(
    config: Path, model: Path, run_dir: Path, steps: int, extra: list[str], log: Path
) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
        str(ROOT / "train.py"), "--ds_config", str(config), "--model", str(model), "--random-init",
        "--seq-len", "192", "--curriculum", "none",
        "--max-steps", str(steps), "--save-every", str(SAVE_EVERY), "--eval-every", "0", "--eval-samples", "1",
        "--no-progress", "--no-export", "--output-dir", str(run_dir), *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    steps = [s for s, _ in losses]
    if len(steps) != len(set(steps)):
        raise AssertionError(f"{run_dir}/metrics.jsonl has a step twice: {steps}")
    return dict(losses)


def _state_after_kill(ckpt: Path) -> tuple[str | None, list[str]]:
    """``latest``'s tag and what is wrong with it (it must be complete), and any half save left visible."""
    latest = ckpt / "latest"
    tag = latest.read_text().strip() if latest.is_file() else None
    problems = verify_tag(ckpt / tag) if tag else []
    return tag, problems


def _partials(ckpt: Path) -> set[str]:
    """The ``<tag>.partial`` directories of ``ckpt`` (saves in progress, or left by a kill)."""
    return {p.name for p in ckpt.glob("*.partial")} if ckpt.is_dir() else set()


def _save_dirs(ckpt: Path) -> set[tuple[str, int]]:
    """``(name, inode)`` of each ``.partial`` directory: a save that reuses the name of one a kill left
    (the resumed run saves that step again) is still a new directory."""
    found = set()
    for name in _partials(ckpt):
        try:
            found.add((name, (ckpt / name).stat().st_ino))
        except FileNotFoundError:  # renamed (complete) between the listing and the stat
            continue
    return found


def _newest_complete_step(ckpt: Path) -> int:
    """The step of the newest complete tag (a ``stepN`` directory: renamed from ``.partial`` only after its
    manifest), 0 when there is none."""
    steps = [int(p.name[4:]) for p in ckpt.glob("step*") if p.is_dir() and p.name[4:].isdigit()]
    return max(steps, default=0)


def _wait(proc: subprocess.Popen, log: Path, after_s: float | None) -> int:
    """The launch's exit code; raises ``TimeoutExpired`` ``after_s`` seconds after the launch printed its
    first step line (``step N: loss ...``, rank 0 with --no-progress)."""
    if after_s is None:
        return proc.wait()
    while proc.poll() is None:
        if re.search(r"^step \d+: loss", log.read_text(errors="replace"), flags=re.M):
            return proc.wait(timeout=after_s)
        time.sleep(0.05)
    return proc.returncode


def _wait_for_save(proc: subprocess.Popen, ckpt: Path, nth: int, delay_s: float) -> int:
    """The launch's exit code; raises ``TimeoutExpired`` ``delay_s`` seconds after the ``nth`` save of
    this launch (0-based) made its ``.partial`` directory."""
    seen, before = 0, _save_dirs(ckpt)
    while proc.poll() is None:
        now = _save_dirs(ckpt)
        if now - before:
            if seen == nth:
                time.sleep(delay_s)
                raise subprocess.TimeoutExpired(proc.args, delay_s)
            seen += 1
        before = now
        time.sleep(0.002)
    return proc.returncode


def _timed_reference(
    config: Path, model: Path, run_dir: Path, steps: int, log: Path
) -> tuple[float, list[float]]:
    """Run the reference; returns the seconds from its first step line to its ``done:`` line (its steps,
    saves and evaluations: the window timed kills are drawn from) and how long each ``.partial`` lived."""
    proc = _launch(config, model, run_dir, steps, ["--overwrite"], log)
    ckpt = run_dir / "checkpoints"
    first = done = None
    born: dict[str, float] = {}
    saves: list[float] = []
    polls = 0
    while proc.poll() is None or done is None:
        now = time.perf_counter()
        partial = _partials(ckpt)
        born.update({name: now for name in partial - set(born)})
        saves += [now - born.pop(name) for name in set(born) - partial]
        polls += 1
        if polls % 25 == 0 or proc.poll() is not None:  # the log every 50 ms, the saves every 2 ms
            text = log.read_text(errors="replace")
            if first is None and re.search(r"^step \d+: loss", text, flags=re.M):
                first = now
            if done is None and re.search(r"^done: ", text, flags=re.M):
                done = now
        if proc.poll() is not None and done is None:
            break
        time.sleep(0.002)
    if proc.wait() != 0 or first is None or done is None or not saves:
        raise SystemExit(f"the reference run failed (or made no save): see {log}")
    return done - first, saves


def _stage(
    stage: int, kills: int, steps: int, aim_saves: float, model: Path, out: Path, rng: random.Random
) -> list[dict]:
    config = _config(out, stage)
    ref_dir = out / f"zero{stage}_reference"
    window, saves = _timed_reference(config, model, ref_dir, steps, out / f"zero{stage}_reference.log")
    save_s = sorted(saves)[len(saves) // 2]
    print(
        f"zero{stage}: reference {window:.1f} s from its first step, {len(saves)} saves of {save_s:.3f} s (median)"
    )
    reference = _losses(ref_dir)
    rows, landed, cycle, launch = [], 0, 0, 0
    run_dir = out / f"zero{stage}_killed"
    ckpt = run_dir / "checkpoints"
    while landed < kills:
        cycle += 1
        flags, resumed = ["--overwrite"], 0
        while True:
            launch += 1
            log = out / f"zero{stage}_launch{launch}.log"
            earlier = _save_dirs(ckpt)  # half saves of earlier kills, not this launch's
            proc = _launch(config, model, run_dir, steps, flags, log)
            aim = "none" if landed >= kills else ("save" if rng.random() < aim_saves else "time")
            # a save-aimed kill: one of the saves still ahead of this launch, within its first 80 %
            at = rng.uniform(0.0, window if aim == "time" else 0.8 * save_s)
            nth = rng.randrange(max(1, (steps - resumed) // SAVE_EVERY)) if aim == "save" else 0
            try:
                rc = (
                    _wait_for_save(proc, ckpt, nth, at)
                    if aim == "save"
                    else _wait(proc, log, at if aim == "time" else None)
                )
                killed = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc, killed = -9, True
                landed += 1
            tag, problems = _state_after_kill(ckpt)
            partial = sorted(name for name, _ in _save_dirs(ckpt) - earlier)
            # inside a save: its .partial left, or killed after the rename and before `latest` moved on
            renamed = killed and _newest_complete_step(ckpt) > (int(tag.removeprefix("step")) if tag else 0)
            row = {"stage": stage, "cycle": cycle, "launch": launch, "mode": flags[0], "aim": aim,
                   "killed_at_s": at if aim != "none" else 0.0, "killed": killed, "rc": rc, "latest": tag or "-",
                   "latest_ok": not problems, "partial_left": ",".join(partial) or "-",
                   "in_save": killed and (bool(partial) or renamed)}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
            if problems:
                raise AssertionError(f"after launch {launch}: latest={tag} is incomplete: {problems}")
            if not killed and rc != 0:
                raise AssertionError(f"launch {launch} ({flags[0]}) failed with rc {rc}: see {log}")
            if not killed:
                got = _losses(run_dir)
                if got != reference:
                    raise AssertionError(f"cycle {cycle}: losses {got} differ from the reference {reference}")
                row["equal_to_reference"] = True
                break
            resumed = _newest_complete_step(ckpt)  # what --resume will load (latest may lag behind it)
            flags = ["--resume"] if resumed else ["--overwrite"]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=20, help="kills per ZeRO stage")
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--aim-saves", type=float, default=0.5, help="share of the kills aimed at a save")
    p.add_argument("--hidden", type=int, default=512, help="hidden size of the widened tiny Llama")
    p.add_argument("--out", default=str(ROOT / "outputs" / "kill_loop"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    rows = []
    for stage in args.stages:
        rows += _stage(stage, args.kills, args.steps, args.aim_saves, _model(out, args.hidden), out, rng)
    kills = [r for r in rows if r["killed"]]
    in_save = sum(1 for r in kills if r["in_save"])
    cycles = {(r["stage"], r["cycle"]) for r in rows if r.get("equal_to_reference")}
    meta = {"kills": len(kills), "kills_during_a_save": in_save,
            "kills_aimed_at_a_save": sum(1 for r in kills if r["aim"] == "save"),
            "aimed_kills_inside_a_save": sum(1 for r in kills if r["aim"] == "save" and r["in_save"]), "cycles_equal_to_reference": len(cycles),
            "launches": len(rows), "steps": args.steps, "stages": args.stages, "hidden": args.hidden}  # fmt: skip
    columns = [("stage", "stage", "d"), ("cycle", "cycle", "d"), ("launch", "launch", "d"), ("mode", "mode", "s"),
               ("aim", "aim", "s"), ("kill delay (s)", "killed_at_s", ".3f"), ("killed", "killed", ""), ("rc", "rc", "d"),
               ("latest", "latest", "s"), ("latest complete", "latest_ok", ""), ("half save left", "partial_left", "s"),
               ("in a save", "in_save", "")]  # fmt: skip
    title = (f"# Kill loop: {len(kills)} SIGKILLs of the whole job (ZeRO {args.stages}), {meta['kills_aimed_at_a_save']} "
             f"aimed at a save, {in_save} inside one (its `.partial` left, or `latest` not yet moved to it); every cycle ({len(cycles)}) resumed to the "
             "reference's losses bit for bit\n\nkill delay: seconds after the launch's first step (aim `time`) or after "
             "the save's `.partial` appeared (aim `save`).")  # fmt: skip
    print(save_results("kill_loop", title, meta, rows, columns))


if __name__ == "__main__":
    main()
