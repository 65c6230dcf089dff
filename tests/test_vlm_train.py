"""``train.py --data`` with multimodal records on a vision-language model: 2 gloo SP ranks against the plain HF
model in one process (docs/multimodal_data.md, "With train.py")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from ds_seqpar.cli.vlm import (
    PackedVlmDataset,
    collate_vlm,
    family_of,
    hf_inputs,
    load_processor,
    position_function,
    read_vlm_data,
)
from tests.helpers.cli_runs import run_cli

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "assets" / "tiny-qwen2-vl")
DATA = str(ROOT / "assets" / "vlm_data" / "train.jsonl")


def _reference() -> dict[str, float]:
    """The plain model (seed 0) in one process: the loss of row 0 (the training row) and the loss and
    next-token accuracy of row 1 (the held-out row)."""
    config = AutoConfig.from_pretrained(MODEL)
    records = read_vlm_data(DATA, MODEL, config, 256)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    rows = PackedVlmDataset(
        records, 256, position_function(family_of(config), model), config.text_config.pad_token_id
    )
    assert len(rows) == 2
    with torch.no_grad():
        train = model(**hf_inputs(collate_vlm([rows[0]]))).loss.item()
        batch = collate_vlm([rows[1]])
        out = model(**hf_inputs(batch))
    targets = batch["labels"][:, 1:]
    keep = targets != -100
    correct = (out.logits[:, :-1].argmax(-1) == targets)[keep].float().mean().item()
    return {"train": train, "eval_loss": out.loss.item(), "eval_accuracy": correct}


def test_train_py_vlm_equals_one_process_and_exports(dist_pool, tmp_path):
    """2 SP ranks (ZeRO-3): the first training loss and the step-0 evaluation (loss and accuracy of the held-out
    row) equal the plain model's in one process; the export holds the processor and loads with HF."""
    out = tmp_path / "vlm"
    argv = ["--sp-size", "2", "--model", MODEL, "--random-init", "--data", DATA, "--seq-len", "256",
            "--max-steps", "2", "--eval-every", "0", "--lr", "1e-3", "--no-progress", "--output-dir", str(out)]  # fmt: skip
    rows = dist_pool(2).run(run_cli, argv)[0]
    ref = _reference()
    first = next(r for r in rows if "eval_loss" in r and r["step"] == 0)
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and losses[1] < losses[0], losses
    assert abs(losses[0] - ref["train"]) <= 1e-5 * ref["train"], (losses, ref)
    assert abs(first["eval_loss"] - ref["eval_loss"]) <= 1e-5 * ref["eval_loss"], (first, ref)
    assert abs(first["eval_accuracy"] - ref["eval_accuracy"]) <= 1e-6, (first, ref)
    export = out / "hf_model"
    assert (export / "preprocessor_config.json").exists() and (export / "processor_config.json").exists()
    processor, _ = load_processor(str(export))
    assert processor.image_processor.size == load_processor(MODEL)[0].image_processor.size
    model = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"


def _refusal(argv: list[str]) -> str:
    from ds_seqpar.cli import main

    try:
        main(argv)
    except Exception as exc:  # the same config error on every rank
        return f"{type(exc).__name__}: {exc}"
    return "trained"


def test_train_py_vlm_refuses_fewer_rows_than_a_step_reads(dist_pool, tmp_path):
    """dp 2 x SP 1 needs 2 training rows per step; the shipped data packs into 1 (and 1 held out)."""
    argv = ["--sp-size", "1", "--model", MODEL, "--random-init", "--data", DATA, "--seq-len", "256",
            "--max-steps", "1", "--no-progress", "--output-dir", str(tmp_path / "dp")]  # fmt: skip
    for message in dist_pool(2).run(_refusal, argv):
        assert "SeqParConfigError" in message and "1 training rows of 256 tokens" in message, message
        assert "fewer than the 2 rows one step reads" in message, message


@pytest.mark.slow
def test_train_py_vlm_curriculum_and_resume(dist_pool, tmp_path):
    """--curriculum 128:2 (the records packed again at 128 tokens) then 256; --resume from the step-2 checkpoint
    gives the uninterrupted run's losses at steps 3 and 4 exactly."""
    import shutil

    out = tmp_path / "cur"
    argv = ["--sp-size", "2", "--model", MODEL, "--random-init", "--data", DATA, "--seq-len", "256",
            "--curriculum", "128:2", "--max-steps", "4", "--eval-every", "0", "--no-export", "--save-every", "2",
            "--no-progress", "--output-dir", str(out)]  # fmt: skip
    pool = dist_pool(2)
    rows = pool.run(run_cli, argv)[0]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert [r["seq_len"] for r in rows if "loss" in r] == [128, 128, 256, 256]
    shutil.rmtree(out / "checkpoints" / "step4")
    again = {r["step"]: r["loss"] for r in pool.run(run_cli, [*argv, "--resume"])[0] if "loss" in r}
    assert again[3] == losses[3] and again[4] == losses[4], (again, losses)
