"""Run safety of ``train.py``: no run overwritten, no resume from a damaged or half-written checkpoint,
no silently wrong metric (docs/reliability.md, "Runs, checkpoints and training health").

Every case runs ``train.py``'s main on a pool of 2 gloo ranks (ZeRO-2 and ZeRO-3 configs) and compares
against an uninterrupted run of the same job (two runs of one job are bit-identical).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from ds_seqpar.checkpoint_manifest import MANIFEST, resume_tag
from ds_seqpar.cli import main
from ds_seqpar.cli.args import DEFAULT_CONFIG, parse_args
from ds_seqpar.cli.run_dir import check_output_dir, check_resumed_flags, training_flags
from ds_seqpar.errors import SeqParConfigError
from tests.helpers.cli_runs import run_cli

COMMON = [
    "--seq-len", "192", "--curriculum", "none", "--eval-every", "0", "--eval-samples", "1", "--no-progress",
    "--no-export", "--save-every", "2",
]  # fmt: skip


def _config(tmp_path: Path, stage: int) -> str:
    config = json.loads(DEFAULT_CONFIG.read_text())
    config["sequence_parallel"]["size"] = 2
    config["zero_optimization"] = {"stage": stage}
    path = tmp_path / f"zero{stage}.json"
    path.write_text(json.dumps(config))
    return str(path)


def _losses(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _error_of(argv: list[str]) -> str:
    """The error ``main(argv)`` raises on this rank (``""`` when it finishes)."""
    try:
        main(argv)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def _choose(ckpt_dir: str) -> tuple[str | None, list[str]]:
    said: list[str] = []
    choice = resume_tag(ckpt_dir, say=said.append)
    return choice.tag, [*choice.skipped, *said]


def _die_saving(argv: list[str], tag: str) -> None:
    """``main(argv)``, where rank 1 is killed half-way through writing its optimizer file of ``tag``."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    save = TorchCheckpointEngine.save

    def half_then_die(self, state_dict, path):
        if dist.get_rank() == 1 and f"{tag}.partial" in path and "optim_states" in path:
            save(self, state_dict, path)
            size = os.path.getsize(path)
            os.truncate(path, size // 3)
            os._exit(9)  # a kill in the middle of the save
        return save(self, state_dict, path)

    TorchCheckpointEngine.save = half_then_die
    main(argv)


def _flip(path: Path, offset: int = 4096, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    offset = min(offset, len(data) - count)
    data[offset : offset + count] = bytes(b ^ 0xFF for b in data[offset : offset + count])
    path.write_bytes(bytes(data))


def test_an_output_dir_with_a_run_is_refused_before_any_process_group(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / "step2").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    argv = ["--output-dir", str(out), "--sp-size", "1", *COMMON]
    with pytest.raises(SeqParConfigError, match=r"holds a run \(metrics.jsonl, checkpoints\): pass --resume"):
        check_output_dir(parse_args(argv))
    with pytest.raises(SeqParConfigError, match="contradict"):
        check_output_dir(parse_args([*argv, "--resume", "--overwrite"]))
    with pytest.raises(SeqParConfigError, match="holds no checkpoint; run without --resume"):
        check_output_dir(
            parse_args(["--output-dir", str(tmp_path / "empty"), "--resume", "--sp-size", "1", *COMMON])
        )
    check_output_dir(parse_args([*argv, "--resume"]))  # accepted
    check_output_dir(parse_args([*argv, "--overwrite"]))


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_damaged_checkpoint_is_skipped_and_the_run_continues_exactly(dist_pool, tmp_path, stage):
    """ZeRO-2 and 3: step4's optimizer file byte-flipped, truncated or missing: resume names it, loads step2,
    and steps 3-6 equal the uninterrupted run's."""
    pool = dist_pool(2)
    argv = [*COMMON, "--ds_config", _config(tmp_path, stage)]
    full = _losses(pool.run(run_cli, [*argv, "--max-steps", "6", "--output-dir", str(tmp_path / "full")])[0])
    ckpt = tmp_path / "full" / "checkpoints"
    assert (ckpt / "latest").read_text() == "step6" and (ckpt / "step4" / MANIFEST).is_file()
    assert not list(ckpt.glob("*.partial"))
    optim = sorted((ckpt / "step4").glob("*optim_states.pt"))[-1]
    damages = {
        "flipped": lambda p: _flip(p),
        "truncated": lambda p: os.truncate(p, p.stat().st_size // 2),
        "missing": lambda p: p.unlink(),
    }
    for name, damage in damages.items():
        run = tmp_path / name
        shutil.copytree(tmp_path / "full", run)
        shutil.rmtree(run / "checkpoints" / "step6")
        (run / "checkpoints" / "latest").unlink()  # resume needs no 'latest'
        damage(run / "checkpoints" / "step4" / optim.relative_to(ckpt / "step4"))
        tag, said = pool.run(_choose, str(run / "checkpoints"))[0]
        assert tag == "step2", (name, said)
        what = {"flipped": "SHA-256", "truncated": "bytes, the manifest says", "missing": "is missing"}[name]
        assert any(optim.name in s and what in s for s in said), said
    resumed = _losses(
        pool.run(run_cli, [*argv, "--max-steps", "6", "--resume", "--output-dir", str(tmp_path / "flipped")])[
            0
        ]
    )
    assert resumed == full, (resumed, full)  # one row per step (rows after step 2 dropped), equal losses


@pytest.mark.slow  # the killed rank costs a respawn of the pool
def test_a_save_killed_half_way_never_becomes_latest(dist_pool, tmp_path):
    """ZeRO-2: rank 1 dies while its optimizer file of step4 is a third written; latest stays step2, and the
    resumed run equals the uninterrupted one."""
    pool = dist_pool(2)
    argv = [*COMMON, "--ds_config", _config(tmp_path, 2), "--max-steps", "6"]
    full = _losses(pool.run(run_cli, [*argv, "--output-dir", str(tmp_path / "full")])[0])
    run = tmp_path / "killed"
    with pytest.raises(AssertionError):  # the pool reports the killed rank
        pool.run(_die_saving, [*argv, "--output-dir", str(run)], "step4", timeout=90)
    ckpt = run / "checkpoints"
    assert (ckpt / "latest").read_text() == "step2" and not (ckpt / "step4").exists()
    assert (ckpt / "step4.partial").is_dir()
    resumed = _losses(dist_pool(2).run(run_cli, [*argv, "--resume", "--output-dir", str(run)])[0])
    assert resumed == full


def test_rerun_keeps_the_old_run_and_resume_honours_lr(dist_pool, tmp_path):
    pool = dist_pool(2)
    argv = [*COMMON, "--ds_config", _config(tmp_path, 3)]
    out = tmp_path / "run"
    pool.run(run_cli, [*argv, "--max-steps", "2", "--output-dir", str(out)])
    errors = pool.run(_error_of, [*argv, "--max-steps", "4", "--output-dir", str(out)])
    assert all("holds a run" in e for e in errors), errors
    assert (out / "checkpoints" / "latest").read_text() == "step2"
    rows = pool.run(
        run_cli, [*argv, "--max-steps", "4", "--resume", "--lr", "2e-3", "--output-dir", str(out)]
    )[0]
    assert [r["lr"] for r in rows if "loss" in r] == [3e-3, 3e-3, 2e-3, 2e-3], rows
    pool.run(run_cli, [*argv, "--max-steps", "2", "--overwrite", "--output-dir", str(out)])
    old = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(old) == 1 and (old[0] / "checkpoints" / "step4" / MANIFEST).is_file()
    changed = pool.run(
        _error_of, [*argv, "--max-steps", "4", "--resume", "--seed", "1", "--output-dir", str(out)]
    )
    assert all("--seed: 0 -> 1" in e for e in changed), changed


def test_nan_training_stops_without_saving_or_exporting(dist_pool, tmp_path):
    pool = dist_pool(2)
    out = tmp_path / "nan"
    argv = [*COMMON, "--ds_config", _config(tmp_path, 3), "--max-steps", "8", "--lr", "1e10"]
    argv = [a for a in argv if a != "--no-export"] + ["--max-bad-steps", "2", "--output-dir", str(out)]
    errors = pool.run(_error_of, argv)
    assert all(
        e.startswith("TrainingDiverged: training diverged: 2 consecutive bad steps") for e in errors
    ), errors
    assert not (out / "hf_model").exists()
    saved = sorted(p.name for p in (out / "checkpoints").iterdir()) if (out / "checkpoints").exists() else []
    assert saved in ([], ["latest", "step2"]), saved
    for line in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl"))


def test_a_batch_without_labels_is_refused(dist_pool, tmp_path):
    data = tmp_path / "one.txt"
    data.write_text("\n\n".join(f"word{i} and more words {i}" for i in range(40)))
    argv = [*COMMON, "--ds_config", _config(tmp_path, 3), "--max-steps", "2", "--data", str(data)]
    argv = [a if a != "192" else "1" for a in argv] + ["--output-dir", str(tmp_path / "nolabels")]
    errors = dist_pool(2).run(_error_of, argv)
    assert all(e.startswith("NoLabelsError: step 1: the batch has no labelled token") for e in errors), errors


def test_evaluation_over_data_parallel_replicas_equals_one_replica(dist_pool, tmp_path):
    """5 held-out samples (uneven over 2 replicas): dp 2 (sp 1) gives dp 1's eval loss and accuracy."""
    pool = dist_pool(2)
    argv = [*COMMON, "--ds_config", _config(tmp_path, 3), "--max-steps", "1", "--eval-samples", "5"]
    first = {}
    for sp in (2, 1):
        rows = pool.run(run_cli, [*argv, "--sp-size", str(sp), "--output-dir", str(tmp_path / f"sp{sp}")])[0]
        first[sp] = rows[0]
    assert abs(first[1]["eval_loss"] - first[2]["eval_loss"]) <= 1e-6, first
    assert first[1]["eval_accuracy"] == first[2]["eval_accuracy"], first


def test_a_failed_save_names_the_directory_and_the_cause(tmp_path):
    from ds_seqpar.checkpoint_manifest import _save_error

    full = _save_error(OSError(28, "No space left on device"), tmp_path / "checkpoints", "step4")
    assert "checkpoint step4: no space left on the device of" in str(full) and "another --output-dir" in str(
        full
    )
    assert "step4.partial" in str(full) and "never becomes 'latest'" in str(full)
    denied = _save_error(PermissionError(13, "Permission denied"), tmp_path / "checkpoints", "step4")
    assert f"cannot write to {tmp_path / 'checkpoints'}" in str(denied)


def test_resume_on_another_version_of_the_embedded_task_is_refused():
    """A checkpoint records which embedded task it trained on; one of an older version (which recorded
    none: 16 passkeys drawn at random) is refused by name, a --data run is not concerned."""
    args = argparse.Namespace(model=None, data=None, text_field="text", objective="causal", seed=0, seq_len=4096,
                              curriculum=None, packing="fixed")  # fmt: skip
    now = training_flags(args, None)
    assert "8 passkeys" in now["task"]
    check_resumed_flags(dict(now), now, "step2")
    older = {k: v for k, v in now.items() if k != "task"}
    with pytest.raises(SeqParConfigError, match=r"the embedded task: 'passkey retrieval, 16 passkeys"):
        check_resumed_flags(older, now, "step2")
    text = {**older, "data": "docs.jsonl"}
    check_resumed_flags(text, {**text, "task": None}, "step2")


def test_resume_with_another_packing_is_refused():
    """Balanced rows depend on the SP degree they were packed for: another packing, or balanced rows for
    another degree, change the data order."""
    args = argparse.Namespace(model=None, data="docs.jsonl", text_field="text", objective="causal", seed=0,
                              seq_len=4096, curriculum=None, packing="balanced",
                              settings=argparse.Namespace(size=4))  # fmt: skip
    saved = training_flags(args, None)
    assert saved["packing"] == "balanced for SP degree 4"
    args.settings.size = 8
    with pytest.raises(SeqParConfigError, match=r"--packing: 'balanced for SP degree 4' -> 'balanced for SP"):
        check_resumed_flags(saved, training_flags(args, None), "step2")
