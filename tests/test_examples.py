"""The example scripts (examples/*.py) with the shipped DeepSpeed configs, unmodified.

Each script runs once through its real launcher (torchrun, accelerate launch) and, for the config
sweep, through its ``main`` inside this module's pool of 4 gloo ranks.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ds_seqpar.config import SequenceParallelConfig
from ds_seqpar.parallel.comm_volume import attention_layer_bytes
from tests.helpers.harness import run_launcher

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
VENV_BIN = Path(sys.executable).parent
# every shipped config is for 4 ranks; linear_scan's section only changes linear-attention layers,
# which the tiny Llama of the examples does not have, so it runs like usp there
ACCELERATE_ENV = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE")
CONFIGS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "ds_configs").glob("*.json"))


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (the examples import their sibling ``common``)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def first_losses(out_dir: str) -> tuple[float, float]:
    """The first-step loss of examples/trainer.py and of ds_seqpar.initialize on the same model and batch.

    ``initialize`` runs first: after a Trainer with a ZeRO-3 config, transformers builds new models under
    ``deepspeed.zero.Init``, which draws the random init in another order.
    """
    common = load_example("common")
    import ds_seqpar

    model = common.load_model(None, 0)
    dataset = common.passkey_dataset(common.load_tokenizer(None), 512, 0)
    engine, _, loader, _ = ds_seqpar.initialize(
        model=model, config=str(common.DEFAULT_CONFIG), training_data=dataset, seed=0
    )
    initialize_loss = engine(**next(iter(loader))).item()
    trainer_loss = load_example("trainer").main(["--max-steps", "1", "--output-dir", out_dir])[0]
    return trainer_loss, initialize_loss


def test_trainer_example_first_loss_equals_initialize(dist_pool, tmp_path):
    for trainer_loss, initialize_loss in dist_pool(4).run(first_losses, str(tmp_path / "trainer")):
        assert math.isfinite(trainer_loss)
        assert abs(trainer_loss - initialize_loss) <= 1e-6 * abs(initialize_loss), (
            trainer_loss,
            initialize_loss,
        )


def _guide_trainer_loss(argv: list[str]) -> tuple[float, dict]:
    """examples/hf_ulysses_guide.py for one step: its loss and what the Trainer reports about its sizes."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # a model built after a ZeRO-3 run would be drawn under zero.Init
    trainer = load_example("hf_ulysses_guide").build(["--max-steps", "1", *argv])
    sizes = {
        "args_sp_size": trainer.args.parallelism_config.sp_size,  # the user's object, readable
        "accelerator_pc": trainer.accelerator.parallelism_config,  # accelerate runs no ALST
        "get_sp_size": trainer.get_sp_size(),
        "total_batch": trainer.get_total_train_batch_size(trainer.args),
    }
    trainer.train()
    sizes["epoch"] = trainer.state.epoch  # steps per epoch = len(loader) over dp, not x SP
    return trainer.state.log_history[0]["loss"], sizes


def _accelerate_loss(config: str, seq_len: int) -> tuple[float, int]:
    """``accelerate_prepare`` with ``Accelerator(parallelism_config=ParallelismConfig(sp_size=4))``."""
    import json

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin, ParallelismConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    import ds_seqpar

    common = load_example("common")
    unset_hf_deepspeed_config()
    model = common.load_model(None, 0)
    dataset = common.passkey_dataset(common.load_tokenizer(None), seq_len, 0)
    AcceleratorState._reset_state(True)
    with open(ROOT / config, encoding="utf-8") as fh:
        ds_config = json.load(fh)
    del ds_config["sequence_parallel"]["size"]  # stated by sp_size instead
    pc = ParallelismConfig(sp_backend="deepspeed", sp_size=4)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        accelerator = Accelerator(
            deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config), parallelism_config=pc
        )
        engine, _, loader = ds_seqpar.accelerate_prepare(accelerator, model, train_dataset=dataset, seed=0)
        loss = engine(**next(iter(loader))).item()
        return loss, accelerator.parallelism_config.sp_size  # the user's config again after prepare
    finally:
        os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
        AcceleratorState._reset_state(True)


def guide_losses(out_dir: str) -> dict:
    """The first loss of ds_seqpar.initialize, of the HF-guide script (the section's size equal to sp_size,
    and absent), of accelerate_prepare with sp_size, and what a plain Trainer with the section raises."""
    import json

    import transformers
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    import ds_seqpar

    common = load_example("common")
    seq = ["--seq-len", "128", "--output-dir", out_dir]
    unset_hf_deepspeed_config()  # after another test's ZeRO-3 Trainer, models would be drawn under zero.Init
    dataset = common.passkey_dataset(common.load_tokenizer(None), 128, 0)
    engine, _, loader, _ = ds_seqpar.initialize(
        model=common.load_model(None, 0), config=str(common.DEFAULT_CONFIG), training_data=dataset, seed=0
    )
    out = {"initialize": engine(**next(iter(loader))).item()}
    out["guide"] = _guide_trainer_loss(seq)
    no_size = json.loads(common.DEFAULT_CONFIG.read_text())
    del no_size["sequence_parallel"]["size"]
    path = f"{out_dir}/no_size_{dist.get_rank()}.json"
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(no_size, fh)
    out["guide_no_size"] = _guide_trainer_loss(["--ds_config", path, *seq])[0]
    out["accelerate"] = _accelerate_loss(str(common.DEFAULT_CONFIG.relative_to(ROOT)), 128)
    script = load_example("hf_ulysses_guide")
    script.ds_seqpar = SimpleNamespace(SeqParTrainer=transformers.Trainer)  # the guide's own Trainer
    try:
        script.main(["--max-steps", "1", *seq])
        out["plain"] = "trained"
    except ds_seqpar.SeqParConfigError as exc:
        out["plain"] = str(exc)
    return out


def test_hf_guide_script_first_loss_equals_initialize(dist_pool, tmp_path):
    """HF's Ulysses-guide form (ParallelismConfig(sp_backend="deepspeed", sp_size=4) on TrainingArguments)
    with SeqParTrainer: the first loss equals ds_seqpar.initialize's, with the section's size equal to sp_size
    or taken from it; accelerate_prepare takes sp_size too; a plain Trainer is refused naming the fix."""
    for res in dist_pool(4).run(guide_losses, str(tmp_path), timeout=600):
        reference = res["initialize"]
        loss, sizes = res["guide"]
        for got in (loss, res["guide_no_size"], res["accelerate"][0]):
            assert abs(got - reference) <= 1e-6 * abs(reference), (got, reference)
        assert sizes == {
            "args_sp_size": 4,
            "accelerator_pc": None,
            "get_sp_size": 4,
            "total_batch": 1,
            "epoch": 1 / 64,
        }, sizes
        assert res["accelerate"][1] == 4
        assert "ds_seqpar.SeqParTrainer instead of Trainer" in res["plain"], res["plain"]


def sweep(name: str, configs: list[str], out_dir: str) -> dict[str, list[float]]:
    example = load_example(name)
    results = {}
    for config in configs:
        out = f"{out_dir}/{Path(config).stem}"
        results[config] = example.main(
            ["--ds_config", config, "--max-steps", "2", "--seq-len", "256", "--output-dir", out]
        )
        dist.barrier()
    return results


@pytest.mark.parametrize("name", ["trainer", "sft_trl", "lora"])
def test_example_runs_with_every_shipped_config(dist_pool, tmp_path, name):
    for results in dist_pool(4).run(sweep, name, CONFIGS, str(tmp_path), timeout=900):
        assert sorted(results) == CONFIGS
        for config, losses in results.items():
            assert len(losses) == 2 and torch.isfinite(torch.tensor(losses)).all(), (config, losses)


POST_TRAINING_CONFIGS = ["ds_configs/usp_zero3.json", pytest.param(CONFIGS, marks=pytest.mark.slow)]


@pytest.mark.parametrize("name", ["grpo", "dpo"])
@pytest.mark.parametrize("configs", POST_TRAINING_CONFIGS, ids=["usp_zero3", "every_config"])
def test_post_training_examples_run(dist_pool, tmp_path, name, configs):
    """examples/grpo.py (rewards) and examples/dpo.py (losses): 2 finite values per config."""
    configs = [configs] if isinstance(configs, str) else configs
    for results in dist_pool(4).run(sweep, name, configs, str(tmp_path), timeout=900):
        for config, values in results.items():
            assert len(values) == 2 and torch.isfinite(torch.tensor(values)).all(), (config, values)


def accelerate_sweep(configs: list[str], out_dir: str) -> dict[str, list[float]]:
    """examples/accelerate_loop.py's main per config, with the environment ``accelerate launch
    --use_deepspeed --deepspeed_config_file CONFIG`` gives it (accelerate's state reset in between)."""
    from accelerate.state import AcceleratorState

    example = load_example("accelerate_loop")
    saved = {k: os.environ.get(k) for k in ACCELERATE_ENV}
    results = {}
    try:
        for config in configs:
            os.environ.update(
                ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_CONFIG_FILE=str(ROOT / config)
            )
            AcceleratorState._reset_state(True)
            results[config] = example.main(["--max-steps", "2", "--seq-len", "256", "--output-dir", out_dir])
            dist.barrier()
    finally:
        AcceleratorState._reset_state(True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return results


def test_accelerate_loop_runs_with_every_shipped_config(dist_pool, tmp_path):
    for results in dist_pool(4).run(accelerate_sweep, CONFIGS, str(tmp_path), timeout=900):
        assert sorted(results) == CONFIGS
        for config, losses in results.items():
            assert len(losses) == 2 and torch.isfinite(torch.tensor(losses)).all(), (config, losses)


def _launch_losses(done, marker: str, values: str = "losses [") -> list[float]:
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    lines = [line for line in out.splitlines() if line.startswith(marker)]
    assert len(lines) == 1, out[-4000:]  # printed once (rank 0), not once per rank
    losses = [float(x) for x in lines[0].split(values, 1)[1].split("]", 1)[0].split(",")]
    assert torch.isfinite(torch.tensor(losses)).all(), lines
    return losses


SLOW_LAUNCHES = ("hf_ulysses_guide", "grpo", "dpo")


@pytest.mark.parametrize(
    "name", ["trainer", "sft_trl", "lora", *(pytest.param(n, marks=pytest.mark.slow) for n in SLOW_LAUNCHES)]
)
def test_example_runs_under_torchrun(tmp_path, name):
    cmd = [str(VENV_BIN / "torchrun"), "--nproc_per_node", "4", f"examples/{name}.py",
           "--ds_config", "ds_configs/usp_zero3.json", "--max-steps", "2", "--output-dir", str(tmp_path)]  # fmt: skip
    marker = "reward [" if name == "grpo" else "losses ["
    assert len(_launch_losses(run_launcher(cmd, cwd=str(ROOT)), f"examples/{name}.py: 2 steps", marker)) == 2


@pytest.mark.parametrize(
    "config",
    ["ds_configs/usp_zero3.json", pytest.param("ds_configs/ring_zigzag_zero3.json", marks=pytest.mark.slow)],
)
def test_accelerate_loop_runs_under_accelerate_launch(tmp_path, config):
    cmd = [str(VENV_BIN / "accelerate"), "launch", "--num_processes", "4", "--use_deepspeed",
           "--deepspeed_config_file", config, "examples/accelerate_loop.py", "--max-steps", "2"]  # fmt: skip
    done = run_launcher(cmd, cwd=str(ROOT))
    assert len(_launch_losses(done, "examples/accelerate_loop.py: 2 steps")) == 2


def dsp_ab(steps: int) -> dict:
    """examples/dsp_video.py trained single-process, under DSP and under Ulysses, on this pool's ranks."""
    example = load_example("dsp_video")
    single = example.train("single", steps)
    out = {"single": single["losses"]}
    for mode in ("dsp", "ulysses"):
        got = example.train(mode, steps, example.build_mesh(mode))
        err = max(
            ((p - q).abs().max() / q.abs().max()).item() for p, q in zip(got["params"], single["params"])
        )
        out[mode] = {"losses": got["losses"], "param_rel_err": err, "bytes": got["bytes"]}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_dsp_video_example_equals_one_process_and_moves_less_than_ulysses(dist_pool, world):
    """Losses and the parameters after 3 SGD steps (every gradient) equal one process's, under DSP and under
    Ulysses; DSP sends 4 switches of the activation per block (2 forward, 2 backward), at most half of
    Ulysses' all-to-alls (comm_volume's formula)."""
    example = load_example("dsp_video")
    shard = example.B * (example.T // world) * example.S * example.C * 8  # one block's activation, fp64
    switch = (world - 1) * shard // world
    for res in dist_pool(world).run(dsp_ab, 3):
        for mode in ("dsp", "ulysses"):
            got = res[mode]
            assert got["param_rel_err"] <= 1e-5, (mode, got)
            for a, b in zip(got["losses"], res["single"], strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), (mode, got["losses"], res["single"])
        assert res["dsp"]["bytes"] == example.BLOCKS * 4 * switch
        settings = SequenceParallelConfig(size=world, ulysses_degree=world, attention="ulysses").validate()
        layer = attention_layer_bytes(
            settings,
            example.T,
            example.H,
            example.H,
            example.C // example.H,
            batch=example.B * example.S,
            element_bytes=8,
        )  # the temporal attention's all-to-alls (with the backward's rowsum when heads do not pipeline)
        assert res["ulysses"]["bytes"] == example.BLOCKS * layer.total >= 2 * res["dsp"]["bytes"]


def test_dsp_video_runs_under_torchrun():
    cmd = [str(VENV_BIN / "torchrun"), "--nproc_per_node", "2", "examples/dsp_video.py", "--steps", "2"]
    done = run_launcher(cmd, cwd=str(ROOT))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert out.count("dsp: 131,072 bytes sent per rank per step (P = 2)") == 1, out[-4000:]  # rank 0 only
    assert out.count("step 1: loss") == 1, out[-4000:]


def test_speech_seq2seq_runs_under_torchrun():
    """examples/speech_seq2seq.py with the shipped usp config: a tiny Whisper whose decoder cross-attends to
    encoder states sharded over 4 ranks (ds_seqpar.initialize picks SeqParSeq2SeqLM)."""
    cmd = [
        str(VENV_BIN / "torchrun"),
        "--nproc_per_node",
        "4",
        "examples/speech_seq2seq.py",
        "--max-steps",
        "2",
    ]
    done = run_launcher(cmd, cwd=str(ROOT))
    losses = _launch_losses(done, "examples/speech_seq2seq.py: 2 steps")
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses


@pytest.mark.parametrize("pack", [[], ["--one-per-row"]], ids=["packed", "one_per_row"])
def test_vlm_example_single_process_loss_falls(pack):
    """examples/vlm.py --single: the plain HF Qwen2-VL on the shipped multimodal rows (the reference of its
    SP run); main raises unless the loss falls."""
    losses = load_example("vlm").main(["--single", "--max-steps", "4", *pack])
    assert len(losses) == 4 and sum(losses[2:]) < sum(losses[:2]), losses


def vlm_sp_and_single(steps: int) -> dict[str, tuple[list[float], list[float]]]:
    """examples/vlm.py's training under SeqParVisionLM on this pool's ranks, and in one process (plain HF), with
    packed rows and with one record per row."""
    example = load_example("vlm")
    out = {}
    for mode in ([], ["--one-per-row"]):
        args = example.parse(["--max-steps", str(steps), *mode])
        out[" ".join(mode) or "packed"] = (example.train(args, sp=True)[0], example.train(args, sp=False)[0])
    return out


def test_vlm_example_under_sp_equals_one_process(dist_pool):
    """4 AdamW steps of examples/vlm.py on 2 ranks (vision inputs whole on each rank, tokens sharded, gradients
    summed over the group), packed and one record per row, give the plain model's losses in one process."""
    for res in dist_pool(2).run(vlm_sp_and_single, 4):
        for mode, (sp, single) in res.items():
            for a, b in zip(sp, single, strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), (mode, sp, single)


def test_vlm_example_runs_under_torchrun():
    cmd = [str(VENV_BIN / "torchrun"), "--nproc_per_node", "2", "examples/vlm.py", "--max-steps", "4"]
    assert len(_launch_losses(run_launcher(cmd, cwd=str(ROOT)), "examples/vlm.py: 4 steps")) == 4


def video_sp_and_single(names: tuple[str, ...], steps: int) -> dict[str, tuple]:
    """examples/vlm.py's training on ``names`` (files of assets/vlm_data with videos, rows of 128) under SeqParVisionLM on
    this pool's ranks and in one process, and the patch rows each call of the vision tower's patch embedding
    got on this rank under SP."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    example = load_example("vlm")
    out = {}
    for name in names:
        args = example.parse(
            [
                "--data",
                str(ROOT / "assets" / "vlm_data" / name),
                "--seq-len",
                "128",
                "--max-steps",
                str(steps),
            ]
        )
        rows: list[int] = []

        def count(module, inputs, rows=rows):
            if type(module).__name__ == "PatchEmbed":
                rows.append(int(inputs[0].shape[0]))

        handle = register_module_forward_pre_hook(count)
        try:
            sp = example.train(args, sp=True)[0]
        finally:
            handle.remove()
        out[name] = (sp, example.train(args, sp=False)[0], rows)
    return out


def _check_sp(reports: list[dict], name: str) -> None:
    sp, single, _ = reports[0][name]
    for a, b in zip(sp, single, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (name, sp, single)


def test_videos_under_sp_equal_one_process(dist_pool):
    """One AdamW step on 2 gloo ranks of the 4 videos packed into one row gives the plain model's loss in one
    process within 1e-5; the tower's 8 temporal patches of (1, 4, 4) = 16 rows go 4 to each rank."""
    reports = dist_pool(2).run(video_sp_and_single, ("videos.jsonl",), 1)
    _check_sp(reports, "videos.jsonl")
    assert [r["videos.jsonl"][2] for r in reports] == [[64], [64]]


def test_mixed_images_and_videos_under_sp_equal_one_process(dist_pool):
    """3 AdamW steps on 2 gloo ranks of mixed.jsonl (rows of 128 with images and videos) give the plain model's
    losses within 1e-5; each step calls the tower on the images, then on the videos, whose rows are shared
    by the ranks in whole temporal patches of 16 rows."""
    reports = dist_pool(2).run(video_sp_and_single, ("mixed.jsonl",), 3)
    _check_sp(reports, "mixed.jsonl")
    calls = [r["mixed.jsonl"][2] for r in reports]
    assert len(calls[0]) == len(calls[1]) == 6, calls
    for rank in calls:
        assert all(n > 0 for n in rank) and all(n % 16 == 0 for n in rank[1::2]), calls


def qwen2_5_vl_videos_sp_and_single(folder: str) -> list[tuple[float, float]]:
    """A tiny Qwen2.5-VL (tests/test_vlm_data.py's) on mixed.jsonl with fps 2 (rows of 128): each row's loss
    under SeqParVisionLM on this pool's ranks and through the plain HF forward."""
    import json as _json

    from transformers import AutoConfig, AutoModelForImageTextToText

    import ds_seqpar
    from ds_seqpar.cli.vlm import (
        PackedVlmDataset,
        collate_vlm,
        family_of,
        hf_inputs,
        position_function,
        read_vlm_data,
        vlm_dataloader,
    )

    data = ROOT / "assets" / "vlm_data"
    lines = [_json.loads(x) for x in (data / "mixed.jsonl").read_text().splitlines()]
    for x in lines:  # absolute paths: the file is written elsewhere
        x["images"] = [str(data / f) for f in x.get("images", [])]
        x["videos"] = [[str(data / f) for f in v] for v in x.get("videos", [])]
        x.update({"fps": 2} if x["videos"] else {})
    path = Path(folder) / f"mixed_{dist.get_rank()}.jsonl"
    path.write_text("".join(_json.dumps(x) + "\n" for x in lines))
    config = AutoConfig.from_pretrained(folder)
    records = read_vlm_data(str(path), folder, config, 128)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    rows = PackedVlmDataset(records, 128, position_function(family_of(config), model), 0)
    with torch.no_grad():  # the plain model first: the wrapper replaces its attention
        single = [model(**hf_inputs(collate_vlm([rows[i]]))).loss.item() for i in range(len(rows))]
    mesh = ds_seqpar.SeqParMesh.from_config({"size": dist.get_world_size()}, model.config)
    loss_fn = ds_seqpar.SeqParVisionLM(model, mesh)
    loader = vlm_dataloader(rows, mesh, 1, shuffle=False, pad_token_id=0)
    with torch.no_grad():
        sp = [loss_fn(**batch).item() for batch in loader]
    return list(zip(sp, single, strict=True))


def test_qwen2_5_vl_videos_under_sp_equal_one_process(dist_pool, tmp_path):
    """Qwen2.5-VL rows with images and videos (second_per_grid_ts from the records' fps) on 2 gloo ranks give
    the plain model's loss of each row within 1e-5."""
    from tests.test_vlm_data import _tiny_qwen2_5_vl

    folder = _tiny_qwen2_5_vl(tmp_path)
    for rep in dist_pool(2).run(qwen2_5_vl_videos_sp_and_single, folder):
        assert len(rep) == 2, rep
        for sp, single in rep:
            assert abs(sp - single) <= 1e-5 * abs(single), rep


def test_dit_example_generates_like_one_process_and_trains_under_torchrun():
    """examples/dit.py as docs/dit.md runs it: 8 denoising steps of the tiny SD3 under CFG parallel x SP on 4
    ranks equal one process (its --check fails the run otherwise); 2 ZeRO-3 training steps on 2 ranks."""
    cmd = [str(VENV_BIN / "torchrun"), "--nproc_per_node", "4", "examples/dit.py",
           "--ds_config", "ds_configs/dit/cfg2_sp2.json", "--check"]  # fmt: skip
    done = run_launcher(cmd, cwd=str(ROOT))
    out = done.stdout + done.stderr
    assert done.returncode == 0 and out.count("max |latents - one process|") == 1, out[-4000:]
    cmd = [str(VENV_BIN / "torchrun"), "--nproc_per_node", "2", "examples/dit.py", "--train", "--steps", "2",
           "--ds_config", "ds_configs/dit/train_sp2_zero3.json"]  # fmt: skip
    done = run_launcher(cmd, cwd=str(ROOT))
    out = done.stdout + done.stderr
    assert done.returncode == 0 and out.count("examples/dit.py: step 2/2 loss") == 1, out[-4000:]


@pytest.mark.slow
def test_dit_sparse_attention_example_runs_under_torchrun():
    """examples/dit_sparse_attention.py as docs/dit_sparse.md runs it (4 ranks; it checks out and dq against the
    single-process reference itself and fails otherwise)."""
    cmd = [str(VENV_BIN / "torchrun"), "--nproc_per_node", "4", "examples/dit_sparse_attention.py"]
    done = run_launcher(cmd, cwd=str(ROOT), timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
