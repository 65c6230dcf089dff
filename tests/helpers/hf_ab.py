"""A/B runs of tiny HF models with and without SP (shared by the HF integration, encoder, hybrid, seq2seq
and schedule tests, and by ``benchmarks/ab_hf.py``): one forward/backward, or DeepSpeed training steps."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import ds_seqpar
from ds_seqpar import SeqParCausalLM, SeqParMaskedLM, SeqParMesh, shard_batch
from ds_seqpar.integrations.hf_model import objective_of
from tests.helpers.hf_models import (
    BERT_DECODERS,
    ENCODER_INPUTS,
    FEATURE_MODELS,
    HYBRID_MODELS,
    KEY_BIAS_MODELS,
    batches,
    reference_loss,
    tiny_model,
)
from tests.helpers.meshes import mesh_for


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    """Relative error; ``floor`` bounds the norm divided by (a BERT key bias has an exactly zero gradient,
    computed as ~1e-11 of rounding noise on both sides)."""
    return ((a - b).norm() / b.norm().clamp(min=floor)).item()


def grad_floor(objective: str, kind: str, ref: torch.nn.Module) -> float:
    """The norm floor of :func:`rel_err` for one model. Masked LMs and BERT-style decoders: 1e-4. Hybrids
    with recurrent layers: 1 % of the whole gradient's norm (benchmarks/model_sweep.py's rule): the decay parameters' gradients (A_log,
    dt_bias) are sums over every token with heavy cancellation, and two float32 chunk algorithms (HF's
    and ds_seqpar's) already differ by ~1e-5 of them in ONE process."""
    if (
        objective == "masked" or kind in BERT_DECODERS or kind in KEY_BIAS_MODELS
    ):  # a key bias, as a decoder too
        return 1e-4
    if kind in HYBRID_MODELS:
        grads = [p.grad.double() for p in ref.parameters() if p.grad is not None]
        return 1e-2 * torch.sqrt(sum((g**2).sum() for g in grads)).item()
    return 1e-30


def sp_mesh(
    u: int,
    layout: str = "zigzag",
    inner: int | None = None,
    schedule: dict | None = None,
    dynamic: bool = False,
) -> SeqParMesh:
    """A mesh over the whole world with Ulysses degree ``u``, ``layout``, the ring keys of ``schedule`` and
    ``dynamic_degree``."""
    ring = {"layout": layout, "inner_size": inner, **(schedule or {})}
    section = {"size": dist.get_world_size(), "ulysses_degree": u, "ring": ring}
    return mesh_for(section | ({"dynamic_degree": True} if dynamic else {}))


def sp_vs_reference(
    kind: str,
    u: int,
    layout: str,
    batch: dict,
    model_overrides: dict | None = None,
    reentrant_checkpointing: bool | None = None,
    schedule: dict | None = None,
    dynamic: bool = False,
) -> dict:
    """One forward/backward of a full batch with and without SP; loss and gradient errors.
    ``reentrant_checkpointing``: None = no activation checkpointing in the SP model, else HF gradient
    checkpointing of every layer with that ``use_reentrant``. ``schedule``: ring keys of the section
    (``{"schedule": "startrail", "team_size": 2}``, with ``inner_size`` for the mesh's double ring);
    ``dynamic``: ``dynamic_degree`` on."""
    schedule = dict(schedule or {})
    mesh = sp_mesh(u, layout, schedule.pop("inner_size", None), schedule, dynamic)
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
    floor = grad_floor(sp.objective, kind, ref)
    worst = 0.0
    for p, p_ref in zip(model.parameters(), ref.parameters(), strict=True):
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad, group=mesh.group("sp"))  # SP ranks hold partial gradients of one sample group
        if p_ref.grad is None:  # not used by the model (a vision tower on text-only input): untouched
            worst = max(worst, grad.abs().max().item())
            continue
        worst = max(worst, rel_err(grad, p_ref.grad, floor))
    return {
        "loss_err": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        "grad_rel_err": worst,
        "finite": bool(torch.isfinite(loss))
        and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None),
    }


def ab_ds_config(sp: int, u: int, stage: int, layout: str = "zigzag", memory: dict | None = None) -> dict:
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
        config=ab_ds_config(sp, u, stage, memory=memory),
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
            for p, p_ref in zip(engine.module.model.parameters(), ref.parameters(), strict=True):
                if not p_ref.requires_grad:
                    continue
                grad = deepspeed.utils.safe_get_full_grad(p)
                if (
                    p_ref.grad is None
                ):  # unused (RoBERTa's lm_head.bias) or untrained (a DSA indexer, no_grad)
                    assert grad is None or not grad.any(), "a gradient where the plain model has none"
                    continue
                floor = grad_floor(engine.module.objective, kind, ref)
                worst = max(worst, rel_err(grad, p_ref.grad, floor))
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
    ("llama4_text", 4, 1, 3),  # chunked attention and the NoPE query temperature on a ring of 4
]
