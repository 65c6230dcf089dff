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
from ds_seqpar import SeqParCausalLM, SeqParMaskedLM, SeqParMesh, SequenceParallelConfig, shard_batch
from ds_seqpar.integrations.hf_model import objective_of
from tests.hf_models import ENCODER_INPUTS, FEATURE_MODELS, HYBRID_MODELS, batches, reference_loss, tiny_model


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    """Relative error; ``floor`` bounds the norm divided by (a BERT key bias has an exactly zero gradient,
    computed as ~1e-11 of rounding noise on both sides)."""
    return ((a - b).norm() / b.norm().clamp(min=floor)).item()


def _floor(objective: str, kind: str, ref: torch.nn.Module) -> float:
    """The norm floor of :func:`_rel` for one model. Masked LMs: 1e-4. Hybrids with recurrent layers: 1 % of
    the whole gradient's norm (benchmarks/model_sweep.py's rule): the decay parameters' gradients (A_log,
    dt_bias) are sums over every token with heavy cancellation, and two float32 chunk algorithms (HF's
    and ds_seqpar's) already differ by ~1e-5 of them in ONE process."""
    if objective == "masked":
        return 1e-4
    if kind in HYBRID_MODELS:
        grads = [p.grad.double() for p in ref.parameters() if p.grad is not None]
        return 1e-2 * torch.sqrt(sum((g**2).sum() for g in grads)).item()
    return 1e-30


def _mesh(
    u: int, layout: str = "zigzag", inner: int | None = None, schedule: dict | None = None
) -> SeqParMesh:
    world = dist.get_world_size()
    mesh = SeqParMesh.build(world, u, inner)
    mesh.config = SequenceParallelConfig(
        size=world, ulysses_degree=u, ring={"layout": layout, "inner_size": inner, **(schedule or {})}
    ).validate(None, world)
    return mesh


def sp_vs_reference(
    kind: str,
    u: int,
    layout: str,
    batch: dict,
    model_overrides: dict | None = None,
    reentrant_checkpointing: bool | None = None,
    schedule: dict | None = None,
) -> dict:
    """One forward/backward of a full batch with and without SP; loss and gradient errors.
    ``reentrant_checkpointing``: None = no activation checkpointing in the SP model, else HF gradient
    checkpointing of every layer with that ``use_reentrant``. ``schedule``: ring keys of the section
    (``{"schedule": "startrail", "team_size": 2}``, with ``inner_size`` for the mesh's double ring)."""
    schedule = dict(schedule or {})
    mesh = _mesh(u, layout, schedule.pop("inner_size", None), schedule)
    ref = tiny_model(kind, **(model_overrides or {}))
    model = copy.deepcopy(ref)
    ref_loss = reference_loss(ref, batch)
    ref_loss.backward()
    if reentrant_checkpointing is not None:
        model.train()
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant_checkpointing}
        )
    sp = (SeqParMaskedLM if objective_of(model) == "masked" else SeqParCausalLM)(model, mesh)
    shard = shard_batch(batch, mesh, objective=sp.objective)
    loss = sp(**shard)
    loss.backward()
    floor = _floor(sp.objective, kind, ref)
    worst = 0.0
    for p, p_ref in zip(model.parameters(), ref.parameters()):
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad, group=mesh.group("sp"))  # SP ranks hold partial gradients of one sample group
        if p_ref.grad is None:  # not used by the model (a vision tower on text-only input): untouched
            worst = max(worst, grad.abs().max().item())
            continue
        worst = max(worst, _rel(grad, p_ref.grad, floor))
    return {
        "loss_err": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        "grad_rel_err": worst,
        "finite": bool(torch.isfinite(loss))
        and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None),
    }


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


def test_packed_batch_of_three_documents(dist_pool):
    """position_ids restart per document: attention must not cross documents."""
    batch = batches(1, 1, 64)[0]
    lengths = [21, 30, 13]
    batch["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None]
    for rep in dist_pool(4).run(sp_vs_reference, "llama", 2, "zigzag", batch):
        assert rep["loss_err"] <= 1e-5 and rep["grad_rel_err"] <= 1e-5, rep


def shard_padding_case() -> dict:
    mesh = _mesh(1, "contiguous")
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


def _ds_config(sp: int, u: int, stage: int, layout: str = "zigzag", memory: dict | None = None) -> dict:
    section = {"size": sp, "ulysses_degree": u, "ring": {"layout": layout}}
    if memory:
        section["memory"] = memory
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "sequence_parallel": section,
    }


def lora_model(kind: str) -> torch.nn.Module:
    """A PEFT LoRA wrapper (rank 4 on q/k/v/o, B drawn non-zero so every LoRA weight has a gradient)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_model(kind),
        LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
        ),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    return model


def deepspeed_ab(
    kind: str,
    sp: int,
    u: int,
    stage: int,
    steps: int,
    seq_len: int,
    lr: float,
    lora: bool = False,
    memory: dict | None = None,
    data: list[dict] | None = None,
) -> dict:
    """Train ``steps`` SGD steps with ds_seqpar.initialize and in-process without SP; compare.
    ``lora``: both sides are the PEFT LoRA wrapper of the model (only the adapters train);
    ``memory``: the ``sequence_parallel.memory`` section of the SP side; ``data``: ``steps * dp`` full
    batches (default: random tokens of ``seq_len``)."""
    import deepspeed

    world = dist.get_world_size()
    dp = world // sp
    ref = lora_model(kind) if lora else tiny_model(kind)
    model = copy.deepcopy(ref)
    data = data or batches(steps * dp, 1, seq_len, seed=5)  # step s, dp group g reads sample s*dp + g
    trained = [p for p in ref.parameters() if p.requires_grad]
    ref_opt = torch.optim.SGD(trained, lr=lr)
    engine, _, _, _ = ds_seqpar.initialize(
        model=model,
        config=_ds_config(sp, u, stage, memory=memory),
        optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr),
    )
    mesh = engine.seqpar_mesh
    loss_errs, grad_err = [], None
    for step in range(steps):
        # reference: mean over the dp groups of each group's token-mean loss
        ref_opt.zero_grad()
        ref_losses = [reference_loss(ref, data[step * dp + g]) for g in range(dp)]
        ref_total = torch.stack(ref_losses).mean()
        ref_total.backward()
        batch = dict(data[step * dp + mesh.coords.dp_rank])
        encoder_inputs = {k: batch.pop(k) for k in ENCODER_INPUTS if k in batch}  # full, every rank the same
        shard = shard_batch(batch, mesh, objective=engine.module.objective)
        loss = engine(**shard, **encoder_inputs)
        engine.backward(loss)
        if step == 0:
            worst = 0.0
            for p, p_ref in zip(engine.module.model.parameters(), ref.parameters()):
                if not p_ref.requires_grad:
                    continue
                grad = deepspeed.utils.safe_get_full_grad(p)
                floor = _floor(engine.module.objective, kind, ref)
                worst = max(worst, _rel(grad, p_ref.grad, floor))
            grad_err = worst
        engine.step()
        ref_opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world  # every SP rank of a group reports its group's loss
        loss_errs.append(abs(mean_loss.item() - ref_total.item()) / abs(ref_total.item()))
    return {"loss_errs": loss_errs, "grad_err": grad_err}


AB_CASES = [
    # (model, sp, U, ZeRO stage): dp = 4 / sp
    ("llama", 4, 2, 3),  # dp 1 x (U 2 x R 2), zigzag
    ("llama", 2, 1, 3),  # dp 2 x sp 2
    ("mistral", 4, 2, 3),  # sliding window 12 < S
    ("qwen3", 4, 4, 3),  # H=8, H_kv=2, U=4
    ("llama", 4, 2, 1),
    ("llama", 2, 2, 2),
    # attention softcap + final softcap, logit divisor, logit scale, attention sinks (+ MoE)
    *((kind, 4, 2, 3) for kind in FEATURE_MODELS),
]


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
        config = _ds_config(4, 2, 3)
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
        deepspeed.initialize(model=torch.nn.Linear(2, 2), config=_ds_config(2, 1, 1))
    except ds_seqpar.SeqParConfigError as exc:
        return str(exc)
    return "trained without SP"


def test_plain_deepspeed_initialize_refuses_the_section(dist_pool):
    for message in dist_pool(2).run(plain_deepspeed_with_section):
        assert "call ds_seqpar.initialize(model=..., config=...) instead" in message


def unroutable_model_error() -> str:
    """A model whose second layer computes attention without the interface must be refused."""
    mesh = _mesh(1)
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
    mesh = _mesh(2, "zigzag")
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
