"""SeqParTrainer's reconciliation of the DeepSpeed JSON with TrainingArguments (one process, no ranks)."""

from __future__ import annotations

import copy
import json

import pytest
from transformers import TrainingArguments

from ds_seqpar import SeqParConfigError
from ds_seqpar.cli import DEFAULT_CONFIG
from ds_seqpar.integrations.trainer import reconcile_training_arguments

SHIPPED = json.loads(DEFAULT_CONFIG.read_text())


def _args(tmp_path, config: dict, **kwargs) -> TrainingArguments:
    config = copy.deepcopy(config)
    config["sequence_parallel"]["size"] = 1
    return TrainingArguments(output_dir=str(tmp_path), deepspeed=config, use_cpu=True, report_to=[], **kwargs)


def test_shipped_values_are_adopted_where_the_arguments_are_defaults(tmp_path):
    args = _args(tmp_path, SHIPPED)
    section, ds_config, notices = reconcile_training_arguments(args)
    assert "sequence_parallel" not in args.hf_deepspeed_config.config  # accelerate never sees its "auto"s
    assert section.size == 1 and ds_config["sequence_parallel_size"] == 1
    assert (args.learning_rate, args.adam_beta1, args.adam_beta2, args.per_device_train_batch_size) == (
        1e-4,
        0.9,
        0.95,
        1,
    )
    assert any(
        "learning_rate follows the DeepSpeed config's optimizer.params.lr=0.0001" in n for n in notices
    )
    assert not args.hf_deepspeed_config.mismatches
    again = reconcile_training_arguments(args)  # idempotent: the section is kept on the arguments
    assert again[0] == section and not again[2]


def test_values_set_on_both_sides_and_different_raise(tmp_path):
    args = _args(tmp_path, SHIPPED, learning_rate=3e-4, weight_decay=0.1)
    with pytest.raises(SeqParConfigError) as info:
        reconcile_training_arguments(args)
    message = str(info.value)
    assert (
        "optimizer.params.lr=0.0001 in the DeepSpeed config vs TrainingArguments.learning_rate=0.0003"
        in message
    )
    assert (
        "optimizer.params.weight_decay=0.0 in the DeepSpeed config vs TrainingArguments.weight_decay=0.1"
        in message
    )
    assert 'write "auto" for these keys' in message


def test_auto_takes_the_arguments_and_precision_is_never_adopted(tmp_path):
    config = copy.deepcopy(SHIPPED)
    config["optimizer"]["params"].update(lr="auto", betas="auto")
    args = _args(tmp_path, config, learning_rate=3e-4)
    reconcile_training_arguments(args)
    assert args.hf_deepspeed_config.config["optimizer"]["params"]["lr"] == 3e-4
    config["bf16"] = {"enabled": True}
    with pytest.raises(
        SeqParConfigError,
        match=r"bf16\.enabled=True in the DeepSpeed config vs TrainingArguments\.bf16=False",
    ):
        reconcile_training_arguments(_args(tmp_path, config))


def test_train_batch_size_is_over_dp(tmp_path):
    config = copy.deepcopy(SHIPPED)
    config["train_batch_size"] = 3
    with pytest.raises(
        SeqParConfigError,
        match=r"train_batch_size=3 in the DeepSpeed config vs micro batch 1 x accumulation 1 x dp 1 = 1",
    ):
        reconcile_training_arguments(_args(tmp_path, config))


def test_activation_checkpointing_becomes_the_sections(tmp_path):
    args = _args(tmp_path, SHIPPED, activation_checkpointing=True)
    section, _, notices = reconcile_training_arguments(args)
    assert section.memory.activation_checkpointing and not args.activation_checkpointing
    assert any("runs as sequence_parallel.memory.activation_checkpointing" in n for n in notices)


def test_trl_padding_free_batches_are_documents():
    """TRL's packed (padding-free) rows: position_ids restart per document; cu_seq_lens must agree with them."""
    import torch
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from ds_seqpar.data import _check_packed_boundaries, doc_ids_from_positions, shard_batch

    collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    batch = collator([{"input_ids": list(range(5, 15)), "seq_lengths": [3, 4, 3]}])
    assert torch.equal(
        doc_ids_from_positions(batch["position_ids"]), torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2]])
    )
    _check_packed_boundaries(batch)  # consistent: accepted (and dropped by shard_batch)
    bad = {**batch, "cu_seq_lens_q": torch.tensor([0, 5, 10], dtype=torch.int32)}
    with pytest.raises(ValueError, match=r"cu_seq_lens_q does not match the document starts of position_ids"):
        _check_packed_boundaries(bad)
    with pytest.raises(ValueError, match=r"shard_batch got batch keys \['token_type_ids'\]"):
        shard_batch({**batch, "token_type_ids": torch.zeros_like(batch["input_ids"])}, mesh=None)
