"""The "sequence_parallel" section: defaults, loading, and one clear message per bad input."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from ds_seqpar import SeqParConfigError, load_config, parse_section
from ds_seqpar.config import auto_ulysses_degree, config_field_paths

REPO = Path(__file__).resolve().parents[1]


def test_defaults_and_documented_example():
    cfg = parse_section(
        {
            "enabled": True,
            "size": 8,
            "ulysses_degree": 2,
            "ring": {"layout": "zigzag", "inner_size": None, "overlap": True},
            "attention": "usp",
            "kernel": "auto",
        }
    )
    settings = cfg.validate()
    assert (settings.size, settings.ulysses_degree, settings.ring_degree, settings.ring_inner_size) == (
        8,
        2,
        4,
        4,
    )
    minimal = parse_section({"size": 4})
    assert (minimal.ring.layout, minimal.attention, minimal.kernel, minimal.ulysses_degree) == (
        "zigzag",
        "usp",
        "auto",
        "auto",
    )


def test_load_config_sets_deepspeed_sequence_parallel_size(tmp_path):
    raw = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel": {"size": 4, "ulysses_degree": 2}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    for source in (raw, path, str(path)):
        section, ds = load_config(source)
        assert section.size == 4
        assert ds["sequence_parallel_size"] == 4
        assert "sequence_parallel" not in ds
        assert ds["train_micro_batch_size_per_gpu"] == 1
    assert "sequence_parallel_size" not in raw  # the caller's dict is not modified
    disabled, ds = load_config({"sequence_parallel": {"enabled": False, "size": 4}})
    assert ds["sequence_parallel_size"] == 1 and not disabled.enabled


def test_shipped_ds_configs_load():
    paths = sorted((REPO / "ds_configs").glob("*.json"))
    assert paths, "ds_configs/ ships at least one config"
    for path in paths:
        section, ds = load_config(path)
        assert ds["sequence_parallel_size"] == section.size


@pytest.mark.parametrize(
    ("size", "heads", "kv", "expected"),
    [(8, 32, 8, 8), (8, 8, 2, 2), (6, 12, 4, 2), (4, 8, 1, 1), (4, 2, 2, 2), (8, 4, 4, 4)],
)
def test_auto_ulysses_degree_rule(size, heads, kv, expected):
    assert auto_ulysses_degree(size, heads, kv) == expected
    resolved = parse_section({"size": size}).validate(
        {"num_attention_heads": heads, "num_key_value_heads": kv}
    )
    assert resolved.ulysses_degree == expected


def test_auto_for_pure_algorithms_needs_no_model():
    assert parse_section({"size": 4, "attention": "ring"}).validate().ulysses_degree == 1
    assert parse_section({"size": 4, "attention": "ulysses"}).validate().ulysses_degree == 4


# Each bad section -> (regex the message must match: the key, the bad value, a valid alternative).
BAD_SECTIONS = [
    (
        {"size": 8, "ulysses_degree": 3},
        r"sequence_parallel\.ulysses_degree=3 does not divide size=8; valid: 1, 2, 4, 8",
    ),
    (
        {"size": 8, "ulysses_degree": 0},
        r"sequence_parallel\.ulysses_degree=0 is not valid; valid: a positive integer or auto",
    ),
    (
        {"size": 8, "ulysses_degree": "autoo"},
        r"sequence_parallel\.ulysses_degree='autoo' is not valid; valid: a positive integer or auto",
    ),
    (
        {"size": 8, "ulysses_degree": 2.0},
        r"sequence_parallel\.ulysses_degree=2\.0 is not valid; valid: a positive integer or auto",
    ),
    ({}, r"sequence_parallel\.size is required; e\.g\. sequence_parallel\.size=8"),
    ({"size": 0}, r"sequence_parallel\.size=0 is not valid; valid: a positive integer or auto"),
    ({"size": "all"}, r"sequence_parallel\.size='all' is not valid; valid: a positive integer or auto"),
    ({"size": "auto", "data_parallel_size": 0}, r"sequence_parallel\.data_parallel_size=0"),
    ({"size": "8"}, r"sequence_parallel\.size='8' is not valid; valid: a positive integer or auto"),
    ({"size": True}, r"sequence_parallel\.size=True is not valid; valid: a positive integer or auto"),
    (
        {"size": 8, "sise": 8},
        r"sequence_parallel\.sise is not a known key \(did you mean 'size'\?\); valid keys: enabled, size",
    ),
    (
        {"size": 8, "ring": {"layuot": "zigzag"}},
        r"sequence_parallel\.ring\.layuot is not a known key \(did you mean 'layout'\?\); valid keys: layout",
    ),
    (
        {"size": 8, "ring": {"layout": "zig-zag"}},
        r"sequence_parallel\.ring\.layout='zig-zag' is not valid; valid: contiguous, zigzag, stripe",
    ),
    (
        {"size": 8, "ring": {"granularity": 0, "layout": "stripe"}},
        r"sequence_parallel\.ring\.granularity=0 must be >= 1",
    ),
    (
        {"size": 8, "ring": {"granularity": 64}},
        r"sequence_parallel\.ring\.granularity=64 only applies to layout='stripe'.*valid: remove granularity or set ring\.layout='stripe'",
    ),
    (
        {"size": 8, "ulysses_degree": 2, "ring": {"inner_size": 3}},
        r"sequence_parallel\.ring\.inner_size=3 does not divide the ring degree R=4 .*valid: null, 1, 2, 4",
    ),
    (
        {"size": 8, "ring": {"overlap": "yes"}},
        r"sequence_parallel\.ring\.overlap='yes' must be a boolean; valid: true, false",
    ),
    (
        {"size": 8, "ring": "zigzag"},
        r"sequence_parallel\.ring='zigzag' must be an object \(JSON dict\); valid keys: layout, granularity, inner_size, overlap, schedule, team_size, grid, startrail_backward",
    ),
    (
        {"size": 8, "attention": "usps"},
        r"sequence_parallel\.attention='usps' is not valid; valid: usp, ulysses, ring",
    ),
    (
        {"size": 8, "kernel": "flash"},
        r"sequence_parallel\.kernel='flash' is not valid; valid: auto, flash_attn, cuda_sdpa, sdpa, torch",
    ),
    (
        {"size": 8, "enabled": "true"},
        r"sequence_parallel\.enabled='true' must be a boolean; valid: true, false",
    ),
    (
        {"size": 8, "attention": "ulysses", "ulysses_degree": 2},
        r"sequence_parallel\.ulysses_degree=2 conflicts with attention='ulysses'.*valid: set ulysses_degree to 8",
    ),
    (
        {"size": 8, "attention": "ring", "ulysses_degree": 2},
        r"sequence_parallel\.ulysses_degree=2 conflicts with attention='ring'.*valid: set ulysses_degree to 1",
    ),
    (
        {"size": 8, "attention": "ring", "ring": {"inner_size": 3}},
        r"sequence_parallel\.ring\.inner_size=3 does not divide the ring degree R=8 .*valid: null, 1, 2, 4, 8",
    ),
]


@pytest.mark.parametrize(("section", "message"), BAD_SECTIONS, ids=[m[:40] for _, m in BAD_SECTIONS])
def test_bad_section_names_key_value_and_fix(section, message):
    with pytest.raises(SeqParConfigError, match=message):
        parse_section(section)


def test_several_problems_are_reported_together():
    with pytest.raises(SeqParConfigError) as info:
        parse_section({"size": 8, "attention": "x", "kernel": "y"})
    assert "sequence_parallel.attention='x'" in str(info.value)
    assert "sequence_parallel.kernel='y'" in str(info.value)


BAD_WORLD_OR_MODEL = [
    (
        {"size": 8, "ulysses_degree": 2},
        None,
        12,
        r"sequence_parallel\.size=8 does not divide the world size 12.*valid: 1, 2, 3, 4, 6, 12",
    ),
    (
        {"size": 8, "ulysses_degree": 8},
        {"num_attention_heads": 4},
        8,
        r"sequence_parallel\.ulysses_degree=8 exceeds the model's num_attention_heads=4; valid: 1, 2, 4",
    ),
    (
        {"size": 4},
        {"num_attention_heads": 8, "num_key_value_heads": 3},
        4,
        r"num_key_value_heads=3, which does not divide num_attention_heads=8; valid: 1, 2, 4, 8",
    ),
    ({"size": 4}, {"hidden_size": 64}, 4, r"num_attention_heads=None.*pass the model's config"),
    ({"size": 4}, None, 4, r"ulysses_degree=\"auto\" needs the model's head counts; pass model_config"),
]


@pytest.mark.parametrize(("section", "model", "world", "message"), BAD_WORLD_OR_MODEL)
def test_validate_against_model_and_world(section, model, world, message):
    with pytest.raises(SeqParConfigError, match=message):
        parse_section(section).validate(model, world)


def test_attention_free_model_takes_the_set_ulysses_degree():
    """A config without num_attention_heads (Mamba): U as set (its recurrent layers check it); "auto" with
    attention "ring" is 1."""
    assert (
        parse_section({"size": 4, "ulysses_degree": 2}).validate({"hidden_size": 64}, 4).ulysses_degree == 2
    )
    ring = {"size": 4, "attention": "ring"}
    assert parse_section(ring).validate({"hidden_size": 64}, 4).ulysses_degree == 1


def test_bad_files_and_top_level(tmp_path):
    with pytest.raises(
        SeqParConfigError, match=r"'missing\.json' does not exist; valid: a path .*ds_configs/usp_zero3\.json"
    ):
        load_config("missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"sequence_parallel": {"size": 4,}}')
    with pytest.raises(SeqParConfigError, match=r"broken\.json' is not valid JSON .*line 1"):
        load_config(broken)
    with pytest.raises(
        SeqParConfigError, match=r"no 'sequence_parallel' section; valid: add \"sequence_parallel\""
    ):
        load_config({"train_batch_size": 8})
    with pytest.raises(
        SeqParConfigError,
        match=r"sequence_parallel_size=2 \(DeepSpeed's key\) disagrees with sequence_parallel\.size=4; valid: .*set it to 4",
    ):
        load_config({"sequence_parallel_size": 2, "sequence_parallel": {"size": 4}})
    with pytest.raises(SeqParConfigError, match=r"sequence_parallel=4 must be an object"):
        load_config({"sequence_parallel": 4})


def test_every_config_field_is_documented():
    doc = (REPO / "docs" / "configuration.md").read_text()
    missing = [path for path in config_field_paths() if f"`{path}`" not in doc]
    assert not missing, f"docs/configuration.md does not document: {missing}"


@pytest.mark.parametrize(
    ("section", "world", "size"),
    [
        ({"size": "auto"}, 8, 8),
        ({"size": "auto", "data_parallel_size": 2}, 8, 4),
        ({"size": "auto", "data_parallel_size": 8}, 8, 1),
        ({"size": "auto", "ulysses_degree": 2}, 6, 6),
    ],
)
def test_auto_size_is_world_over_dp(section, world, size):
    resolved = parse_section(section, world)
    assert resolved.size == size
    assert resolved.model_dump(exclude_unset=True)["size"] == size  # re-parsed copies keep the integer
    resolved.validate(None if "ulysses_degree" in section else {"num_attention_heads": 8}, world)


def test_auto_size_reads_the_launchers_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    section, ds_config = load_config({"sequence_parallel": {"size": "auto"}})
    assert (section.size, ds_config["sequence_parallel_size"]) == (2, 2)
    section, ds_config = load_config({"sequence_parallel": {"size": "auto"}}, world_size=4)
    assert (section.size, ds_config["sequence_parallel_size"]) == (4, 4)


@pytest.mark.parametrize(
    ("section", "world", "message"),
    [
        (
            {"size": "auto", "data_parallel_size": 3},
            8,
            r"data_parallel_size=3: 3 does not divide the world size 8",
        ),
        ({"size": "auto", "ulysses_degree": 3}, 8, r"ulysses_degree=3 does not divide size=8"),
    ],
)
def test_auto_size_errors_name_the_world(section, world, message):
    with pytest.raises(SeqParConfigError, match=message):
        parse_section(section, world)


def test_data_parallel_size_must_match_the_world():
    section = parse_section({"size": 4, "data_parallel_size": 3, "ulysses_degree": 1})
    with pytest.raises(
        SeqParConfigError,
        match=r"data_parallel_size=3 x size=4 = 12 ranks, but the world has 8; valid: data_parallel_size=2",
    ):
        section.validate(None, 8)
    section.validate(None, 12)


@pytest.mark.parametrize(
    ("ring", "size", "message"),
    [
        (
            {"schedule": "tasp"},
            4,
            r"domain of 4 ranks .* no Hamiltonian decomposition; valid: ring.inner_size in 2 \(the sizes that "
            r"divide R=4 and have one; nearest to 4: 2\)",
        ),
        (
            {"schedule": "tasp", "inner_size": 6},
            12,
            r"domain of 6 ranks.*valid: ring.inner_size in 2, 3, 12 \(the sizes that divide R=12 and have one; "
            r"nearest to 6: 3\)",
        ),
        (
            {"schedule": "startrail"},
            8,
            r"ring.team_size=None does not suit ring.schedule='startrail'.*valid: 1, 2",
        ),
        ({"schedule": "startrail", "team_size": 4}, 8, r"team_size=4 .*C\^2 must divide R.*valid: 1, 2"),
        (
            {"schedule": "attention2d", "grid": [3, 3]},
            8,
            r"grid=\[3, 3\] .*P_q x P_kv must equal R; valid: \[1, 8\], \[2, 4\]",
        ),
        ({"schedule": "attention2d"}, 4, r"grid=None"),
        ({"team_size": 2}, 8, r"ring.team_size is set but ring.schedule='p2p' ignores it"),
        ({"schedule": "tasp", "grid": [2, 4]}, 8, r"ring.grid is set but ring.schedule='tasp' ignores it"),
        ({"schedule": "startrail", "team_size": 2, "inner_size": 4}, 8, r"inner_size=4 makes a double ring"),
        ({"schedule": "p2p", "startrail_backward": "kv"}, 8, r"startrail_backward is set"),
    ],
)
def test_bad_topology_schedules_name_the_fix(ring, size, message):
    with pytest.raises(SeqParConfigError, match=message):
        parse_section({"size": size, "ulysses_degree": 1, "ring": ring}, size)


def test_sparse_ring_refuses_topology_schedules():
    section = {"size": 8, "ulysses_degree": 1, "attention": "sparse_ring", "ring": {"schedule": "tasp"}}
    with pytest.raises(
        SeqParConfigError, match=r"ring.schedule='tasp' is not built for attention='sparse_ring'"
    ):
        parse_section(section, 8)


def test_tasp_pads_to_its_pieces():
    settings = parse_section({"size": 10, "ulysses_degree": 2, "ring": {"schedule": "tasp"}}, 10).validate()
    assert (
        settings.schedule.pieces(settings.ring_params()) == 4
    )  # R = 5: the whole ring is the domain, 4 cycles
    assert settings.input_layout().multiple == 2 * 5 * 4


def test_resolved_settings_are_frozen_and_every_auto_is_resolved():
    model = {"num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 2048}
    settings = parse_section({"size": 8, "memory": {"tiled_mlp": True}}).validate(model, 8)
    assert (settings.ulysses_degree, settings.ulysses_chunks, settings.memory.mlp_tile_tokens) == (4, 4, 2048)
    assert settings.ranks_per_node in range(1, 9)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.ulysses_degree = 2
    with pytest.raises(ValidationError):
        parse_section({"size": 8}).size = 4  # the section itself is immutable too


def test_config_choices_are_the_registries_names():
    """The names the section accepts (and lists in its errors) are the registries', written once."""
    from ds_seqpar.comm.schedules import SCHEDULES
    from ds_seqpar.layout import LAYOUTS
    from ds_seqpar.ops.attention import KERNELS
    from ds_seqpar.ops.sparse.kernels import SPARSE_KERNELS

    def choices(section: dict) -> list[str]:
        with pytest.raises(SeqParConfigError) as info:
            parse_section(section)
        return str(info.value).split("valid: ", 1)[1].split(", ")

    assert choices({"size": 2, "ring": {"layout": "?"}}) == list(LAYOUTS)
    assert choices({"size": 2, "ring": {"schedule": "?"}}) == list(SCHEDULES)
    assert choices({"size": 2, "kernel": "?"}) == ["auto", *KERNELS]
    assert choices({"size": 2, "attention": "sparse_ring", "sparse": {"kernel": "?"}}) == [
        "auto",
        *SPARSE_KERNELS,
    ]
    for name in (*LAYOUTS, *SCHEDULES, *KERNELS, *SPARSE_KERNELS):
        assert name in (REPO / "docs" / "configuration.md").read_text(), name


def test_tasp_suggests_only_inner_sizes_that_divide_the_ring():
    """R = 8, inner_size = 4 (no Hamiltonian decomposition): every suggested size divides R and has one."""
    import re

    from ds_seqpar.comm.hamiltonian import has_decomposition

    with pytest.raises(SeqParConfigError) as info:
        parse_section({"size": 8, "ulysses_degree": 1, "ring": {"schedule": "tasp", "inner_size": 4}}, 8)
    message = str(info.value)
    listed = re.search(r"valid: ring\.inner_size in ([\d, ]+) \(", message).group(1)
    nearest = re.search(r"nearest to 4: ([\d or]+)\)", message).group(1)
    suggested = [int(x) for x in re.findall(r"\d+", listed + " " + nearest)]
    assert sorted(set(suggested)) == [2, 8], message
    assert all(8 % d == 0 and has_decomposition(d) for d in suggested), message


@pytest.mark.parametrize("value", [0, -1, 0.0])
def test_fault_timeout_must_be_positive_seconds(value):
    with pytest.raises(SeqParConfigError) as info:
        parse_section({"size": 2, "fault_timeout_s": value})
    message = str(info.value)
    assert f"sequence_parallel.fault_timeout_s={value:g} must be > 0 seconds" in message
    assert "e.g. 1800" in message and ">= 0" not in message
    assert parse_section({"size": 2, "fault_timeout_s": 60}).fault_timeout_s == 60.0


# --- DeepSpeed's own keys, next to the section (config/deepspeed_keys.py) -------------------------------

SECTION_4 = {"size": 4, "ulysses_degree": 2}


def test_deepspeed_key_set_comes_from_deepspeed():
    from ds_seqpar.config.deepspeed_keys import (
        EXTRA_TOP_LEVEL_KEYS,
        deepspeed_top_level_keys,
        model_keys,
        zero_config_model,
    )

    top = deepspeed_top_level_keys()
    assert top is not None, "DeepSpeed's _initialize_params could not be probed"
    for key in ("zero_optimization", "bf16", "fp16", "optimizer", "scheduler", "train_micro_batch_size_per_gpu",
                "gradient_clipping", "activation_checkpointing", "autotuning", "wandb", "checkpoint"):  # fmt: skip
        assert key in top, key
    assert set(EXTRA_TOP_LEVEL_KEYS) <= top and "zero_optimisation" not in top
    zero = model_keys(zero_config_model())
    assert {"stage", "offload_param", "stage3_prefetch_bucket_size", "prefetch_bucket_size"} <= set(zero)


def test_misspelt_deepspeed_key_is_refused_with_the_file_and_the_fix(tmp_path):
    raw = {"zero_optimisation": {"stage": 3}, "sequence_parallel": SECTION_4}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    pattern = (
        r"DeepSpeed config '.*ds\.json': 'zero_optimisation' is not a DeepSpeed [\d.]+ config key at the top "
        r"level, so DeepSpeed would ignore it .*did you mean 'zero_optimization'\?"
    )
    with pytest.raises(SeqParConfigError, match=pattern):
        load_config(path)
    with pytest.raises(
        SeqParConfigError, match=r"^the DeepSpeed config dict: 'zero_optimisation' .*'zero_optimization'"
    ):
        load_config(raw)


@pytest.mark.parametrize(
    ("zero", "message"),
    [
        (
            {"stage": 3, "stage3_gather_16bit_weights_on_model_sav": True},
            r"'zero_optimization\.stage3_gather_16bit_weights_on_model_sav' is not a DeepSpeed .* in "
            r"'zero_optimization'.*did you mean 'stage3_gather_16bit_weights_on_model_save'\?",
        ),
        ({"stag": 3}, r"'zero_optimization\.stag' .*did you mean 'stage'\?"),
        (
            {"stage": 3, "offload_param": {"devise": "cpu"}},
            r"'zero_optimization\.offload_param\.devise' .* in 'zero_optimization\.offload_param'.*did you mean 'device'",
        ),
        ({"stage": 3, "reduce_bucket_size_x": "auto"}, r"'zero_optimization\.reduce_bucket_size_x'"),
        (
            {"stage": 3, "mics_shard_size": 8},
            r"'zero_optimization\.mics_shard_size': MiCS .* has been removed",
        ),
    ],
)
def test_unknown_zero_keys_are_refused(zero, message):
    with pytest.raises(SeqParConfigError, match=message):
        load_config({"zero_optimization": zero, "sequence_parallel": SECTION_4})


def test_removed_deepspeed_keys_get_deepspeeds_message():
    with pytest.raises(SeqParConfigError, match=r"'amp': NVIDIA Apex AMP integration has been removed"):
        load_config({"amp": {"enabled": True}, "sequence_parallel": SECTION_4})


def test_hf_auto_values_and_deepspeed_aliases_still_load():
    """An HF Trainer / accelerate style config: "auto" values and ZeRO's stage3_* aliases are accepted."""
    raw = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "none", "nvme_path": None},
            "offload_param": {"device": "none", "nvme_path": None},
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": "auto",
            "sub_group_size": 1e9,
        },
        "steps_per_print": float("inf"),
        "zero_allow_untested_optimizer": True,
        "communication_data_type": "fp32",
        "wall_clock_breakdown": False,
        "sequence_parallel": SECTION_4,
    }
    section, ds = load_config(raw)
    assert section.size == 4 and ds["zero_optimization"]["reduce_bucket_size"] == "auto"


def test_initialize_refuses_a_misspelt_key_before_any_process_group():
    import torch
    import torch.distributed as dist

    import ds_seqpar

    config = {"zero_optimisation": {"stage": 3}, "sequence_parallel": {"size": 1}}
    started = dist.is_initialized()
    with pytest.raises(SeqParConfigError, match=r"did you mean 'zero_optimization'"):
        ds_seqpar.initialize(model=torch.nn.Linear(2, 2), config=config)
    assert dist.is_initialized() == started  # refused before init_distributed and the mesh
