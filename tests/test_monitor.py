"""Monitoring: train.py's DeepSpeed monitor events (CSV, TensorBoard), the memory column, ds_seqpar.plot."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from ds_seqpar import SeqParConfigError
from ds_seqpar.cli import DEFAULT_CONFIG, RunLog, parse_args
from ds_seqpar.plot import main as plot_main
from tests.helpers.cli_runs import run_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_metrics(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_draws_a_png_from_metrics(tmp_path, capsys):
    """Synthetic metrics with a curriculum switch, eval rows and a repeated (resumed) step."""
    rows = [{"step": 0, "eval_loss": 4.0, "eval_accuracy": 0.1}]
    for step in range(1, 9):
        rows.append({"step": step, "loss": 4.0 / step, "tokens_per_s": 1000.0 + step,
                     "seq_len": 256 if step <= 4 else 512, "comm_MiB": 0.5, "step_time_s": 0.1,
                     "max_rss_MiB": 500.0 + step})  # fmt: skip
    rows.append({"step": 4, "eval_loss": 2.0, "eval_accuracy": 0.5})
    rows.append(dict(rows[5], loss=9.0))  # a resumed run repeats step 5: the last row wins
    _write_metrics(tmp_path / "metrics.jsonl", rows)
    assert plot_main([str(tmp_path)]) == 0
    out = tmp_path / "metrics.png"
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 10_000
    other = tmp_path / "sub" / "plot.png"
    assert plot_main([str(tmp_path), "--out", str(other)]) == 0 and other.read_bytes()[:8] == PNG_MAGIC


def test_plot_fails_in_one_line_on_missing_or_empty_input(tmp_path, capsys):
    cases = [
        (tmp_path / "nope", "is not a directory"),
        (tmp_path, "metrics.jsonl does not exist"),
    ]
    for run_dir, message in cases:
        assert plot_main([str(run_dir)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    (tmp_path / "metrics.jsonl").write_text("")
    assert plot_main([str(tmp_path)]) == 2
    assert "has no step or eval rows" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n')
    assert plot_main([str(tmp_path)]) == 2
    assert "metrics.jsonl:2: not a JSON line" in capsys.readouterr().err
    assert not (tmp_path / "metrics.png").exists()


def test_log_sends_every_numeric_column_as_an_event(tmp_path):
    """Sparse columns too; the x-axis is the engine's global_samples; only rank 0 writes; no monitor, no events."""
    events: list[list[tuple]] = []
    engine = SimpleNamespace(
        global_samples=8.0, monitor=SimpleNamespace(enabled=True, write_events=events.append)
    )
    args = argparse.Namespace(output_dir=str(tmp_path), no_progress=True, max_steps=1)
    row = {"step": 4, "loss": 1.5, "tokens_per_s": 10.0, "seq_len": 256, "comm_MiB": 0.5, "step_time_s": 0.1,
           "max_rss_MiB": 500.0, "sparse_rho_s_max": 1.25, "sparse_density": 0.4, "sparse_layers": 2}  # fmt: skip
    for rank in (0, 1):
        log = RunLog(args, rank, 0, engine)
        log.step(row)
        log.record({"step": 4, "eval_loss": 2.0, "eval_accuracy": 0.5, "flag": True})
        log.close()
    assert events == [
        [(f"ds_seqpar/{k}", v, 8) for k, v in row.items()],
        [("ds_seqpar/step", 4, 8), ("ds_seqpar/eval_loss", 2.0, 8), ("ds_seqpar/eval_accuracy", 0.5, 8)],
    ]
    engine.monitor.enabled = False  # DeepSpeed's MonitorMaster with no section enabled
    log = RunLog(args, 0, 0, engine)
    log.step(row)
    log.close()
    assert len(events) == 2 and len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def _monitor_config(tmp_path: Path, **sections: dict) -> str:
    config = json.loads(DEFAULT_CONFIG.read_text())
    config["sequence_parallel"]["size"] = 2
    config.update(sections)
    path = tmp_path / "monitor.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_missing_monitor_package_fails_before_any_process_group(tmp_path, monkeypatch):
    """DeepSpeed would raise ImportError on rank 0 only, inside deepspeed.initialize (the other ranks
    then fail in a collective); train.py names the key and the fix on every rank first."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a)
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    path = _monitor_config(tmp_path, wandb={"enabled": True, "project": "p"})
    with pytest.raises(
        SeqParConfigError, match=r'"wandb": \{"enabled": true\} needs the \'wandb\' package'
    ) as info:
        parse_args(["--ds_config", path])
    assert 'pip install "wandb"' in str(info.value) and '"wandb.enabled" to false' in str(info.value)
    with pytest.raises(SeqParConfigError, match=r"DeepSpeed rejects the monitor section\(s\) csv_monitor"):
        parse_args(
            ["--ds_config", _monitor_config(tmp_path, csv_monitor={"enabled": True, "no_such_key": 1})]
        )
    assert not dist.is_initialized()


def _csv(path: Path) -> list[tuple[float, float]]:
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))
    return [(float(step), float(value)) for step, value in rows[1:]]


def test_train_writes_deepspeed_monitor_events(dist_pool, tmp_path):
    """2 ranks, 2 steps, csv_monitor (explicit output_path) and tensorboard (default: --output-dir):
    the ds_seqpar/* events carry metrics.jsonl's numbers, next to DeepSpeed's own Train/Samples/lr."""
    out = tmp_path / "out"
    path = _monitor_config(
        tmp_path,
        csv_monitor={"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "run"},
        tensorboard={"enabled": True, "job_name": "tb"},
    )
    argv = ["--ds_config", path, "--seq-len", "256", "--max-steps", "2", "--eval-every", "0",
            "--eval-samples", "1", "--no-progress", "--no-export", "--save-every", "0", "--output-dir", str(out)]  # fmt: skip
    rows = dist_pool(2).run(run_cli, argv)[0]
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and [r["step"] for r in evals] == [0, 2]
    assert all(r["max_rss_MiB"] > 50 for r in steps)  # CPU: the process's peak RSS
    csv_dir = tmp_path / "csv" / "run"
    for column in ("loss", "tokens_per_s", "seq_len", "comm_MiB", "step_time_s", "max_rss_MiB"):
        assert _csv(csv_dir / f"ds_seqpar_{column}.csv") == [(r["step"], r[column]) for r in steps], column
    assert _csv(csv_dir / "ds_seqpar_eval_loss.csv") == [(r["step"], r["eval_loss"]) for r in evals]
    assert _csv(csv_dir / "ds_seqpar_eval_accuracy.csv") == [(r["step"], r["eval_accuracy"]) for r in evals]
    assert len(_csv(csv_dir / "Train_Samples_lr.csv")) == 2  # DeepSpeed's own event, kept
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (event_file,) = (out / "tb").glob("events.out.tfevents.*")
    tb = EventAccumulator(str(event_file))
    tb.Reload()
    assert {"ds_seqpar/loss", "ds_seqpar/max_rss_MiB", "ds_seqpar/eval_loss", "Train/Samples/lr"} <= set(
        tb.Tags()["scalars"]
    )
    logged = [(e.step, e.value) for e in tb.Scalars("ds_seqpar/loss")]
    assert [s for s, _ in logged] == [1, 2]
    assert all(v == pytest.approx(r["loss"], rel=1e-6) for (_, v), r in zip(logged, steps))  # float32
    assert plot_main([str(out)]) == 0 and (out / "metrics.png").read_bytes()[:8] == PNG_MAGIC


def test_monitor_steps_are_deepspeeds_global_samples(dist_pool, tmp_path):
    """2 data-parallel replicas (``--sp-size 1``): the events' x-axis is DeepSpeed's global sample count
    (2 per step), shared with its Train/Samples/lr; ``ds_seqpar/step`` maps it back to the step."""
    csv_dir = tmp_path / "csv"
    path = _monitor_config(
        tmp_path, csv_monitor={"enabled": True, "output_path": str(csv_dir), "job_name": "dp"}
    )
    argv = ["--ds_config", path, "--sp-size", "1", "--seq-len", "256", "--max-steps", "2", "--eval-every", "0",
            "--eval-samples", "1", "--no-progress", "--no-export", "--save-every", "0",
            "--output-dir", str(tmp_path / "out")]  # fmt: skip
    steps = [r for r in dist_pool(2).run(run_cli, argv)[0] if "loss" in r]
    assert _csv(csv_dir / "dp" / "ds_seqpar_loss.csv") == [(2 * r["step"], r["loss"]) for r in steps]
    assert [s for s, _ in _csv(csv_dir / "dp" / "Train_Samples_lr.csv")] == [2, 4]
    assert _csv(csv_dir / "dp" / "ds_seqpar_step.csv") == [
        (0, 0),
        (2, 1),
        (4, 2),
        (4, 2),
    ]  # eval, 2 steps, eval
