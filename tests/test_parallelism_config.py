"""HF's ``ParallelismConfig`` as a statement of the SP size (integrations/parallelism_config.py): one process.

The accepted forms on 4 gloo ranks (a Trainer script in the form of HF's Ulysses guide, accelerate_prepare)
are in tests/test_examples.py (``test_hf_guide_script_first_loss_equals_initialize``).
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig
from transformers import TrainingArguments

import ds_seqpar
from ds_seqpar import SeqParConfigError
from ds_seqpar.cli import DEFAULT_CONFIG
from ds_seqpar.integrations.parallelism_config import section_with_parallelism

SHIPPED = json.loads(DEFAULT_CONFIG.read_text())
SECTION = SHIPPED["sequence_parallel"]  # size 4, kernel "auto"


def _pc(**kwargs) -> ParallelismConfig:
    return ParallelismConfig(sp_backend="deepspeed", **kwargs)


def _handler(**kwargs) -> DeepSpeedSequenceParallelConfig:
    return DeepSpeedSequenceParallelConfig(**kwargs)


def test_sp_size_states_the_size():
    no_size = {k: v for k, v in SECTION.items() if k != "size"}
    assert section_with_parallelism(no_size, _pc(sp_size=4), 4)["size"] == 4  # absent: taken
    assert (
        section_with_parallelism({**SECTION, "size": "auto"}, _pc(sp_size=2, dp_replicate_size=2), 4)["size"]
        == 2
    )
    assert section_with_parallelism(SECTION, _pc(sp_size=4, dp_replicate_size=1), 4) == SECTION  # equal
    assert (
        section_with_parallelism(SECTION, _pc(sp_size=4, dp_replicate_size=2), 8)["size"] == 4
    )  # dp 2 x sp 4
    assert section_with_parallelism({**SECTION, "size": 2}, _pc(), 4)["size"] == 2  # sp_size 1 states nothing
    assert section_with_parallelism(SECTION, None, 4) is SECTION
    # handler options ds_seqpar honours or that change no number; the guide's attention picks the kernel
    handler = _handler(sp_seq_length=128, sp_disable_in_eval=False, sp_allow_recurrent_layers=True)
    assert section_with_parallelism(SECTION, _pc(sp_size=4, sp_handler=handler), 4)["kernel"] == "auto"
    sdpa = _pc(sp_size=4, sp_handler=_handler(sp_attn_implementation="sdpa"))
    assert section_with_parallelism(SECTION, sdpa, 4)["kernel"] == "sdpa"  # CPU: PyTorch's SDPA kernel
    flash = _pc(sp_size=4, sp_handler=_handler(sp_attn_implementation="flash_attention_2"))
    assert section_with_parallelism({**SECTION, "kernel": "flash_attn"}, flash, 4)["kernel"] == "flash_attn"


def _backend(value: str) -> ParallelismConfig:
    pc = _pc(sp_size=4)
    pc.sp_backend = value  # accelerate's own check runs only when it is constructed
    return pc


REFUSALS = [
    (
        SECTION,
        _pc(sp_size=2),
        4,
        r"ParallelismConfig\(sp_size=2\) and sequence_parallel.size=4 disagree; valid",
    ),
    (SECTION, _backend("megatron"), 4, r"sp_backend='megatron'\): .*valid: sp_backend='deepspeed'"),
    (SECTION, _pc(cp_size=2), 4, r"ParallelismConfig\(cp_size=2\): torch context parallel.*valid: cp_size=1"),
    (SECTION, _pc(tp_size=2), 4, r"ParallelismConfig\(tp_size=2\): tensor parallelism.*valid: tp_size=1"),
    (
        SECTION,
        _pc(sp_size=4, sp_handler=_handler(sp_seq_length_is_variable=False, sp_seq_length=128)),
        4,
        r"sp_seq_length_is_variable=False \(sp_seq_length=128\).*valid: sp_seq_length_is_variable=True",
    ),
    (
        SECTION,
        _pc(sp_size=4, sp_handler=_handler(sp_attn_implementation="flash_attention_3")),
        4,
        r"sp_attn_implementation='flash_attention_3', which ds_seqpar has no kernel for; valid",
    ),
    (
        {**SECTION, "kernel": "torch"},
        _pc(sp_size=4, sp_handler=_handler(sp_attn_implementation="sdpa")),
        4,
        r"sp_attn_implementation='sdpa' \(kernel 'sdpa'\) and sequence_parallel.kernel='torch' disagree",
    ),
    (
        SECTION,
        _pc(sp_size=4, dp_replicate_size=2),
        4,
        r"dp_replicate_size x dp_shard_size = 2, but world 4 / SP",
    ),
    (
        SECTION,
        _pc(sp_size=4),
        8,
        r"dp_shard_size = 1, but world 8 / SP size 4 = 2 .*valid: dp_replicate_size=2",
    ),
    ({**SECTION, "size": "auto"}, _pc(sp_size=4), 6, r"sp_size=4\) does not divide the world size 6"),
    (
        {**SECTION, "enabled": False},
        _pc(sp_size=4),
        4,
        r"sp_size=4\) asks for .* sequence_parallel.enabled is false",
    ),
]


@pytest.mark.parametrize(("section", "pc", "world", "message"), REFUSALS)
def test_what_ds_seqpar_would_not_honour_is_refused_by_name(section, pc, world, message):
    with pytest.raises(SeqParConfigError, match=message):
        section_with_parallelism(section, pc, world)


def _trainer_args(tmp_path, pc) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(tmp_path),
        deepspeed=copy.deepcopy(SHIPPED),
        parallelism_config=pc,
        use_cpu=True,
        report_to=[],
    )


@pytest.mark.parametrize(
    ("pc", "message"),
    [
        (_pc(sp_size=2), r"ParallelismConfig\(sp_size=2\) and sequence_parallel.size=4 disagree"),
        (_pc(cp_size=2), r"ParallelismConfig\(cp_size=2\)"),
        (
            _pc(sp_size=4, sp_handler=_handler(sp_attn_implementation="flash_attention_3")),
            r"'flash_attention_3'",
        ),
    ],
)
def test_trainer_refuses_before_any_collective(tmp_path, pc, message):
    args = _trainer_args(tmp_path, pc)
    with pytest.raises(SeqParConfigError, match=message):
        ds_seqpar.SeqParTrainer(model=None, args=args)
    assert not dist.is_initialized()
    assert args.parallelism_config is pc


def test_trainer_reads_accelerates_launch_settings(tmp_path, monkeypatch):
    """``accelerate launch`` with ``parallelism_config_sp_size: 2`` (PARALLELISM_CONFIG_* variables)."""
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    args = TrainingArguments(
        output_dir=str(tmp_path), deepspeed=copy.deepcopy(SHIPPED), use_cpu=True, report_to=[]
    )
    with pytest.raises(
        SeqParConfigError, match=r"ParallelismConfig\(sp_size=2\) and sequence_parallel.size=4"
    ):
        ds_seqpar.SeqParTrainer(model=None, args=args)


def test_accelerate_prepare_refuses_before_any_collective():
    plugin = SimpleNamespace(hf_ds_config=SimpleNamespace(config=copy.deepcopy(SHIPPED)))
    accelerator = SimpleNamespace(
        state=SimpleNamespace(deepspeed_plugin=plugin), parallelism_config=_pc(sp_size=2)
    )
    with pytest.raises(
        SeqParConfigError, match=r"ParallelismConfig\(sp_size=2\) and sequence_parallel.size=4"
    ):
        ds_seqpar.accelerate_prepare(accelerator, model=None)
    accelerator.parallelism_config = _pc(tp_size=2)
    with pytest.raises(SeqParConfigError, match=r"ParallelismConfig\(tp_size=2\)"):
        ds_seqpar.accelerate_prepare(accelerator, model=None)
    assert not dist.is_initialized()


def test_a_plain_trainer_with_the_section_is_refused_naming_the_fix(tmp_path):
    """What a plain ``transformers.Trainer`` calls when ``train()`` starts DeepSpeed (before any collective)."""
    args = _trainer_args(tmp_path, _pc(sp_size=4))
    with pytest.raises(SeqParConfigError, match=r"valid: ds_seqpar.SeqParTrainer instead of Trainer"):
        args.hf_deepspeed_config.trainer_config_finalize(args, None, 1)


def test_arguments_reused_by_a_second_trainer_resolve_the_same(tmp_path):
    """The first ds_seqpar trainer takes the section out of ``args.hf_deepspeed_config``; a second one on the
    same arguments resolves the user's config again, and the base Trainer never sees
    the ParallelismConfig."""
    from ds_seqpar.integrations.parallelism_config import trainer_parallelism

    config = copy.deepcopy(SHIPPED)
    config["sequence_parallel"]["size"] = "auto"
    pc = _pc(sp_size=1)  # one process: sp_size 1 states nothing, so the section's "auto" takes the world (1)
    args = TrainingArguments(output_dir=str(tmp_path), deepspeed=config, parallelism_config=pc, use_cpu=True)
    with trainer_parallelism(args) as first:
        assert args.parallelism_config is None
    assert args.parallelism_config is pc and first.size == 1
    args.hf_deepspeed_config.config.pop(
        "sequence_parallel"
    )  # what SeqParTrainerMixin does after the base init
    with trainer_parallelism(args) as second:
        assert second == first
