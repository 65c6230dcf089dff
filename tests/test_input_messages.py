"""train.py's input errors name the file, the value and the fix, and are raised by ``parse_args`` (before any
process group): the DeepSpeed JSON's batch keys, the model directory (config, tokenizer, weights) and --data
(encoding, JSON lines, fields, no text, too few tokens). One launch under torchrun checks the report: once, no
traceback, no lock file left behind."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from ds_seqpar.cli import DEFAULT_CONFIG, DEFAULT_MODEL, parse_args
from ds_seqpar.errors import MissingFileError, SeqParConfigError
from tests.helpers.harness import run_launcher

ROOT = DEFAULT_CONFIG.parent.parent
BASE = ["--sp-size", "1", "--seq-len", "256", "--curriculum", "none"]


def _config(tmp_path: Path, **keys) -> str:
    config = json.loads(DEFAULT_CONFIG.read_text())
    for key, value in keys.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


def _refused(argv: list[str], error: type[Exception] = SeqParConfigError) -> str:
    with pytest.raises(error) as info:
        parse_args([*BASE, *argv])
    assert not dist.is_initialized()
    return str(info.value)


def _jsonl(tmp_path: Path, lines: list[bytes], name: str = "data.jsonl") -> str:
    path = tmp_path / name
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return str(path)


def _good_lines(n: int = 40) -> list[bytes]:
    return [json.dumps({"text": f"document {i} " + "words " * 20}).encode() for i in range(n)]


# ------------------------------------------------------------------------------------------ the DeepSpeed JSON


@pytest.mark.parametrize("value", ["auto", 0, 1.5, True])
def test_micro_batch_must_be_an_integer(tmp_path, value):
    path = _config(tmp_path, train_micro_batch_size_per_gpu=value)
    message = _refused(["--ds_config", path])
    assert f"{path}: train_micro_batch_size_per_gpu={value!r}: set an integer >= 1" in message
    assert "'auto' is filled in only by the HF Trainer integration" in message


def test_train_batch_size_must_match_micro_times_dp(tmp_path):
    message = _refused(["--ds_config", _config(tmp_path, train_batch_size=8)])
    assert "train_batch_size=8 is not train_micro_batch_size_per_gpu=1 x data parallel 1" in message
    assert "set it to 1" in message
    alone = _config(tmp_path, train_micro_batch_size_per_gpu=None, train_batch_size=2)
    assert "train_batch_size=2 without train_micro_batch_size_per_gpu" in _refused(["--ds_config", alone])
    neither = _config(tmp_path, train_micro_batch_size_per_gpu=None)  # train.py's default micro batch: 1
    assert parse_args([*BASE, "--ds_config", neither]).ds_config_dict["train_micro_batch_size_per_gpu"] == 1


# ---------------------------------------------------------------------------------------- the model directory


def _model_dir(tmp_path: Path, *drop: str) -> str:
    path = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, path)
    for name in drop:
        (path / name).unlink()
    return str(path)


def test_a_model_without_a_tokenizer_is_named(tmp_path):
    path = _model_dir(tmp_path, "tokenizer.json", "tokenizer_config.json")
    message = _refused(["--model", path, "--random-init"], MissingFileError)
    assert f"--model {path}: no tokenizer in this directory (looked for tokenizer.json" in message
    assert "tokenizer.save_pretrained(DIR)" in message


def test_a_model_without_weights_suggests_random_init(tmp_path):
    path = _model_dir(tmp_path)
    message = _refused(["--model", path], MissingFileError)
    assert f"--model {path}: no weights in this directory" in message
    assert "*.safetensors, pytorch_model*.bin, *.index.json" in message
    assert "--random-init to train its architecture from config.json" in message
    assert parse_args([*BASE, "--model", path, "--random-init"]).random_init
    (Path(path) / "model.safetensors").write_bytes(b"")  # present: from_pretrained is left to judge it
    assert parse_args([*BASE, "--model", path]).model == path


def test_a_model_without_config_json_is_named(tmp_path):
    path = _model_dir(tmp_path, "config.json")
    message = _refused(["--model", path, "--random-init"], MissingFileError)
    assert f"--model {path}: no config.json in this directory" in message
    assert "e.g. assets/tiny-llama" in message


# ------------------------------------------------------------------------------------------------------ --data


def test_non_utf8_data_names_the_line_and_byte_offset(tmp_path):
    lines = [*_good_lines(3), b'{"text": "caf\xe9"}']
    path = _jsonl(tmp_path, lines)
    offset = sum(len(line) + 1 for line in lines[:3]) + lines[3].index(b"\xe9")
    message = _refused(["--data", path])
    assert f"{path}:4: byte 0xe9 at byte offset {offset} of the file is not UTF-8" in message
    assert "fix: re-encode the file to UTF-8" in message
    text = tmp_path / "data.txt"
    data = b"first document\n\nsecond\ncaf\xe9\n"
    text.write_bytes(data)
    message = _refused(["--data", str(text)])
    at = data.index(b"\xe9")
    assert f"{text}:4: byte 0xe9 at byte offset {at} of the file is not UTF-8" in message


@pytest.mark.parametrize(
    ("line", "what"), [(b'"just a string"', "a JSON string ('just a string')"), (b"7", "a JSON number (7)")]
)
def test_a_line_that_is_not_an_object_is_named(tmp_path, line, what):
    path = _jsonl(tmp_path, [*_good_lines(2), line])
    message = _refused(["--data", path])
    assert f"{path}:3 is {what}, not a JSON object" in message
    assert 'with the text in field \'text\', such as {"text": "..."}' in message


def test_a_missing_or_non_string_field_is_named(tmp_path):
    path = _jsonl(tmp_path, [*_good_lines(2), b'{"body": "text here"}'])
    message = _refused(["--data", path])
    assert f"{path}:3 has no field 'text' (its fields: ['body'])" in message
    assert "--text-field FIELD" in message
    path = _jsonl(tmp_path, [b'{"body": null}'], "null.jsonl")
    message = _refused(["--data", path, "--text-field", "body"])
    assert f"{path}:1: field 'body' is a JSON null (None), not a string" in message


def test_data_without_text_is_refused(tmp_path):
    path = _jsonl(tmp_path, [b'{"text": ""}', b'{"text": "   \\n\\t"}', b'{"text": " "}'])
    message = _refused(["--data", path])
    assert f"--data {path}: no text in field 'text' in any of its 3 lines" in message


def test_data_too_short_for_one_row_is_refused(tmp_path):
    path = _jsonl(tmp_path, _good_lines(2))
    message = _refused(["--data", path, "--seq-len", "4096"])
    assert f"--data {path}:" in message and "fewer than one row of --seq-len 4096" in message


def test_a_directory_that_is_not_a_dataset_is_named(tmp_path):
    (tmp_path / "notes").mkdir()
    message = _refused(["--data", str(tmp_path / "notes")])
    assert (
        f"--data {tmp_path / 'notes'}: a directory must be one written by datasets' save_to_disk" in message
    )


def test_checked_data_is_packed_without_reading_it_again(tmp_path):
    """parse_args reads and tokenizes --data once; the datasets pack those tokens (as reading the file would)."""
    from transformers import AutoTokenizer

    from ds_seqpar.cli.data import datasets
    from ds_seqpar.tasks.text import PackedTextDataset

    path = _jsonl(tmp_path, [b"\xef\xbb\xbf" + _good_lines(1)[0], b"", *_good_lines(30)[1:]])  # BOM, blank
    args = parse_args([*BASE, "--seq-len", "64", "--data", path, "--eval-samples", "2"])
    assert len(args.data_tokens.lengths) == 30
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    train, held = datasets(args, tokenizer, num_train=4)
    direct = PackedTextDataset(path, tokenizer, 64)
    assert len(train[0]) + len(held) == len(direct) == 10 and len(held) == 1  # min(2, 10 // 10)
    for got, want in zip([*train[0], *held], direct.rows):
        assert all(got[k].equal(want[k]) for k in want)


# ------------------------------------------------------------------------------------------------ the report


def test_an_input_error_is_reported_once_without_a_lock_file_left(tmp_path):
    """Under torchrun with 2 gloo ranks: one report naming the file and value, no traceback, and no
    ds_seqpar-error-* lock file in the temp directory afterwards."""
    path = _config(tmp_path, train_micro_batch_size_per_gpu="auto")
    temp = tmp_path / "temp"
    temp.mkdir()
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc_per_node", "2", "train.py", "--ds_config", path, "--sp-size", "2",
           "--output-dir", str(tmp_path / "out")]  # fmt: skip
    done = run_launcher(cmd, cwd=str(ROOT), env={"TMPDIR": str(temp)})
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode != 0
    wanted = f"{path}: train_micro_batch_size_per_gpu='auto': set an integer >= 1"
    assert sum(wanted in line for line in lines) == 1, lines[-30:]
    assert not any("ds_seqpar/" in line for line in lines), (
        lines
    )  # no traceback of ours (torchrun has its own)
    assert not list(temp.glob("ds_seqpar-error-*")), list(temp.iterdir())
