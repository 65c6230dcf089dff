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


def _compare(dist_pool, tmp_path, model_dir, kind, **kw):
    from transformers import AutoModelForCausalLM

    ref_logs, ref_params = dist_pool(1).run(
        run_post_training, kind, model_dir, str(tmp_path / "ref"), sp=None, **kw
    )[0]
    results = dist_pool(4).run(run_post_training, kind, model_dir, str(tmp_path / "sp"), sp=4, **kw)
    init = [p.detach() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters()]
    for rank, (logs, params) in enumerate(results):
        assert len(logs) == len(ref_logs), (rank, logs, ref_logs)
        for got, ref in zip(logs, ref_logs, strict=True):
            for key, value in ref.items():
                assert abs(got[key] - value) <= LOSS_TOL * max(1.0, abs(value)), (rank, key, got, ref)
        ref_steps = [r - p0 for r, p0 in zip(ref_params, init, strict=True)]
        floor = FLOOR * max(d.norm().item() for d in ref_steps)
        worst = max(
            ((p - p0) - d).norm().item() / max(d.norm().item(), floor)
            for p, p0, d in zip(params, init, ref_steps, strict=True)
        )
        assert worst <= GRAD_TOL, (rank, worst)
    return ref_logs


@pytest.mark.parametrize(
    ("loss_type", "beta", "steps"),
    [("grpo", 0.0, 1), ("dapo", 0.04, 2)],
)
def test_grpo_step_equals_trl_in_one_process(dist_pool, tmp_path, model_dir, loss_type, beta, steps):
    logs = _compare(dist_pool, tmp_path, model_dir, "grpo", loss_type=loss_type, beta=beta, steps=steps)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dr_grpo", "bnpo"])
def test_grpo_other_loss_types_equal_trl(dist_pool, tmp_path, model_dir, loss_type):
    _compare(dist_pool, tmp_path, model_dir, "grpo", loss_type=loss_type, beta=0.04, steps=2)


def test_dpo_steps_equal_trl_in_one_process(dist_pool, tmp_path, model_dir):
    logs = _compare(
        dist_pool, tmp_path, model_dir, "dpo", loss_type="sigmoid", beta=0.5, steps=2, per_device=2
    )
    assert logs[1]["loss"] != logs[0]["loss"]  # the second step's policy differs from the reference model


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
