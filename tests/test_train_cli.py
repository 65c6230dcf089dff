"""train.py: flags and config checked before any process group, resume exactness, text data packing."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ds_seqpar import SeqParConfigError
from ds_seqpar.cli import DEFAULT_CONFIG, build_parser, main, parse_args
from ds_seqpar.tasks.text import pack_documents
from ds_seqpar.user_errors import UsageError
from tests.helpers.cli_runs import run_cli
from tests.helpers.harness import run_launcher


def test_help_documents_every_flag():
    parser = build_parser()
    text = parser.format_help()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{action.option_strings} has no help text"
        for option in action.option_strings:
            assert option in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seq-len", "0"], "--seq-len=0 must be >= 1"),
        (["--max-steps", "-1"], "--max-steps=-1 must be >= 1"),
        (["--rope-scaling", "ntk:2"], "--rope-scaling='ntk:2': use TYPE:FACTOR"),
        (["--rope-scaling", "linear:0.5"], "FACTOR > 1"),
        (["--model", "/no/such/model"], "--model '/no/such/model' does not exist"),
        (["--data", "/no/such.jsonl"], "--data '/no/such.jsonl' does not exist"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--curriculum", "1024"], "--curriculum='1024': use SEQ:STEPS"),
        (["--seq-len", "100"], "the embedded passkey task needs sequences of at least 137 tokens"),
        (["--memory", "checkpoint"], "--memory='checkpoint': unknown saving(s) ['checkpoint']"),
        (["--max-seq-len-search", "0"], "--max-seq-len-search=0 must be a budget > 0 MiB per rank"),
        (["--sp-size", "0"], "--sp-size=0 must be >= 1"),
        (["--packing", "balanced", "--sp-size", "1"], "--packing balanced packs the documents of --data"),
        (
            ["--objective", "mlm", "--model", str(DEFAULT_CONFIG.parent.parent / "assets" / "tiny-llama")],
            "--objective mlm: the model at",
        ),
        (
            ["--model", str(DEFAULT_CONFIG.parent.parent / "assets" / "tiny-modernbert")],
            "pass --objective mlm",
        ),
        (["--objective", "seq2seq"], "argument --objective: invalid choice"),
        (
            ["--sp-size", "3", "--ds_config", str(DEFAULT_CONFIG.parent / "double_ring_zero3.json")],
            "--sp-size=3: sequence_parallel.ring.inner_size=2 does not divide the ring degree R=3",
        ),
        (
            ["--memory", "offload"],
            "--memory='offload': sequence_parallel.memory.offload=true offloads the inputs",
        ),
    ],
)
def test_bad_flags_exit_with_a_message(argv, message):
    with pytest.raises(UsageError) as info:
        parse_args(argv)
    assert message in str(info.value) and "usage: train.py" in str(info.value)
    assert not dist.is_initialized()


def test_bad_config_fails_before_any_process_group(tmp_path, monkeypatch):
    config = json.loads(DEFAULT_CONFIG.read_text())
    config["sequence_parallel"]["size"] = 3
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(
        SeqParConfigError, match=r"sequence_parallel\.size=3 does not divide the world size 4"
    ):
        main(["--ds_config", str(path)])
    with pytest.raises(SeqParConfigError, match=r"'missing\.json' does not exist"):
        main(["--ds_config", "missing.json"])
    config["gradient_accumulation_steps"] = 2
    path.write_text(json.dumps(config))
    with pytest.raises(
        SeqParConfigError, match=r"gradient_accumulation_steps=2: train.py runs one micro batch"
    ):
        main(["--ds_config", str(path)])
    config["gradient_accumulation_steps"] = 1
    config["sequence_parallel"].update(size=4, ulysses_degree=8)
    path.write_text(json.dumps(config))
    with pytest.raises(SeqParConfigError, match=r"ulysses_degree=8 does not divide size=4"):
        main(["--ds_config", str(path)])
    assert not dist.is_initialized()


def test_sp_size_flag_overrides_the_config(monkeypatch):
    """The shipped config says size 4: on 2 ranks it fails by name, and ``--sp-size 2`` runs it unedited."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        SeqParConfigError, match=r"sequence_parallel\.size=4 does not divide the world size 2"
    ):
        parse_args([])
    args = parse_args(["--sp-size", "2"])
    assert (
        args.section.size == 2 and args.ds_config_dict["sequence_parallel_size"] == 2
    )  # DeepSpeed's key too
    assert parse_args(["--sp-size", "1"]).section.size == 1  # 2 data-parallel replicas of one rank each
    assert not dist.is_initialized()


@pytest.mark.parametrize("how", ["--sp-size", "size-auto"])
def test_deepspeed_launcher_runs_a_shipped_config_on_cpu(tmp_path, how):
    """docs/launch.md: DeepSpeed's launcher on CPU (``--num_gpus N`` starts N processes) on 2 ranks, with the
    shipped size-4 config through ``--sp-size 2`` (unedited), and with a copy that says ``"size": "auto"``."""
    launcher = Path(sys.executable).with_name("deepspeed")
    root = DEFAULT_CONFIG.parent.parent
    if how == "--sp-size":
        config_args = ["--ds_config", "ds_configs/usp_zero3.json", "--sp-size", "2"]
    else:
        config = json.loads(DEFAULT_CONFIG.read_text())
        config["sequence_parallel"]["size"] = "auto"
        (tmp_path / "auto.json").write_text(json.dumps(config))
        config_args = ["--ds_config", str(tmp_path / "auto.json")]
    cmd = [str(launcher), "--num_gpus", "2", "train.py", *config_args, "--max-steps", "2", "--no-export",
           "--output-dir", str(tmp_path / "run")]  # fmt: skip
    done = run_launcher(cmd, cwd=str(root))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "done: 2 steps" in done.stdout + done.stderr
    assert "2 ranks per sequence" in done.stdout + done.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and torch.isfinite(torch.tensor(losses)).all(), rows


def _small_config(tmp_path, sp: int = 2) -> str:
    config = json.loads(DEFAULT_CONFIG.read_text())
    config["sequence_parallel"]["size"] = sp
    path = tmp_path / f"sp{sp}.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_resume_gives_the_same_next_losses(dist_pool, tmp_path):
    """Checkpoint at step 2, resume to step 4 across the curriculum switch (3 steps at 192, then 256)."""
    pool = dist_pool(2)
    common = [
        "--curriculum",
        "192:3",
        "--ds_config",
        _small_config(tmp_path),
        "--seq-len",
        "256",
        "--eval-every",
        "0",
        "--eval-samples",
        "1",
        "--no-progress",
        "--no-export",
        "--save-every",
        "2",
    ]
    full = pool.run(run_cli, [*common, "--max-steps", "4", "--output-dir", str(tmp_path / "full")])[0]
    pool.run(run_cli, [*common, "--max-steps", "2", "--output-dir", str(tmp_path / "split")])
    resumed = pool.run(
        run_cli, [*common, "--max-steps", "4", "--resume", "--output-dir", str(tmp_path / "split")]
    )[0]
    losses = {r["step"]: r["loss"] for r in full if "loss" in r}
    after = {r["step"]: r["loss"] for r in resumed if "loss" in r}
    assert sorted(losses) == [1, 2, 3, 4]
    assert [r["seq_len"] for r in full if "loss" in r] == [192, 192, 192, 256]
    assert after[3] == losses[3] and after[4] == losses[4], (after, losses)
    assert after[1] == losses[1] and after[2] == losses[2]  # two runs of the same job: bit-identical


def test_text_data_trains_and_exports(dist_pool, tmp_path):
    docs = [" ".join(f"f{(i * 7 + j) % 64}" for j in range(40 + 13 * i)) for i in range(12)]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    argv = [
        "--ds_config",
        _small_config(tmp_path),
        "--data",
        str(data),
        "--seq-len",
        "128",
        "--max-steps",
        "2",
        "--eval-every",
        "0",
        "--no-progress",
        "--output-dir",
        str(tmp_path / "text"),
        "--lr",
        "1e-3",
        "--rope-scaling",
        "linear:2",
    ]
    pool = dist_pool(2)
    rows = pool.run(run_cli, argv)[0]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if "loss" in r)
    export = tmp_path / "text" / "hf_model"
    assert (export / "model.safetensors").exists() and (export / "tokenizer.json").exists()
    assert json.loads((export / "config.json").read_text())["rope_parameters"]["rope_type"] == "linear"
    # the export is a real HF model directory: train from it with --model (from_pretrained)
    again = [
        *argv[: argv.index("--output-dir")],
        "--output-dir",
        str(tmp_path / "again"),
        "--model",
        str(export),
    ]
    rows = pool.run(run_cli, [a for a in again if a not in ("--rope-scaling", "linear:2")])[0]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]


def test_packing_keeps_document_boundaries():
    rows = pack_documents([[5, 6, 7], [8, 9], [10, 11, 12, 13]], seq_len=4, eos_id=3)
    # stream: 5 6 7 3 | 8 9 3 10 | 11 12 13 3 ; positions restart per document
    assert [r["input_ids"].tolist() for r in rows] == [[5, 6, 7, 3], [8, 9, 3, 10], [11, 12, 13, 3]]
    assert [r["position_ids"].tolist() for r in rows] == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 2, 3]]
    assert [r["labels"].tolist() for r in rows] == [[-100, 6, 7, 3], [-100, 9, 3, -100], [11, 12, 13, 3]]


def test_passkey_rows_hide_the_answer_from_the_questions():
    from transformers import AutoTokenizer

    from ds_seqpar.cli import DEFAULT_MODEL
    from ds_seqpar.tasks.passkey import PasskeyTask

    task = PasskeyTask(AutoTokenizer.from_pretrained(DEFAULT_MODEL), num_questions=16, num_keys=16, prefix=4)
    starts = set()
    for seed in range(20):
        row = task.sample(512, torch.Generator().manual_seed(seed))
        ids, labels = row["input_ids"], row["labels"]
        key = int(labels[labels != -100][0])
        where = (ids == key).nonzero().flatten()
        assert len(where) == 4 and int(where[-1]) < 256  # the passkey sits in the first half only
        starts.add(int(where[0]))
        questions = (ids == task.question).nonzero().flatten()
        assert len(questions) == 16 and int(questions[0]) == 512 - 32
        assert torch.equal(
            (labels != -100).nonzero().flatten(), questions + 1
        )  # answers are labels, not inputs
        assert bool((labels[questions + 1] == key).all())
    assert len(starts) > 10  # the position varies: no fixed offset to learn


def test_passkey_data_asks_every_passkey_once_per_block():
    """Balanced rows (the default): each block of num_keys consecutive rows asks every passkey once, in
    an order that changes from block to block; reading a row again gives the same row."""
    from transformers import AutoTokenizer

    from ds_seqpar.cli import DEFAULT_MODEL
    from ds_seqpar.tasks.passkey import PasskeyDataset, PasskeyTask

    task = PasskeyTask(AutoTokenizer.from_pretrained(DEFAULT_MODEL), num_questions=4, num_keys=8, prefix=2)
    data = PasskeyDataset(task, 40, 64, seed=3)

    def key(row: dict) -> int:
        return int(row["labels"][row["labels"] != -100][0])

    keys = [key(data[i]) for i in range(len(data))]
    blocks = [keys[i : i + 8] for i in range(0, 40, 8)]
    assert all(sorted(b) == sorted(task.keys.tolist()) for b in blocks)
    assert len({tuple(b) for b in blocks}) > 1  # shuffled per block, not one fixed cycle
    assert torch.equal(data[13]["input_ids"], data[13]["input_ids"]) and key(data[13]) == keys[13]
    random_keys = PasskeyDataset(task, 40, 64, seed=3, balanced=False)
    drawn = [key(random_keys[i]) for i in range(len(random_keys))]
    assert any(sorted(drawn[i : i + 8]) != sorted(task.keys.tolist()) for i in range(0, 40, 8))


def test_max_seq_len_search_prints_the_models_largest_length(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    plain = main(["--max-seq-len-search", "256"])["max_seq_len"]
    saved = main(["--max-seq-len-search", "256", "--memory", "all"])["max_seq_len"]
    out = capsys.readouterr().out
    assert f"largest --seq-len {saved}" in out and "device peak per rank" in out
    assert saved > 2 * plain > 0 and saved % 4 == 0  # U 2 x R 2 zigzag: multiples of 4
    assert not dist.is_initialized()


def test_long_context_config_trains_with_every_saving(dist_pool, tmp_path):
    """ds_configs/long_context_zero3.json (resized to 2 ranks): checkpointing, offload, tiled MLP and norms;
    the same losses as ds_configs/usp_zero3.json (the savings change no number)."""
    losses = {}
    for name in ("long_context_zero3.json", "usp_zero3.json"):
        config = json.loads((DEFAULT_CONFIG.parent / name).read_text())
        config["sequence_parallel"]["size"] = 2
        path = tmp_path / name
        path.write_text(json.dumps(config))
        argv = ["--ds_config", str(path), "--seq-len", "256", "--max-steps", "2", "--eval-every", "0",
                "--eval-samples", "1", "--no-progress", "--no-export", "--output-dir", str(tmp_path / f"out_{name}")]  # fmt: skip
        losses[name] = [r["loss"] for r in dist_pool(2).run(run_cli, argv)[0] if "loss" in r]
    saved, plain = losses["long_context_zero3.json"], losses["usp_zero3.json"]
    assert len(saved) == 2 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(saved, plain)), losses


def test_sparse_ring_config_trains_with_dense_warmup(dist_pool, tmp_path):
    """ds_configs/sparse_ring_zero3.json (resized): step 1 dense (warm-up), then sparse with rho_s logged."""
    config = json.loads((DEFAULT_CONFIG.parent / "sparse_ring_zero3.json").read_text())
    section = config["sequence_parallel"]
    section.update(size=2, ulysses_degree=1)
    section["sparse"].update(block_size=32, dense_warmup_steps=1, last_q=16, local_diagonals=8)
    path = tmp_path / "sparse.json"
    path.write_text(json.dumps(config))
    argv = ["--ds_config", str(path), "--seq-len", "256", "--max-steps", "3", "--eval-every", "0"]
    argv += ["--eval-samples", "1", "--no-progress", "--no-export", "--output-dir", str(tmp_path / "sparse")]
    rows = [r for r in dist_pool(2).run(run_cli, argv)[0] if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "sparse_rho_s_max" not in rows[0]  # dense warm-up step
    for row in rows[1:]:
        assert row["sparse_layers"] == 2 and row["sparse_rho_s_max"] >= 1.0
        assert 0.0 < row["sparse_density"] < 1.0
        assert torch.isfinite(torch.tensor(row["loss"]))


@pytest.mark.parametrize("asset", ["tiny-minimax", "tiny-qwen3-next"])
def test_hybrid_trains_like_without_sp(dist_pool, tmp_path, asset):
    """ds_configs/linear_scan_zero3.json on the tiny hybrids (MiniMax: Lightning linear + softmax layers;
    Qwen3-Next: gated DeltaNet with its conv1d + softmax layers): 5 ZeRO-3 steps on 2 SP ranks (U 1 x R 2,
    zigzag All-Scan) give the losses of 1 process without SP."""
    config = json.loads((DEFAULT_CONFIG.parent / "linear_scan_zero3.json").read_text())
    model = str(DEFAULT_CONFIG.parent.parent / "assets" / asset)
    losses = {}
    for size in (2, 1):
        config["sequence_parallel"].update(size=size, ulysses_degree=1)
        path = tmp_path / f"linear{size}.json"
        path.write_text(json.dumps(config))
        argv = ["--ds_config", str(path), "--model", model, "--random-init", "--seq-len", "256"]
        argv += [
            "--max-steps",
            "5",
            "--eval-every",
            "0",
            "--eval-samples",
            "1",
            "--no-progress",
            "--no-export",
        ]
        argv += ["--lr", "1e-3", "--output-dir", str(tmp_path / f"run{size}")]
        rows = dist_pool(size).run(run_cli, argv)[0]
        losses[size] = [r["loss"] for r in rows if "loss" in r]
    assert len(losses[1]) == 5
    for sp, ref in zip(losses[2], losses[1], strict=True):
        assert abs(sp - ref) <= 1e-5 * abs(ref), losses


def test_masked_lm_objective_trains_like_without_sp(dist_pool, tmp_path):
    """--objective mlm on packed text (the tiny ModernBERT, documents of 40-183 tokens in rows of 256):
    4 ZeRO-3 steps on 2 SP ranks give the losses of 1 process; the embedded default runs and exports."""
    docs = [" ".join(f"f{(i * 7 + j) % 64}" for j in range(40 + 13 * i)) for i in range(12)]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    losses = {}
    for size in (2, 1):
        argv = ["--objective", "mlm", "--ds_config", _small_config(tmp_path, size), "--data", str(data)]
        argv += ["--seq-len", "256", "--max-steps", "4", "--eval-every", "0", "--no-progress", "--no-export"]
        argv += ["--lr", "1e-3", "--output-dir", str(tmp_path / f"mlm{size}")]
        rows = dist_pool(size).run(run_cli, argv)[0]
        losses[size] = [r["loss"] for r in rows if "loss" in r]
        assert all(0.0 <= r["eval_accuracy"] <= 1.0 for r in rows if "eval_accuracy" in r)
    assert len(losses[1]) == 4
    for sp, ref in zip(losses[2], losses[1], strict=True):
        assert abs(sp - ref) <= 1e-5 * abs(ref), losses
    argv = [
        "--objective",
        "mlm",
        "--ds_config",
        _small_config(tmp_path),
        "--seq-len",
        "256",
        "--max-steps",
        "2",
    ]
    argv += ["--curriculum", "none", "--eval-every", "0", "--eval-samples", "2", "--no-progress"]
    rows = dist_pool(2).run(run_cli, [*argv, "--output-dir", str(tmp_path / "mlm_default")])[0]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    export = tmp_path / "mlm_default" / "hf_model"
    assert json.loads((export / "config.json").read_text())["architectures"] == ["ModernBertForMaskedLM"]


def _factorised_config(tmp_path, u: int) -> str:
    config = json.loads(DEFAULT_CONFIG.read_text())
    config["sequence_parallel"].update(size=4, ulysses_degree=u)
    path = tmp_path / f"sp4_u{u}.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_resume_under_another_factorisation_gives_the_same_next_losses(dist_pool, tmp_path):
    """Checkpoint at step 2 with U2 x R2; resume with U1 x R4 and with U4 x R1 (K/V heads replicated):
    steps 3 and 4 match the uninterrupted U2 x R2 run (ZeRO-3 partitions follow the world, not U x R)."""
    pool = dist_pool(4)
    common = ["--seq-len", "256", "--curriculum", "192:3", "--eval-every", "0", "--eval-samples", "1"]
    common += ["--no-progress", "--no-export", "--save-every", "2"]
    full = pool.run(
        run_cli,
        [
            *common,
            "--ds_config",
            _factorised_config(tmp_path, 2),
            "--max-steps",
            "4",
            "--output-dir",
            str(tmp_path / "full"),
        ],
    )[0]
    losses = {r["step"]: r["loss"] for r in full if "loss" in r}
    split = tmp_path / "split"
    pool.run(
        run_cli,
        [
            *common,
            "--ds_config",
            _factorised_config(tmp_path, 2),
            "--max-steps",
            "2",
            "--output-dir",
            str(split),
        ],
    )
    for u in (1, 4):
        resumed_dir = tmp_path / f"resumed_u{u}"
        shutil.copytree(split, resumed_dir)
        resumed = pool.run(
            run_cli,
            [
                *common,
                "--ds_config",
                _factorised_config(tmp_path, u),
                "--max-steps",
                "4",
                "--resume",
                "--output-dir",
                str(resumed_dir),
            ],
        )[0]
        after = {r["step"]: r["loss"] for r in resumed if "loss" in r}
        for step in (3, 4):
            assert after[step] == pytest.approx(losses[step], rel=1e-5, abs=1e-6), (u, after, losses)


def test_a_config_error_is_reported_once_at_the_end(tmp_path):
    """Under torchrun with 4 ranks: the message once, in the last 5 lines, no traceback, exit code != 0."""
    config = json.loads(DEFAULT_CONFIG.read_text())
    config["sequence_parallel"]["ring"]["layuot"] = "zigzag"
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(config))
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun),
        "--nproc_per_node",
        "4",
        "train.py",
        "--ds_config",
        str(path),
        "--output-dir",
        str(tmp_path),
    ]
    done = run_launcher(cmd, cwd=str(DEFAULT_CONFIG.parent.parent))
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode != 0
    assert sum("layuot is not a known key" in line for line in lines) == 1, lines[-40:]
    assert any("layuot is not a known key (did you mean 'layout'?)" in line for line in lines[-5:]), lines[
        -10:
    ]
    assert not any("ds_seqpar/config/" in line for line in lines), lines  # no traceback of ours


def test_debug_shows_the_traceback(tmp_path):
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"sequence_parallel": {"size": 1, "sise": 2}}))
    cmd = [sys.executable, "train.py", "--ds_config", str(path)]
    root = str(DEFAULT_CONFIG.parent.parent)
    quiet, debug = run_launcher(cmd, cwd=root), run_launcher(cmd, cwd=root, env={"DS_SEQPAR_DEBUG": "1"})
    assert quiet.returncode == 2 and "Traceback" not in quiet.stderr
    last = quiet.stderr.strip().splitlines()[-2:]
    assert last[0].startswith("ds_seqpar: error (SeqParConfigError): sequence_parallel.sise"), last
    assert last[1] == "(set DS_SEQPAR_DEBUG=1 for the full traceback on every rank)"
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "sequence_parallel.sise" in debug.stderr


def test_a_bad_flag_is_reported_once(tmp_path):
    cmd = [sys.executable, "train.py", "--seq-len", "0"]
    done = run_launcher(cmd, cwd=str(DEFAULT_CONFIG.parent.parent))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "train.py: error: --seq-len=0 must be >= 1"


def test_eval_data_heldout_perplexity_equals_one_process(dist_pool, tmp_path, monkeypatch):
    """dp=2 x SP=2, 3 held-out rows of packed documents (a filler batch on one replica): --eval-data's
    heldout_loss at step 0 equals a one-process evaluation of the same model, heldout_ppl is its exp; both
    reach metrics.jsonl, the log line and DeepSpeed's monitor (ds_seqpar/heldout_loss)."""
    import math

    from ds_seqpar.cli.heldout import heldout_dataset
    from ds_seqpar.cli.run import _build_model
    from tests.helpers.trainer_eval import reference

    held = tmp_path / "held.jsonl"
    docs = [" ".join(f"w{(i * 11 + j) % 50}" for j in range(30 + 7 * i)) for i in range(12)]
    held.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    config = json.loads(DEFAULT_CONFIG.read_text())
    config["sequence_parallel"]["size"] = 2
    config["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "run"}
    path = tmp_path / "dp2.json"
    path.write_text(json.dumps(config))
    argv = ["--ds_config", path.as_posix(), "--eval-data", str(held), "--seq-len", "256", "--curriculum", "none",
            "--max-steps", "1", "--eval-every", "0", "--eval-samples", "1", "--no-progress", "--no-export", "--save-every", "0",
            "--output-dir", str(tmp_path / "out")]  # fmt: skip
    rows = [r for r in dist_pool(4).run(run_cli, argv)[0] if "heldout_loss" in r]
    assert [r["step"] for r in rows] == [0, 1]
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = parse_args(argv)
    data = heldout_dataset(args, args.tokenizer)
    assert len(data) == 3
    ref = reference(_build_model(args), [data[i] for i in range(len(data))])
    first = rows[0]
    assert abs(first["heldout_loss"] - ref["loss"]) <= 1e-6 * ref["loss"], (first, ref)
    assert first["heldout_accuracy"] == pytest.approx(ref["accuracy"], abs=1e-12)
    assert first["heldout_ppl"] == pytest.approx(math.exp(first["heldout_loss"]), rel=1e-12)
    assert first["heldout_tokens"] == ref["count"]
    csv_dir = tmp_path / "csv" / "run"
    for column in ("heldout_loss", "heldout_ppl"):
        logged = (csv_dir / f"ds_seqpar_{column}.csv").read_text().splitlines()[1:]
        assert [float(line.split(",")[1]) for line in logged] == pytest.approx(
            [r[column] for r in rows], rel=1e-6
        )


@pytest.mark.parametrize(
    ("write", "extra", "message"),
    [
        (None, [], "--eval-data '{path}' does not exist"),
        (
            "w1 w2 w3\n",
            [],
            "fewer than one row of --seq-len 256; fix: more held-out text, or a shorter --seq-len",
        ),
        ("\n\n", [], "--eval-data {path}: "),
        (
            "w1 w2 w3\n",
            ["--objective", "mlm"],
            "--eval-data measures next-token perplexity; --objective mlm has none",
        ),
    ],
)
def test_bad_eval_data_fails_before_any_process_group(tmp_path, write, extra, message):
    path = tmp_path / "held.txt"
    if write is not None:
        path.write_text(write)
    with pytest.raises((UsageError, SeqParConfigError)) as info:
        parse_args(["--eval-data", str(path), "--seq-len", "256", "--sp-size", "1", *extra])
    assert message.format(path=path) in str(info.value)
    assert not dist.is_initialized()
