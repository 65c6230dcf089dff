"""TRL's GRPO and DPO trainers under sequence parallelism equal TRL's own trainer in one process.

``with_sequence_parallel(GRPOTrainer)`` / ``(DPOTrainer)`` on 4 gloo ranks (U 2 x R 2 zigzag, ZeRO-3) against
the plain trainer in a 1-rank group: the same tiny Llama (saved to disk: both load it by path, the reference
model too), the same prompts or pairs, fixed completions (a rollout function), SGD at learning rate 1. The
logged losses match, and so do the parameters after the steps, i.e. the gradients (every GRPO loss type; the
KL term with a reference model over 2 steps; DPO's sigmoid loss over 2 steps). Refusals: every TRL option SP
cannot honour, and TRL trainers without an SP path.
"""

from __future__ import annotations

import pytest
import torch

from ds_seqpar.config import SeqParConfigError
from tests.helpers.post_training import run_post_training, save_tiny_model

LOSS_TOL = 1e-5
GRAD_TOL = 1e-5
# the gradient is read as the parameter change of SGD at learning rate 1; each tensor's error is relative to its
# own change, floored at 1 % of the largest one (the q / k projections' gradients are ~200x smaller than the
# head's, and their float32 sums over the ring's blocks differ from one process's by ~1e-5 of themselves)
FLOOR = 1e-2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


def _compare(dist_pool, tmp_path, model_dir, kind, sp=4, **kw):
    """``sp`` < 4: dp = 4 / sp replicas, each with ``per_device`` samples; the one process takes them all."""
    dp = 4 // sp
    ref_kw = {**kw, "per_device": kw.get("per_device", 4) * dp}
    ref = dist_pool(1).run(run_post_training, kind, model_dir, str(tmp_path / "ref"), sp=None, **ref_kw)[0]
    ref_logs, ref_steps = ref
    results = dist_pool(4).run(run_post_training, kind, model_dir, str(tmp_path / "sp"), sp=sp, **kw)
    floor = FLOOR * max(d.norm().item() for d in ref_steps)
    for rank, (logs, steps) in enumerate(results):
        assert len(logs) == len(ref_logs), (rank, logs, ref_logs)
        for got, want in zip(logs, ref_logs, strict=True):
            for key, value in want.items():
                assert abs(got[key] - value) <= LOSS_TOL * max(1.0, abs(value)), (rank, key, got, want)
        worst = max(
            (s - d).norm().item() / max(d.norm().item(), floor) for s, d in zip(steps, ref_steps, strict=True)
        )
        assert worst <= GRAD_TOL, (rank, worst)
    return ref_logs


@pytest.mark.parametrize(
    ("loss_type", "beta", "steps"),
    [("grpo", 0.0, 1), ("dapo", 0.04, 2)],
)
def test_grpo_step_equals_trl_in_one_process(dist_pool, tmp_path, model_dir, loss_type, beta, steps):
    """The second case also runs TRL's evaluation after training (eval loss and reward compared)."""
    evaluate = beta > 0
    logs = _compare(
        dist_pool, tmp_path, model_dir, "grpo", loss_type=loss_type, beta=beta, steps=steps, evaluate=evaluate
    )
    assert all(torch.isfinite(torch.tensor(h.get("loss", h.get("eval_loss")))) for h in logs), logs
    assert not evaluate or "eval_reward" in logs[-1], logs


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dr_grpo", "bnpo"])
def test_grpo_other_loss_types_equal_trl(dist_pool, tmp_path, model_dir, loss_type):
    _compare(dist_pool, tmp_path, model_dir, "grpo", loss_type=loss_type, beta=0.04, steps=2)


@pytest.mark.parametrize("kind", ["grpo", "dpo"])
def test_dp2_sp2_equals_trl_in_one_process(dist_pool, tmp_path, model_dir, kind):
    """dp 2 x SP 2: prompts (pairs) split over the replicas, rewards gathered over dp, gradients averaged."""
    kw = (
        dict(loss_type="sigmoid", beta=0.5, per_device=2)
        if kind == "dpo"
        else dict(loss_type="grpo", beta=0.04)
    )
    _compare(dist_pool, tmp_path, model_dir, kind, sp=2, steps=2, **kw)


def test_dpo_steps_equal_trl_in_one_process(dist_pool, tmp_path, model_dir):
    logs = _compare(
        dist_pool, tmp_path, model_dir, "dpo", loss_type="sigmoid", beta=0.5, steps=2, per_device=2
    )
    assert logs[1]["loss"] != logs[0]["loss"]  # the second step's policy differs from the reference model


@pytest.mark.parametrize("kind", ["dpo", "grpo"])
def test_lora_reference_is_the_policy_without_adapters(dist_pool, tmp_path, model_dir, kind):
    """A new LoRA adapter under ZeRO-2 (ZeRO-3 with an adapter is refused by name, below)."""
    kw = (
        dict(loss_type="sigmoid", beta=0.5, per_device=2)
        if kind == "dpo"
        else dict(loss_type="bnpo", beta=0.04)
    )
    _compare(dist_pool, tmp_path, model_dir, kind, steps=2, lora=True, stage=2, **kw)


def lora_under_zero3(model_dir: str, out_dir: str) -> str:
    try:
        run_post_training(
            "dpo", model_dir, out_dir, sp=4, stage=3, lora=True, per_device=2, loss_type="sigmoid"
        )
    except SeqParConfigError as exc:
        return str(exc)
    return "trained"


def test_lora_under_zero3_is_refused_by_name(dist_pool, tmp_path, model_dir):
    for message in dist_pool(4).run(lora_under_zero3, model_dir, str(tmp_path)):
        assert "PEFT adapter under ZeRO-3" in message, message


def test_unhonoured_trl_options_are_refused_by_name():
    from trl import DPOConfig, GRPOConfig

    from ds_seqpar.integrations.trl_trainers import REFUSED_OPTIONS, refuse_unhonoured_options

    for trainer, option, honoured, _ in REFUSED_OPTIONS:
        config_cls = GRPOConfig if trainer == "GRPO" else DPOConfig
        args = config_cls(output_dir="unused", report_to=[], use_cpu=True, bf16=False)
        value = {bool: not honoured, float: 0.5}.get(type(honoured), "x")
        object.__setattr__(args, option, value)
        with pytest.raises(SeqParConfigError, match=option):
            refuse_unhonoured_options(trainer, args)


def test_trl_trainers_without_an_sp_path_are_refused_by_name():
    from trl import RLOOTrainer

    import ds_seqpar

    with pytest.raises(SeqParConfigError, match="RLOOTrainer is not supported"):
        ds_seqpar.with_sequence_parallel(RLOOTrainer)
