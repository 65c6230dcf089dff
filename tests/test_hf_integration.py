"""HF models under SP vs the same model without SP: losses and gradients (gloo, float32, tiny models).

Without DeepSpeed (``SeqParCausalLM`` + ``shard_batch``): the sum of the SP ranks' local gradients
equals the non-SP gradient. With DeepSpeed (``ds_seqpar.initialize``, ZeRO-1/2/3, SGD): 5 optimizer
steps match a single-process run step by step, and the first step's gathered gradients match.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import ds_seqpar
from ds_seqpar import SeqParCausalLM, shard_batch
from tests.helpers.hf_ab import AB_CASES, ab_ds_config, deepspeed_ab, sp_mesh, sp_vs_reference
from tests.helpers.hf_models import FEATURE_MODELS, batches, tiny_model

CASES = [
    ("llama", 2, "zigzag", {}),
    ("llama", 1, "stripe", {}),
    ("llama", 4, "contiguous", {}),
    ("mistral", 2, "zigzag", {}),  # sliding window 12 < S
    ("qwen3", 4, "zigzag", {}),  # H=8, H_kv=2, U=4: K/V heads replicated
]


@pytest.mark.parametrize(("kind", "u", "layout", "overrides"), CASES)
def test_forward_backward_equals_non_sp(dist_pool, kind, u, layout, overrides):
    batch = batches(1, 2, 64)[0]
    for rep in dist_pool(4).run(sp_vs_reference, kind, u, layout, batch, overrides):
        assert rep["finite"], rep
        assert rep["loss_err"] <= 1e-5, rep
        assert rep["grad_rel_err"] <= 1e-5, rep


FEATURE_CASES = [(kind, u, layout) for kind in FEATURE_MODELS for u, layout in ((2, "zigzag"), (4, "stripe"))]


@pytest.mark.parametrize(("kind", "u", "layout"), FEATURE_CASES)
def test_post_head_transforms_softcap_and_sinks_equal_non_sp(dist_pool, kind, u, layout):
    """Gemma 2 (attention softcap 1.0, final softcap 1.5), Granite (logits_scaling 4), Cohere (logit_scale
    0.25), gpt-oss (attention sinks): loss and every gradient (sinks included) as without SP."""
    batch = batches(1, 2, 64)[0]
    for rep in dist_pool(4).run(sp_vs_reference, kind, u, layout, batch):
        assert rep["finite"], rep
        assert rep["loss_err"] <= 1e-5, rep
        assert rep["grad_rel_err"] <= 1e-5, rep


def test_multimodal_model_trains_its_language_model_on_text(dist_pool):
    """Gemma 3 (language model under text_config, vision tower never called) on a text-only batch."""
    batch = batches(1, 2, 64)[0]
    for rep in dist_pool(4).run(sp_vs_reference, "gemma3_vlm", 2, "zigzag", batch):
        assert rep["finite"], rep
        assert rep["loss_err"] <= 1e-5 and rep["grad_rel_err"] <= 1e-5, rep


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_with_pipelined_ulysses(dist_pool, reentrant):
    """Layers recomputed in backward re-run the pipelined exchange (H=8, H_kv=2, U=4: 2 head groups)."""
    batch = batches(1, 2, 64)[0]
    for rep in dist_pool(4).run(sp_vs_reference, "qwen3", 4, "zigzag", batch, None, reentrant):
        assert rep["finite"], rep
        assert rep["loss_err"] <= 1e-5, rep
        assert rep["grad_rel_err"] <= 1e-5, rep


def test_odd_length_is_padded_and_exact(dist_pool):
    batch = batches(1, 1, 53)[0]  # not a multiple of 2R = 4 or R*U
    for rep in dist_pool(4).run(sp_vs_reference, "llama", 2, "zigzag", batch):
        assert rep["loss_err"] <= 1e-5 and rep["grad_rel_err"] <= 1e-5, rep


def test_shard_that_is_all_padding_gives_finite_exact_results(dist_pool):
    """Only the first 9 of 64 tokens are real: with contiguous layout ranks 1-3 hold padding only."""
    batch = batches(1, 1, 64)[0]
    batch["attention_mask"] = torch.zeros(1, 64, dtype=torch.long)
    batch["attention_mask"][:, :9] = 1
    for rep in dist_pool(4).run(sp_vs_reference, "llama", 1, "contiguous", batch):
        assert rep["finite"], rep
        assert rep["loss_err"] <= 1e-5 and rep["grad_rel_err"] <= 1e-5, rep


@pytest.mark.parametrize(
    ("layout", "u", "lengths", "dynamic"),
    [
        ("zigzag", 2, [21, 30, 13], False),
        ("documents", 1, [21, 30, 13], False),  # ring.layout='documents': shard_batch and attention alike
        ("documents", 2, [3, 40, 5, 9, 7], False),
        ("documents", 1, [8] * 8, False),  # every document whole on one rank: the ring sends nothing
        ("documents", 2, [8] * 8, True),  # dynamic_degree: p = 1, no all-to-all either
        ("documents", 2, [24, 8, 24, 8], True),  # dynamic_degree: rings of 2 ranks
        ("documents", 2, [3, 40, 5, 9, 7], True),  # dynamic_degree: the whole group
    ],
)
def test_packed_batch_of_documents(dist_pool, layout, u, lengths, dynamic):
    """position_ids restart per document: attention must not cross documents."""
    batch = batches(1, 1, 64)[0]
    batch["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None]
    for rep in dist_pool(4).run(sp_vs_reference, "llama", u, layout, batch, dynamic=dynamic):
        assert rep["loss_err"] <= 1e-5 and rep["grad_rel_err"] <= 1e-5, rep


def shard_padding_case() -> dict:
    mesh = sp_mesh(1, "contiguous")
    batch = {"input_ids": torch.arange(10)[None], "labels": torch.arange(10)[None] + 100}
    return shard_batch(batch, mesh)


def test_shard_batch_pads_and_preshifts(dist_pool):
    shards = dist_pool(4).run(shard_padding_case)
    # 10 tokens padded to 12 over 4 contiguous ranks; label of token t is label t+1 (pre-shifted)
    ids = torch.cat([s["input_ids"] for s in shards], dim=1)
    labels = torch.cat([s["shift_labels"] for s in shards], dim=1)
    pos = torch.cat([s["position_ids"] for s in shards], dim=1)
    assert ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0]]
    assert labels.tolist() == [[101, 102, 103, 104, 105, 106, 107, 108, 109, -100, -100, -100]]
    assert pos.tolist() == [list(range(12))]
    assert shards[1]["shift_labels"].tolist() == [[104, 105, 106]]  # boundary label kept across shards


def no_context_error() -> str:
    model = ds_seqpar.enable_sequence_parallel(tiny_model("llama"))
    try:
        model(torch.zeros(1, 8, dtype=torch.long))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_attention_without_context_is_an_error():
    assert "called the 'ds_seqpar' attention without a ds_seqpar context" in no_context_error()


def test_non_hf_model_is_rejected_with_its_class():
    with pytest.raises(TypeError, match=r"Linear is not a HuggingFace PreTrainedModel"):
        ds_seqpar.enable_sequence_parallel(torch.nn.Linear(2, 2))


# --------------------------------------------------------------------------------------------
# DeepSpeed A/B: ds_seqpar.initialize + ZeRO vs a single process without SP


@pytest.mark.parametrize(("kind", "sp", "u", "stage"), AB_CASES)
def test_deepspeed_training_matches_non_sp(dist_pool, kind, sp, u, stage):
    per_rank = dist_pool(4).run(deepspeed_ab, kind, sp, u, stage, 5, 64, 0.5)
    for rep in per_rank:
        assert max(rep["loss_errs"]) <= 1e-5, rep
        assert rep["grad_err"] <= 1e-5, rep


ALL_SAVINGS = {
    "activation_checkpointing": True,
    "offload": True,
    "tiled_mlp": True,
    "tiled_norms": True,
    "mlp_tile_tokens": 5,  # 16 local tokens: tiles of 3-4 tokens
}
MEMORY_AB_CASES = [
    ("llama", 4, 2, 3),  # U 2 x R 2, ZeRO-3
    ("qwen3_moe", 4, 2, 3),  # MoE block tiled
    ("qwen3", 4, 4, 3),  # pipelined Ulysses re-run in backward
    ("llama", 2, 1, 3),  # dp 2 x sp 2: tile counts agreed over the ZeRO group
]


@pytest.mark.parametrize(("kind", "sp", "u", "stage"), MEMORY_AB_CASES)
def test_memory_savings_under_zero3_match_non_sp(dist_pool, kind, sp, u, stage):
    """Checkpointing + offload + tiled MLP and norms: 5 ZeRO-3 steps equal the non-SP model."""
    for rep in dist_pool(4).run(deepspeed_ab, kind, sp, u, stage, 5, 64, 0.5, False, ALL_SAVINGS):
        assert max(rep["loss_errs"]) <= 1e-5, rep
        assert rep["grad_err"] <= 1e-5, rep


def test_lora_training_under_zero3_matches_plain_lora(dist_pool):
    """A PEFT LoRA model (not a PreTrainedModel itself) under SP 4 (U 2 x R 2) and ZeRO-3: 5 steps."""
    for rep in dist_pool(4).run(deepspeed_ab, "llama", 4, 2, 3, 5, 64, 0.5, True):
        assert max(rep["loss_errs"]) <= 1e-5, rep
        assert rep["grad_err"] <= 1e-5, rep


# --------------------------------------------------------------------------------------------
# HF Trainer: SeqParTrainer (dp=1, sp=4, U=2 x R=2) vs a plain Trainer in one process


class _Samples(torch.utils.data.Dataset):
    def __init__(self, n: int, seq_len: int) -> None:
        self.items = [b["input_ids"][0] for b in batches(n, 1, seq_len, seed=9)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.items[i], "labels": self.items[i]}


def trainer_losses(use_sp: bool, out_dir: str, steps: int) -> list[float]:
    from transformers import Trainer, TrainingArguments

    common = dict(
        output_dir=out_dir,
        per_device_train_batch_size=1,
        max_steps=steps,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_drop_last=True,
    )
    model = tiny_model("llama")
    data = _Samples(steps, 64)
    if use_sp:
        config = ab_ds_config(4, 2, 3)
        config["gradient_clipping"] = 1.0
        del config["zero_allow_untested_optimizer"]
        args = TrainingArguments(deepspeed=config, max_grad_norm=1.0, **common)
        trainer = ds_seqpar.SeqParTrainer(model=model, args=args, train_dataset=data)
    else:
        args = TrainingArguments(max_grad_norm=1.0, **common)
        trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if use_sp:  # every step ran under StepWatch: the store holds this rank's last step
        store = dist.distributed_c10d._get_default_store()
        losses.append(float(store.get(f"ds_seqpar/watch/beat/{dist.get_rank()}").decode()))
    return losses


def test_trainer_with_sp_matches_trainer_without(dist_pool, tmp_path):
    reference = dist_pool(1).run(trainer_losses, False, str(tmp_path / "ref"), 5)[0]
    with_sp = dist_pool(4).run(trainer_losses, True, str(tmp_path / "sp"), 5)
    assert len(reference) == 5
    for losses in with_sp:
        assert losses.pop() == 5  # the StepWatch beat of the last step
        assert len(losses) == 5
        for a, b in zip(losses, reference):
            assert abs(a - b) <= 1e-4 * abs(b), (losses, reference)


def plain_deepspeed_with_section() -> str:
    import deepspeed

    try:
        deepspeed.initialize(model=torch.nn.Linear(2, 2), config=ab_ds_config(2, 1, 1))
    except ds_seqpar.SeqParConfigError as exc:
        return str(exc)
    return "trained without SP"


def test_plain_deepspeed_initialize_refuses_the_section(dist_pool):
    for message in dist_pool(2).run(plain_deepspeed_with_section):
        assert "call ds_seqpar.initialize(model=..., config=...) instead" in message


def unroutable_model_error() -> str:
    """A model whose second layer computes attention without the interface must be refused."""
    mesh = sp_mesh(1)
    model = tiny_model("llama")
    layer = model.model.layers[1].self_attn
    layer.forward = lambda hidden_states, *a, **k: (hidden_states, None)  # bypasses the interface
    lm = SeqParCausalLM(model, mesh)
    try:
        lm(**shard_batch(batches(1, 1, 16)[0], mesh))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_model_that_bypasses_the_attention_interface_is_named(dist_pool):
    message = dist_pool(1).run(unroutable_model_error)[0]
    assert (
        "LlamaForCausalLM (original attn_implementation='sdpa') called the ds_seqpar attention 1 times for 2 layers"
        in message
    )


def test_disable_restores_the_original_attention():
    model = ds_seqpar.enable_sequence_parallel(tiny_model("llama"))
    assert model.config._attn_implementation == "ds_seqpar"
    ds_seqpar.disable_sequence_parallel(model)
    assert model.config._attn_implementation == "sdpa"
    assert model(torch.zeros(1, 8, dtype=torch.long)).logits.shape == (1, 8, 96)  # runs without SP again


def eval_sp_vs_reference(lengths: list[int]) -> list[dict]:
    """SeqParCausalLM.evaluate (no gradients, SP on) vs the unpadded single-process model, per length."""
    mesh = sp_mesh(2, "zigzag")
    model = tiny_model("llama")
    sp = SeqParCausalLM(copy.deepcopy(model), mesh)
    out = []
    for length in lengths:
        batch = batches(1, 1, length, seed=length)[0]
        ids = batch["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        targets = ids[0, 1:]
        ref_loss = torch.nn.functional.cross_entropy(logits, targets).item()
        ref_correct = int((logits.argmax(-1) == targets).sum())
        got = sp.evaluate(**shard_batch(batch, mesh))
        out.append(
            {
                "length": length,
                "loss_err": abs(got["loss"].item() - ref_loss) / ref_loss,
                "correct": (int(got["correct"]), ref_correct),
                "count": (int(got["count"]), length - 1),
            }
        )
    return out


def test_evaluation_under_sp_matches_non_sp_at_any_length(dist_pool):
    """Lengths that no layout divides (padded by shard_batch, padding masked) give the unpadded results."""
    for per_rank in dist_pool(4).run(eval_sp_vs_reference, [17, 53, 64, 101]):
        for rep in per_rank:
            assert rep["loss_err"] <= 1e-5, rep
            assert rep["correct"][0] == rep["correct"][1] and rep["count"][0] == rep["count"][1], rep


# --------------------------------------------------------------------------------------------
# SeqParTrainer's sharded evaluation (ds_seqpar/integrations/trainer_eval.py) vs one process


def _check_eval(report: dict, evaluations: int = 1) -> None:
    for metrics in (report["before"], *report["during"]):
        for prefix, ref in report["refs"].items():
            assert abs(metrics[f"{prefix}_loss"] - ref["loss"]) <= 1e-6 * ref["loss"], (prefix, metrics, ref)
            assert abs(metrics[f"{prefix}_accuracy"] - ref["accuracy"]) < 1e-12, (prefix, metrics, ref)
            assert metrics.get(f"{prefix}_runtime", 1.0) >= 0.0
    assert len(report["during"]) == evaluations  # eval_steps=1, max_steps=1


@pytest.mark.parametrize(
    ("kind", "sp", "u", "stage", "layout"),
    [("llama", 4, 2, 3, "zigzag"), ("gemma2", 4, 1, 1, "stripe"), ("llama", 2, 2, 3, "zigzag")],
)
def test_trainer_evaluation_equals_one_process(dist_pool, tmp_path, kind, sp, u, stage, layout):
    """U x R mesh under ZeRO-3, a pure ring (Gemma 2: soft-caps, sliding window), dp=2 x SP=2 (filler batch,
    a collator without labels): evaluate() and eval_strategy='steps' equal the one-process evaluation."""
    from tests.helpers.trainer_eval import trainer_eval_case

    for report in dist_pool(4).run(trainer_eval_case, kind, sp, u, stage, layout, str(tmp_path)):
        _check_eval(report)


def test_trl_sft_trainer_evaluation_equals_one_process(dist_pool, tmp_path):
    """with_sequence_parallel(SFTTrainer), packed eval rows prepared by TRL: evaluate() equals one process."""
    from tests.helpers.trainer_eval import sft_eval_case

    for report in dist_pool(4).run(sft_eval_case, str(tmp_path)):
        assert report["rows"] >= 2
        _check_eval(report, evaluations=0)


def test_masked_lm_trainer_evaluation_equals_one_process(dist_pool, tmp_path):
    """SeqParTrainer on a ModernBERT masked LM (U2 x R2): eval_loss / eval_accuracy over the masked tokens."""
    from tests.helpers.trainer_eval import masked_trainer_eval_case

    for report in dist_pool(4).run(masked_trainer_eval_case, str(tmp_path)):
        _check_eval(report, evaluations=0)
