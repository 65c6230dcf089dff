"""Diffusion transformers under SP (docs/dit.md): tiny PixArt, SD3 (MM-DiT) and Flux from assets/, against one
process. fp64 transformer forward + backward for every U x R of P in {2, 4}, with a prompt length that does not
divide P (padded stream); whole 8-step pipelines under SP, CFG parallel and their hybrid (fp32 and fp64); the
training step through ds_seqpar.initialize (ZeRO-0 and ZeRO-3); the refusals."""

from __future__ import annotations

import pytest
import torch

import ds_seqpar
from ds_seqpar.config import SeqParConfigError
from ds_seqpar.dit import load_pipeline, parallelize
from ds_seqpar.errors import MissingFileError
from ds_seqpar.integrations.dit import plan_of
from tests.helpers import dit_cases
from tests.helpers.dit_cases import ASSETS, FAMILIES


def _transformer_cases(p: int) -> list[dict]:
    out = [dit_cases.transformer_vs_reference("dit", u, 0) | {"case": ("dit", u)} for u in sorted({1, p})]
    for family in FAMILIES:
        for u in sorted({1, 2, p}):
            for text in (8, 7):  # 7 tokens do not divide P: the prompt stream is padded
                out.append(dit_cases.transformer_vs_reference(family, u, text) | {"case": (family, u, text)})
    return out


@pytest.mark.parametrize("p", [2, 4])
def test_transformer_forward_and_gradients_match_one_process(dist_pool, p):
    results = dist_pool(p).run(_transformer_cases, p)
    for per_rank in results:
        for r in per_rank:
            assert r["out"] <= 1e-12 and r["grad"] <= 1e-12, r


def _pipeline_cases(p: int) -> list[dict]:
    sections = [{"size": p}, {"size": p, "ulysses_degree": 2}, {"size": p // 2, "dit": {"cfg_parallel": 2}}]
    if p == 2:
        sections = [{"size": 2}, {"size": 1, "dit": {"cfg_parallel": 2}}]
    out = []
    for family in FAMILIES:
        for section in sections:
            if family == "flux" and "dit" in section:
                continue  # FluxPipeline runs no batched CFG (refused by name below)
            for dtype in ("float32", "float64"):
                r = dit_cases.pipeline_vs_reference(family, section, dtype)
                out.append(r | {"case": (family, str(section), dtype)})
    return out


@pytest.mark.parametrize("p", [2, 4])
def test_denoising_runs_match_one_process(dist_pool, p):
    results = dist_pool(p).run(_pipeline_cases, p)
    for per_rank in results:
        for r in per_rank:
            assert r["latents"] <= (1e-5 if r["case"][2] == "float32" else 1e-12), r
            assert r["bytes"] > 0, r


def _block_sparse_cases() -> list[dict]:
    return [
        dit_cases.block_sparse_pipeline(family, keep) | {"case": (family, keep)}
        for family, keep in (("pixart", 1.0), ("sd3", 0.5))  # sd3: joint attention with a padded prompt
    ]


def test_block_sparse_attention_in_the_pipelines(dist_pool):
    """``dit.attention: "block_sparse"``: keeping every block is dense attention (exact); keeping half changes
    the latents (an approximation of the model) while db-SP keeps ρ_s <= 1.05 on every layer."""
    for per_rank in dist_pool(4).run(_block_sparse_cases):
        for r in per_rank:
            keep = r["case"][1]
            assert r["layers"] == 2 and r["rho"] <= 1.05, r
            if keep == 1.0:
                assert r["latents"] <= 1e-12 and r["density"] == 1.0, r
            else:
                assert 1e-6 < r["latents"] < 0.1 and abs(r["density"] - keep) < 0.05, r


def _training_cases() -> list[dict]:
    return [
        dit_cases.training_vs_reference(family, stage, u) | {"case": (family, stage, u)}
        for family, stage, u in (("sd3", 3, 2), ("pixart", 0, 1), ("flux", 3, 1))
    ]


def test_training_step_matches_one_process(dist_pool):
    for per_rank in dist_pool(2).run(_training_cases):
        for r in per_rank:
            assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5, r


def _refusals() -> dict[str, str]:
    messages = {}
    pipe = load_pipeline(ASSETS / "tiny-flux", random_init=True)
    for name, config in {
        "world": {"size": 3},
        "pipefusion_sp": {"size": 1, "dit": {"pipefusion": {"degree": 2}}},
    }.items():
        try:
            parallelize(pipe, {"sequence_parallel": config})
        except SeqParConfigError as exc:
            messages[name] = str(exc)
    run = parallelize(pipe, {"sequence_parallel": {"size": 1, "dit": {"cfg_parallel": 2}}})
    try:
        dit_cases.denoise(pipe, "flux", torch.float32)
    except ds_seqpar.UnsupportedModelError as exc:
        messages["flux_cfg"] = str(exc)
    run.remove()
    return messages


def test_refusals_name_the_value_and_the_fix(dist_pool):
    messages = dist_pool(2).run(_refusals)[0]
    assert "= 3 ranks, but the world has 2" in messages["world"]
    assert "pipefusion.degree=2" in messages["pipefusion_sp"] and "joint" in messages["pipefusion_sp"]
    assert "cfg_parallel=2" in messages["flux_cfg"] and "two calls" in messages["flux_cfg"]


def test_a_model_read_from_its_cp_plan(dist_pool):
    r = dist_pool(2).run(dit_cases.flux_through_its_cp_plan)[0]
    assert r["out"] <= 1e-12 and r["grad"] <= 1e-12, r
    assert (
        "FluxTransformer2DModel._cp_plan" in r["refused"] and "does not divide the SP size 2" in r["refused"]
    )


def test_plans_and_loading_errors(tmp_path):
    pipe = load_pipeline(ASSETS / "tiny-pixart", random_init=True)
    assert plan_of(pipe.transformer).splits == {"transformer_blocks.0": {"hidden_states": dit_cases_split()}}
    with pytest.raises(MissingFileError, match="random_init=True"):
        load_pipeline(ASSETS / "tiny-pixart")
    with pytest.raises(MissingFileError, match=r"model_index\.json"):
        load_pipeline(tmp_path)
    with pytest.raises(ds_seqpar.UnsupportedModelError, match="has no token plan"):
        plan_of(torch.nn.Linear(2, 2))


def test_dit_settings_not_honoured_are_refused_by_name():
    from ds_seqpar.config import parse_section
    from ds_seqpar.integrations.dit import check_dit_settings, check_no_dit_settings

    heads = type("Heads", (), {"num_attention_heads": 4})()

    def settings(section: dict):
        return parse_section(section, 2).validate(heads, 2)

    with pytest.raises(SeqParConfigError, match=r"dit\.sparse\.keep is set .* attention='dense'"):
        parse_section({"size": 2, "dit": {"sparse": {"keep": 0.5}}}, 2)
    with pytest.raises(SeqParConfigError, match=r"dit\.pipefusion\.patches is set .*degree=1"):
        parse_section({"size": 2, "dit": {"pipefusion": {"patches": 8}}}, 2)
    lm_features = settings(
        {"size": 2, "attention": "sparse_ring", "memory": {"activation_checkpointing": True}}
    )
    with pytest.raises(
        SeqParConfigError, match=r"attention='sparse_ring'.*memory\.activation_checkpointing=true"
    ):
        check_dit_settings(lm_features, "PixArtTransformer2DModel", training=False)
    cfg = settings({"size": 1, "data_parallel_size": 2, "dit": {"cfg_parallel": 2}})
    check_dit_settings(cfg, "PixArtTransformer2DModel", training=False)
    with pytest.raises(SeqParConfigError, match=r"dit\.cfg_parallel=2 .* in training"):
        check_dit_settings(cfg, "PixArtTransformer2DModel", training=True)
    with pytest.raises(SeqParConfigError, match=r"dit sets \['cfg_parallel'\], but LlamaForCausalLM"):
        check_no_dit_settings(cfg, "LlamaForCausalLM")
    check_no_dit_settings(settings({"size": 2}), "LlamaForCausalLM")


def dit_cases_split():
    from ds_seqpar.integrations.dit import SplitInput

    return SplitInput(1, 3)
