"""``python -m ds_seqpar.generate`` and ``train.py --eval-generate``.

The command line's greedy continuations under a launcher equal HF's ``model.generate`` in one process; its
inputs are checked before any process group; ``ds_seqpar.generate`` stays the function after the package's
import. ``--eval-generate``'s accuracy under ZeRO-3 with dp 2 x SP 2 (an uneven split of rows) equals the
fraction a one-process HF forward predicts, and train.py logs it at the start and end of a run.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ds_seqpar
from ds_seqpar import SeqParConfigError
from ds_seqpar.cli import DEFAULT_CONFIG
from ds_seqpar.cli.generate_args import parse_args
from ds_seqpar.user_errors import UsageError
from tests.helpers.cli_runs import run_cli
from tests.helpers.harness import run_launcher

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "assets" / "tiny-llama"
PROMPTS = ["k3 " + " ".join(f"f{(5 * i) % 60}" for i in range(36)) + " ?", "f1 f2 k7 " * 16 + "?"]


def _save_tiny(path: Path, seed: int = 0) -> torch.nn.Module:
    """The shipped tiny Llama with seeded random weights and its tokenizer, saved to ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY), dtype=torch.float32)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(TINY).save_pretrained(path)
    return model.eval()


def test_generate_cli_under_torchrun_equals_hf_generate(tmp_path):
    """4 gloo ranks (U 2 x R 2, zigzag; two prompts of 38 and 49 tokens, neither a multiple of the layout's),
    greedy: the new tokens, the printed text and the JSONL rows equal ``model.generate`` in one process."""
    from transformers import AutoTokenizer

    model = _save_tiny(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc_per_node", "4", "-m", "ds_seqpar.generate", "--model", str(tmp_path / "model"),
           "--ds_config", str(DEFAULT_CONFIG), "--prompt-file", str(prompts), "--max-new-tokens", "12",
           "--out", str(tmp_path / "out.jsonl")]  # fmt: skip
    done = run_launcher(cmd, cwd=str(REPO))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    for row, text in zip(rows, PROMPTS, strict=True):
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        ref = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :].tolist()
        assert row["new_token_ids"] == ref and row["prompt_tokens"] == ids.shape[1], (row, ref)
        assert row["text"] == tokenizer.decode(ref, skip_special_tokens=True) and row["text"] in done.stdout
        assert row["sp_size"] == 4 and row["prefill_s"] > 0 and row["tokens_per_s"] > 0
    assert [r["prompt_tokens"] for r in rows] == [38, 49]
    assert "4 ranks per sequence" in done.stdout and "[2/2] 49 prompt tokens -> 12 new tokens" in done.stdout


@pytest.mark.slow
def test_generate_cli_sampling_under_the_deepspeed_launcher(tmp_path):
    """DeepSpeed's launcher, 2 ranks of the size-4 config through --sp-size 2, a text prompt file, sampling under
    a seed: the tokens ``model.generate`` samples in one process with the same seed."""
    model = _save_tiny(tmp_path / "model", seed=1)
    (tmp_path / "prompt.txt").write_text(PROMPTS[0] + "\n")
    launcher = Path(sys.executable).with_name("deepspeed")
    cmd = [str(launcher), "--num_gpus", "2", "--module", "ds_seqpar.generate", "--model", str(tmp_path / "model"),
           "--ds_config", str(DEFAULT_CONFIG), "--sp-size", "2", "--prompt-file", str(tmp_path / "prompt.txt"),
           "--max-new-tokens", "10", "--do-sample", "--temperature", "0.9", "--top-k", "20", "--seed", "7",
           "--out", str(tmp_path / "out.jsonl")]  # fmt: skip
    done = run_launcher(cmd, cwd=str(REPO))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    row = json.loads((tmp_path / "out.jsonl").read_text())
    ids = torch.tensor([[int(t) for t in _ids(tmp_path / "model", PROMPTS[0])]])
    torch.manual_seed(7)
    ref = model.generate(ids, max_new_tokens=10, do_sample=True, temperature=0.9, top_k=20)
    assert row["new_token_ids"] == ref[0, ids.shape[1] :].tolist() and row["sp_size"] == 2


def _ids(model_dir: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / "model"
    _save_tiny(path)
    return path


def _write(path: Path, text: str | None) -> str:
    if text is not None:
        path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("prompt", "extra", "world", "message"),
    [
        (None, [], "1", "--prompt-file '{prompt}' does not exist"),
        ("\n", [], "1", "--prompt-file {prompt}: the prompt is empty"),
        ('{"prompt": "f1"}\n{"text": "f2"}\n', [], "1", 'line 2: needs a non-empty string "prompt"'),
        ("not json\n", [], "1", "line 1: not JSON"),
        ("f1 f2", ["--temperature", "0.7"], "1", "--temperature only apply when sampling"),
        ("f1 f2", ["--do-sample", "--top-p", "1.5"], "1", "--top-p=1.5 must be in (0, 1]"),
        ("f1 f2", ["--max-new-tokens", "0"], "1", "--max-new-tokens=0 must be >= 1"),
        (
            "f1 f2",
            [],
            "2",
            "2 ranks but sequence_parallel.size=4: generation runs on one SP group; fix: launch 4 "
            "ranks, or pass --sp-size 2",
        ),
        ("f1 f2", ["--sp-size", "4"], "8", "8 ranks but sequence_parallel.size=4"),
        (
            "f1 f2",
            ["--max-new-tokens", "1048576"],
            "1",
            "prompt 1 has 2 tokens, + --max-new-tokens 1048576 > the model's max_position_embeddings=1048576",
        ),
    ],
)
def test_bad_generate_inputs_fail_before_any_process_group(
    tmp_path, monkeypatch, saved_model, prompt, extra, world, message
):
    path = _write(
        tmp_path / ("p.jsonl" if (prompt and "{" in prompt) or prompt == "not json\n" else "p.txt"), prompt
    )
    monkeypatch.setenv("WORLD_SIZE", world)
    size = [] if "--sp-size" in extra or world == "2" else ["--sp-size", world]
    argv = [
        "--model",
        str(saved_model),
        "--ds_config",
        str(DEFAULT_CONFIG),
        "--prompt-file",
        path,
        *size,
        *extra,
    ]
    with pytest.raises((UsageError, SeqParConfigError)) as info:
        parse_args(argv)
    assert message.format(prompt=path) in str(info.value)
    assert not dist.is_initialized()


def test_model_directory_errors_name_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    prompt = _write(tmp_path / "p.txt", "f1 f2")
    base = ["--ds_config", str(DEFAULT_CONFIG), "--sp-size", "1", "--prompt-file", prompt]
    with pytest.raises(SeqParConfigError, match=r"no weights in this directory .* or --random-init"):
        parse_args(["--model", str(TINY), *base])
    with pytest.raises(UsageError, match=r"--model '/no/such' is not a directory"):
        parse_args(["--model", "/no/such", *base])
    assert len(parse_args(["--model", str(TINY), "--random-init", *base]).prompts) == 1


def test_generate_stays_the_function_after_the_command_lines_import():
    """``python -m ds_seqpar.generate`` imports the package, which rebinds ``ds_seqpar.generate``: it forwards."""
    from ds_seqpar.integrations.generation import generate

    importlib.import_module("ds_seqpar.generate.__main__")
    assert isinstance(sys.modules["ds_seqpar.generate"], type(ds_seqpar.generate))
    assert callable(ds_seqpar.generate) and inspect.signature(ds_seqpar.generate) == inspect.signature(
        generate
    )
    with pytest.raises(ValueError, match=r"needs mesh=\.\.\. \(a SeqParMesh\)"):
        ds_seqpar.generate(torch.nn.Linear(2, 2), torch.zeros(1, 3, dtype=torch.long))


def generate_accuracy_case(seed: int) -> dict:
    """ZeRO-3, dp 2 x SP 2, 5 passkey rows of 256 (one replica runs 3, the other 2 + a filler): the accuracy of
    rows whose answer is set to the one-process HF prediction (rows 0, 2, 4) or to another token (1, 3)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ds_seqpar.cli.eval_generate import generate_accuracy
    from ds_seqpar.tasks.passkey import PasskeyDataset, PasskeyTask

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY), dtype=torch.float32)
    ref = copy.deepcopy(model).eval()
    data = PasskeyDataset(
        PasskeyTask(AutoTokenizer.from_pretrained(TINY), num_questions=8, num_keys=8), 5, 256
    )

    class Answers(torch.utils.data.Dataset):
        task = data.task

        def __len__(self) -> int:
            return len(data)

        def __getitem__(self, i: int) -> dict:
            row = dict(data[i])
            q = int(torch.nonzero(row["input_ids"] == data.task.question)[0])
            with torch.no_grad():
                pred = int(ref(row["input_ids"][None, : q + 1]).logits[0, -1].argmax())
            labels = row["labels"].clone()
            labels[q + 1] = pred if i % 2 == 0 else pred + 1
            return {**row, "labels": labels}

    config = json.loads(DEFAULT_CONFIG.read_text())
    config["sequence_parallel"]["size"] = 2
    engine, *_ = ds_seqpar.initialize(model=model, config=config)  # the config's AdamW, never stepped
    return generate_accuracy(engine, Answers(), engine.seqpar_mesh, rows_per_call=2)


def test_generate_accuracy_under_zero3_equals_one_process(dist_pool):
    results = dist_pool(4).run(generate_accuracy_case, 3)
    for res in results:
        assert res["generate_accuracy"] == pytest.approx(3 / 5) and res["generate_samples"] == 5, results


def test_train_eval_generate_logs_the_accuracy(dist_pool, tmp_path):
    """train.py --eval-generate on 2 SP ranks (ZeRO-3): generate_accuracy at the start and the end, over every
    held-out row, in metrics.jsonl."""
    config = json.loads(DEFAULT_CONFIG.read_text())
    config["sequence_parallel"]["size"] = 2
    path = tmp_path / "sp2.json"
    path.write_text(json.dumps(config))
    argv = ["--ds_config", str(path), "--eval-generate", "--seq-len", "256", "--curriculum", "none",
            "--max-steps", "2", "--eval-every", "0", "--eval-samples", "3", "--no-progress", "--no-export",
            "--save-every", "0", "--output-dir", str(tmp_path / "out")]  # fmt: skip
    rows = [r for r in dist_pool(2).run(run_cli, argv)[0] if "eval_loss" in r]
    assert [r["step"] for r in rows] == [0, 2]
    for r in rows:
        assert (
            r["generate_samples"] == 3 and 0.0 <= r["generate_accuracy"] <= 1.0 and r["generate_time_s"] > 0
        )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--objective", "mlm"], "--eval-generate decodes with a causal LM; --objective mlm has none"),
        (
            ["--data", str(REPO / "README.md")],
            "--eval-generate answers the embedded passkey task's questions",
        ),
    ],
)
def test_bad_eval_generate_fails_before_any_process_group(monkeypatch, extra, message):
    from ds_seqpar.cli import parse_args as train_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(UsageError) as info:
        train_args(["--eval-generate", "--sp-size", "1", "--seq-len", "256", *extra])
    assert message in str(info.value)
    assert not dist.is_initialized()
