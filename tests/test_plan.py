"""The planner (ds_seqpar/plan/, docs/plan.md): candidates follow the config rules, the memory budget
filters, the ranking is by predicted seconds per sequence, the command line names bad input, and
``plan: "auto"`` fills the section (refusing a value that conflicts). No process group; presets or a
cached local profile, so nothing is measured."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from ds_seqpar import SeqParConfigError, parse_section
from ds_seqpar.plan import (
    Candidate,
    NoCandidate,
    candidates,
    default_budget,
    load_model_config,
    plan_context,
    rank,
    read_lengths,
)
from ds_seqpar.plan.candidates import allowed_ulysses
from ds_seqpar.plan.cli import main as plan_main
from ds_seqpar.plan.clusters import GIB
from ds_seqpar.plan.compute import ModelDims, zigzag_row_work, zigzag_work
from ds_seqpar.plan.predict import _block_seconds, sp_calibration, sp_step_seconds
from ds_seqpar.plan.profile import ComputeProfile, profile_key, sp_profile_key

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "assets" / "tiny-llama"
LLAMA_8B = REPO / "benchmarks" / "models" / "llama3_8b_config.json"


@pytest.fixture(scope="module")
def tiny():
    return load_model_config(TINY)[0]


@pytest.fixture(scope="module")
def llama():
    return load_model_config(LLAMA_8B)[0]


@pytest.mark.parametrize(
    ("size", "heads", "kv", "allowed"),
    [
        (8, 32, 8, [1, 2, 4, 8]),
        (4, 4, 2, [1, 2, 4]),
        (8, 6, 2, [1, 2]),
        (6, 12, 4, [1, 2]),
        (16, 8, 8, [1, 2, 4, 8]),
    ],
)
def test_ulysses_candidates_follow_the_head_rules(size, heads, kv, allowed):
    assert allowed_ulysses(size, heads, kv) == allowed


def test_every_candidate_is_a_valid_section(llama):
    seen = set()
    for c in candidates([16], 16, 32, 8, 8):
        settings = parse_section({**c.section(), "ranks_per_node": 8}).validate(llama, 16)
        assert (settings.size, settings.ulysses_degree, settings.ring.schedule) == (16, c.ulysses, c.schedule)
        assert 32 % c.ulysses == 0 and c.ulysses <= 32
        seen.add(c.ring_label.split(" (")[0])
    assert {"ring", "double ring", "all_gather", "startrail", "attention2d", "none"} <= seen


def test_ranking_is_by_seconds_per_sequence_and_fits_the_budget(llama):
    ctx = plan_context(llama, world=16, ranks_per_node=8, cluster="h100-ib", seq_len=256 * 1024)
    budget = 40 * GIB
    ranked = rank(ctx, budget, sizes=[8, 16], memory=("none", "checkpointing", "all"))
    assert ranked and all(p.fits and p.peak_bytes <= budget for p in ranked)
    times = [p.seconds_per_sequence for p in ranked]
    assert times == sorted(times)
    assert all(p.reasons and "memory" in p.reasons for p in ranked)
    # a smaller budget keeps only the lighter ones; none left is an error that names the budget
    lighter = rank(ctx, 20 * GIB, sizes=[8, 16], memory=("none", "checkpointing", "all"))
    assert all(p.peak_bytes <= 20 * GIB for p in lighter) and len(lighter) < len(ranked)
    with pytest.raises(
        NoCandidate, match=r"no candidate fits --memory-budget 0.50 GiB per rank; the lightest"
    ):
        rank(ctx, 0.5 * GIB, sizes=[16])


def test_more_inter_node_bytes_cost_time_where_communication_shows(llama):
    """At 128K on 64 GPUs a flat ring crosses nodes at every step; the planner prefers a hierarchy."""
    ctx = plan_context(llama, world=64, ranks_per_node=8, cluster="a100-eth", seq_len=128 * 1024)
    ranked = rank(ctx, default_budget(ctx), sizes=[64], memory=("none",))
    by_label = {(p.candidate.ulysses, p.candidate.ring_label): p for p in ranked}
    flat, top = by_label[(1, "ring")], ranked[0]
    assert top.step_s < flat.step_s
    assert top.bytes_by_link["inter"] < flat.bytes_by_link["inter"]
    assert "inter-node" in flat.reasons


def test_attention_work_of_zigzag():
    one = zigzag_work(4096, 4)
    assert one.visible == pytest.approx(4096 * 4097 / 2 / 4, rel=1e-3)  # balanced: every rank a quarter
    packed = zigzag_row_work([3072, 1024], 4096, 4)  # two documents: zigzag over the row is unbalanced
    mean = (3072 * 3073 + 1024 * 1025) / 2 / 4
    assert packed.visible > 1.1 * mean


def test_lengths_add_the_document_layout(llama):
    seq_len, rows = read_lengths(REPO / "benchmarks" / "lengths" / "longtail_128k.json")
    ctx = plan_context(llama, world=8, ranks_per_node=8, cluster="h100-ib", seq_len=seq_len, rows=rows[:4])
    ranked = rank(ctx, default_budget(ctx), sizes=[8], memory=("checkpointing",))
    layouts = {p.candidate.layout for p in ranked}
    assert layouts == {"zigzag", "documents"}
    pair = {
        p.candidate.layout: p for p in ranked if (p.candidate.ulysses, p.candidate.ring_label) == (1, "ring")
    }
    assert pair["documents"].step_s < pair["zigzag"].step_s


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "nowhere/config.json"], "--model 'nowhere/config.json' does not exist"),
        (
            ["--model", str(TINY), "--seq-len", "12x"],
            "'12x' is not a token count; valid: e.g. 131072, 128K or 1M",
        ),
        (["--model", str(TINY), "--world", "0"], "'0' is not a positive integer"),
        (["--model", str(TINY), "--memory-budget", "-3"], "'-3' is not a positive number of GiB"),
        (["--model", str(TINY), "--cluster", "tpu"], "invalid choice: 'tpu'"),
        (["--model", str(TINY), "--memory-savings", "zip"], "zip not known; valid: none, checkpointing"),
        (["--model", str(REPO / "README.md")], "is not a readable transformers config"),
        (["--model", str(TINY), "--memory-budget", "0.0001"], "no candidate fits --memory-budget"),
    ],
)
def test_command_line_errors_name_the_value_and_the_fix(argv, message, capsys):
    base = {"--world": "4", "--ranks-per-node": "4", "--seq-len": "8192", "--cluster": "h100-ib"}
    for key, value in base.items():
        if key not in argv:
            argv = [*argv, key, value]
    with pytest.raises(SystemExit) as exit_info:
        plan_main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_command_line_bad_lengths_file(tmp_path, capsys):
    bad = tmp_path / "mix.json"
    bad.write_text(json.dumps({"seq_len": 100, "rows": [[60, 60]]}))
    with pytest.raises(SystemExit):
        plan_main(["--model", str(TINY), "--world", "2", "--ranks-per-node", "2", "--lengths", str(bad)])
    assert "rows [0] are empty, hold a length < 1 or sum past seq_len=100" in capsys.readouterr().err


def test_command_line_table_and_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["--model", str(LLAMA_8B), "--world", "16", "--ranks-per-node", "8", "--seq-len", "512K",
            "--cluster", "h100-ib", "--top", "3", "--json", str(out)]  # fmt: skip
    assert plan_main(argv) == 0
    text = capsys.readouterr().out
    assert "| rank | P x dp | U | R | inner ring | schedule |" in text and text.count("\n| ") == 4
    data = json.loads(out.read_text())
    first = data["ranked"][0]
    assert first["fits"] and first["section"]["ulysses_degree"] == first["ulysses"]
    parse_section({**first["section"], "ranks_per_node": 8}).validate(load_model_config(LLAMA_8B)[0], 16)


def _cached_profile(tmp_path: Path, config, ranks: int, sp: dict | None = None) -> Path:
    """A local profile cache written by hand (what a measurement would store), so nothing is measured."""
    dims = ModelDims.read(config)
    profile = ComputeProfile(
        "test profile", 6e10, 0.65, 2.5, 5e-5, 1e11, 2e10, 1e10, 16 * GIB, 4e-6, 5e-4, 1e-6, 1e-3
    )
    path = tmp_path / "profile.json"
    import platform

    path.write_text(json.dumps({profile_key(dims, "fp32", "cpu"): profile.to_json(),
                                f"latency-{platform.node()}-{ranks}": {"round_s": 1e-3, "allreduce_s": 2e-3},
                                sp_profile_key(dims, "fp32", "cpu", ranks): sp or {}}))  # fmt: skip
    return path


def test_local_cluster_reads_its_cached_profile(tmp_path, tiny):
    path = _cached_profile(tmp_path, tiny, 4)
    ctx = plan_context(tiny, world=4, ranks_per_node=4, cluster="local", seq_len=8192, profile_path=path)
    assert ctx.profile.source == "test profile" and ctx.profile.round_s == 1e-3
    assert ctx.cluster.lat_intra == 1e-3 and ctx.element_bytes == 4
    ranked = rank(ctx, default_budget(ctx), sizes=[4])
    assert ranked[0].step_s > 0 and ranked[0].parts["step overhead"] > 0


def test_plan_auto_fills_the_section_and_logs_why(tiny, caplog):
    section = {"size": 4, "plan": "auto", "plan_cluster": "h100-ib", "plan_seq_len": 16384}
    with caplog.at_level(logging.INFO, logger="ds_seqpar"):
        settings = parse_section(section).validate(tiny, 4)
    ctx = plan_context(tiny, world=4, ranks_per_node=4, cluster="h100-ib", seq_len=16384)
    best = rank(ctx, default_budget(ctx), sizes=[4], memory=("none",))[0].candidate
    assert (settings.ulysses_degree, settings.ring.schedule, settings.ring.inner_size) == (
        best.ulysses, best.schedule, best.inner,
    )  # fmt: skip
    (line,) = [r.getMessage() for r in caplog.records if "plan='auto' chose" in r.getMessage()]
    assert f"ulysses_degree={best.ulysses}" in line and "predicted" in line and "candidates" in line
    # a value the user set that agrees is kept; one that differs is refused by name
    parse_section({**section, "ulysses_degree": best.ulysses}).validate(tiny, 4)
    other = next(u for u in (1, 2, 4) if u != best.ulysses)
    with pytest.raises(
        SeqParConfigError,
        match=rf"sequence_parallel.ulysses_degree={other} conflicts with plan='auto', which chose ulysses_degree={best.ulysses}",
    ):
        parse_section({**section, "ulysses_degree": other}).validate(tiny, 4)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            {"size": 4, "plan_seq_len": 4096},
            "sequence_parallel.plan_seq_len is set but plan='manual' ignores it",
        ),
        ({"size": 4, "plan": "automatic"}, "plan"),
        (
            {"size": 4, "plan": "auto", "attention": "ring"},
            "plan='auto' chooses ulysses_degree, which attention='ring' fixes",
        ),
    ],
)
def test_plan_keys_are_validated(section, message):
    with pytest.raises(SeqParConfigError, match=message):
        parse_section(section)


def test_plan_auto_needs_the_model_and_a_known_cluster(tiny):
    with pytest.raises(SeqParConfigError, match=r'plan="auto" needs the model config'):
        parse_section({"size": 4, "plan": "auto"}).validate(None, 4)
    with pytest.raises(
        SeqParConfigError,
        match=r"plan_cluster='tpu' is not known; valid: h100-ib, a100-eth, mi300x-ib, local",
    ):
        parse_section({"size": 4, "plan": "auto", "plan_cluster": "tpu"}).validate(tiny, 4)
    with pytest.raises(SeqParConfigError, match=r"plan_cluster='local' profiles each node on its own"):
        parse_section({"size": 4, "plan": "auto", "ranks_per_node": 2}).validate(tiny, 4)


def test_projection_is_unchanged():
    """benchmarks/project.py takes its presets and time model from the library: same numbers as committed."""
    from benchmarks.project import setting, setting_rows

    committed = json.loads((REPO / "benchmarks" / "results" / "project.json").read_text())
    for row in (committed["table"][0], committed["table"][-1]):
        again = setting_rows(setting(row["cluster"], row["model"], row["seq_len"], row["world"]))
        assert json.loads(json.dumps(again)) == row


def test_candidate_section_round_trip():
    c = Candidate(8, 2, schedule="p2p", inner=2, memory="all")
    section = c.section()
    assert section["ring"] == {"schedule": "p2p", "layout": "zigzag", "inner_size": 2}
    assert section["memory"] == {
        "activation_checkpointing": True,
        "offload": True,
        "tiled_mlp": True,
        "tiled_norms": True,
    }
    assert (c.ring, c.ring_label) == (4, "double ring (inner 2)")


def _probe(ctx, kind: str, ulysses: int, factor: float, call_s: float) -> dict:
    """An attention probe as ``plan/sp_probe.py`` stores it, timed at ``factor`` × the block model +
    ``call_s`` (what a measurement would give for that engine)."""
    r, tokens = 4, [512, 2048]
    scale = (1 + ctx.profile.attention_backward) * ctx.compute_scale
    model = [
        _block_seconds(ctx.profile, zigzag_work(n * r, r // ulysses), 4 // ulysses, 16) * scale
        for n in tokens
    ]
    return {"ranks": r, "ulysses": ulysses, "heads": 4, "head_dim": 16, "tokens": tokens,
            "seconds": [factor * m + call_s for m in model]}  # fmt: skip


def test_local_profile_calibrates_the_sp_path(tmp_path, tiny):
    """The SP-path probe's figures (docs/plan.md "Clusters and calibrating"): the attention's factor and
    per-call seconds over the block model, and the fixed seconds per step less what the calls count."""
    path = _cached_profile(tmp_path, tiny, 4)
    ctx = plan_context(tiny, world=4, ranks_per_node=4, cluster="local", seq_len=8192, profile_path=path)
    assert sp_calibration(ctx, "ring") == (1.0, 0.0) and sp_step_seconds(ctx, Candidate(4, 1)) is None
    sp = {"sp_step_s": {"ring": 0.05, "ulysses": 0.02},
          "attention_probes": {"ring": _probe(ctx, "ring", 1, 1.3, 0.004), "ulysses": _probe(ctx, "ulysses", 4, 1.0, 0.0)}}  # fmt: skip
    path = _cached_profile(tmp_path, tiny, 4, sp)
    ctx = plan_context(tiny, world=4, ranks_per_node=4, cluster="local", seq_len=8192, profile_path=path)
    factor, call_s = sp_calibration(ctx, "ring")
    assert factor == pytest.approx(1.3) and call_s == pytest.approx(0.004)
    assert sp_calibration(ctx, "ulysses") == pytest.approx((1.0, 0.0), abs=1e-9)
    assert sp_step_seconds(ctx, Candidate(4, 1)) == pytest.approx(0.05 - tiny.num_hidden_layers * 0.004)
    assert sp_step_seconds(ctx, Candidate(4, 4)) == pytest.approx(0.02)
    by_kind = {p.candidate.ring: p for p in rank(ctx, default_budget(ctx), sizes=[4], memory=("none",))}
    assert by_kind[4].parts["SP path per step"] == pytest.approx(0.05 - tiny.num_hidden_layers * 0.004)
    preset = plan_context(tiny, world=4, ranks_per_node=4, cluster="h100-ib", seq_len=8192)
    assert sp_calibration(preset, "ring") == (1.0, 0.0)


def test_causal_cost_by_block_side():
    p = ComputeProfile(
        "t", 6e10, 0.65, 2.5, 5e-5, 1e11, 2e10, 1e10, GIB, causal_costs={"1024": 0.8, "4096": 0.6}
    )
    assert p.causal_cost_at(2048) == pytest.approx(0.7)
    assert p.causal_cost_at(1 << 20) == 0.5 and p.causal_cost_at(64) == 1.0
    assert p.causal_cost_at(0) == 0.65 and zigzag_work(8192, 4).side == 1024


def test_dynamic_degree_candidates(tiny):
    """Packed rows add documents + dynamic_degree candidates: a row of short documents runs at p = 1 (no
    attention communication, faster than the fixed policy), a row with a long document on all P ranks."""
    short, long = [256] * 16, [3584, 512]
    for rows, degrees in (([short, short], {1: 2}), ([long], {4: 1})):
        ctx = plan_context(tiny, world=4, ranks_per_node=4, cluster="h100-ib", seq_len=4096, rows=rows)
        ranked = rank(ctx, float("inf"), sizes=[4], memory=("none",))
        dynamic = [p for p in ranked if p.candidate.policy == "dynamic"]
        assert dynamic and all(p.candidate.layout == "documents" for p in dynamic)
        for p in dynamic:
            assert p.degrees == degrees and p.candidate.section()["dynamic_degree"] is True
            parse_section({**p.candidate.section(), "ranks_per_node": 4}).validate(tiny, 4)
            fixed = next(f for f in ranked if f.candidate == replace(p.candidate, dynamic=False))
            if 1 in degrees:
                assert p.bytes_by_link["intra"] == 0 and p.step_s < fixed.step_s
                assert "dynamic (p=1: 2 of 2 rows; 2 below P=4)" in p.reasons
            else:
                assert p.step_s == pytest.approx(fixed.step_s)
