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
    assert {"cu_seq_lens_q", "max_length_q", "seq_idx"} <= set(batch)
    for key, value in (
        ("cu_seq_lens_q", torch.tensor([0, 5, 10], dtype=torch.int32)),
        ("max_length_k", 3),
        ("seq_idx", torch.zeros(1, 10, dtype=torch.int32)),
    ):
        with pytest.raises(ValueError, match=rf"{key} does not match the documents of position_ids"):
            _check_packed_boundaries({**batch, key: value})
    two_rows = {**batch, "position_ids": batch["position_ids"].expand(2, -1)}
    with pytest.raises(ValueError, match=r"describe one packed row, but position_ids has shape \(2, 10\)"):
        _check_packed_boundaries(two_rows)
    with pytest.raises(ValueError, match=r"shard_batch got batch keys \['token_type_ids'\]"):
        shard_batch({**batch, "token_type_ids": torch.zeros_like(batch["input_ids"])}, mesh=None)


def test_auto_keys_are_refilled_after_adoption(tmp_path):
    """ "train_batch_size": "auto" and an "auto" warmup_max_lr next to an explicit lr: both follow."""
    config = copy.deepcopy(SHIPPED)
    config["train_batch_size"] = "auto"
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": 1}}
    args = _args(tmp_path, config)
    reconcile_training_arguments(args)
    hf = args.hf_deepspeed_config.config
    assert "train_batch_size" not in hf  # ds_seqpar sets it over dp when DeepSpeed starts
    assert args.learning_rate == 1e-4 and hf["scheduler"]["params"]["warmup_max_lr"] == 1e-4


def test_unhonoured_trainer_arguments_raise_by_name(tmp_path):
    from ds_seqpar.integrations.trainer import _refuse_unhonoured_arguments

    args = _args(
        tmp_path, SHIPPED, train_sampling_strategy="group_by_length", eval_strategy="steps", eval_steps=1
    )
    with pytest.raises(SeqParConfigError, match=r"train_sampling_strategy='group_by_length' "):
        _refuse_unhonoured_arguments(args, eval_dataset=[0])
    _refuse_unhonoured_arguments(
        _args(tmp_path, SHIPPED, eval_strategy="steps", eval_steps=1), eval_dataset=[0]
    )


def _eval_trainer(tmp_path, **kwargs):
    """The attributes sharded evaluation reads, on a stand-in for a SeqParTrainer (dp = 2)."""
    from types import SimpleNamespace

    hooks = {k: kwargs.pop(k, None) for k in ("compute_metrics", "preprocess_logits_for_metrics")}
    return SimpleNamespace(
        args=_args(tmp_path, SHIPPED, **kwargs),
        eval_dataset=None,
        seqpar_mesh=SimpleNamespace(dp_size=2),
        **hooks,
    )


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        (
            {"compute_metrics": len},
            r"compute_metrics=<built-in function len> \(it takes the logits \[N, S, V\]",
        ),
        ({"preprocess_logits_for_metrics": len}, r"preprocess_logits_for_metrics=<built-in function len>"),
        ({"include_for_metrics": ["inputs"]}, r"include_for_metrics=\['inputs'\] \(only compute_metrics"),
        (
            {"bf16_full_eval": True},
            r"bf16_full_eval=True \(evaluation runs at the DeepSpeed config's precision",
        ),
    ],
)
def test_unhonoured_evaluation_settings_raise_by_name(tmp_path, kwargs, named):
    from ds_seqpar.integrations.trainer_eval import refuse_unhonoured_evaluation

    with pytest.raises(SeqParConfigError, match=named):
        refuse_unhonoured_evaluation(_eval_trainer(tmp_path, **kwargs))
    refuse_unhonoured_evaluation(
        _eval_trainer(tmp_path, eval_accumulation_steps=2, prediction_loss_only=False)
    )


def test_evaluation_sets_predict_and_foreign_loaders_are_refused(tmp_path):
    from ds_seqpar.integrations.trainer_eval import SeqParEvaluationMixin as Eval

    trainer = _eval_trainer(tmp_path, dataloader_drop_last=True, per_device_eval_batch_size=2)
    with pytest.raises(
        SeqParConfigError, match=r"dataloader_drop_last=True with an eval set of 5 samples, not a multiple"
    ):
        Eval.get_eval_dataloader(trainer, list(range(5)))
    with pytest.raises(SeqParConfigError, match=r"eval_dataset generator has no length"):
        Eval.get_eval_dataloader(trainer, (i for i in range(5)))
    with pytest.raises(
        SeqParConfigError, match=r"predict\(\) returns the logits \[N, S, V\] of every sample"
    ):
        Eval.predict(trainer, [0])
    with pytest.raises(
        SeqParConfigError, match=r"evaluation_loop got a list; .* predict\(\) is not supported"
    ):
        Eval.evaluation_loop(trainer, [], "Prediction")


def test_a_failed_step_keeps_the_traceback_of_a_bug():
    from ds_seqpar.comm.step_watch import StepFailed
    from ds_seqpar.user_errors import format_report

    def bug():
        raise KeyError("lost")

    try:
        try:
            bug()
        except KeyError as exc:
            raise StepFailed("step 3 failed on rank 1 (KeyError: 'lost')") from exc
    except StepFailed as failed:
        text = format_report(failed)
    assert (
        "Traceback" in text
        and "in bug" in text
        and text.splitlines()[-2].startswith("ds_seqpar: error (StepFailed)")
    )
    user = StepFailed("step 1 failed on rank 0")
    user.__cause__ = SeqParConfigError("sequence_parallel.size=3 ...")
    assert "Traceback" not in format_report(user)


def test_the_report_lock_is_per_launch_attempt(monkeypatch):
    from ds_seqpar.user_errors import _job_key

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = _job_key()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert _job_key() != first  # a torchrun restart reports its own error again


def test_the_report_lock_outlives_the_reporting_rank(monkeypatch, tmp_path):
    """A slow rank that reaches the report after the first one has exited still finds the lock; the
    machine's last rank removes it."""
    import os
    from pathlib import Path

    from ds_seqpar import user_errors

    monkeypatch.setattr(user_errors.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "4")
    gone = tmp_path / f"{user_errors.LOCK_PREFIX}999999999-12345-29500--"
    alive = tmp_path / f"{user_errors.LOCK_PREFIX}{os.getpid()}-{user_errors._started(os.getpid())}-1--"
    other = tmp_path / "unrelated-file"
    for path in (gone, alive, other):
        path.write_bytes(b"")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert user_errors._claim_report()  # the first rank reports
    assert not gone.exists() and alive.exists() and other.exists()  # a gone launcher's lock is swept
    lock = Path(user_errors._lock_path())
    assert not user_errors._claim_report()  # a late rank of the same job stays quiet, however late
    assert lock.exists()
    assert not user_errors._claim_report()  # the machine's last rank removes the lock
    assert not lock.exists()


def test_a_universal_conversion_older_than_its_checkpoint_is_stale(tmp_path):
    import os

    from ds_seqpar.checkpoint_resume import _conversion_is_current

    source, target = tmp_path / "step2", tmp_path / "step2_universal"
    (source).mkdir()
    (target / "zero").mkdir(parents=True)
    (source / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (target / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (target / "zero" / "optimizer_state.pt").write_bytes(b"x")
    os.utime(source / "mp_rank_00_model_states.pt", (1000, 1000))
    assert _conversion_is_current(source, target)
    os.utime(source / "mp_rank_00_model_states.pt", None)  # saved again after the conversion
    os.utime(target / "zero" / "optimizer_state.pt", (1000, 1000))
    assert not _conversion_is_current(source, target)
