"""A/B runs of tiny VLMs with and without SP (tests/test_vlm.py, benchmarks/model_sweep.py's multimodal part):
one forward/backward of ``SeqParVisionLM``, or DeepSpeed steps under ZeRO-3, against the plain model."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import ds_seqpar
from ds_seqpar import SeqParVisionLM, shard_batch
from ds_seqpar.settings import input_layout
from tests.helpers.hf_ab import ab_ds_config, rel_err, sp_mesh
from tests.helpers.hf_models import tiny_model
from tests.helpers.vlm_models import tiny_vlm, token_ids, vlm_batch

TEXT_KEYS = ("input_ids", "labels", "position_ids", "attention_mask")
TOKEN_KEYS = ("mm_token_type_ids", "token_type_ids")  # per-token vision inputs: packed along the row


def part_of(name: str) -> str:
    """The part of a VLM a parameter belongs to: ``language`` (decoder and head), ``vision`` (the tower) or
    ``projector`` (what maps the tower's features into the language model)."""
    if "language_model" in name or name.startswith("lm_head"):
        return "language"
    if any(t in name for t in ("visual.", "vision_tower.", "vision_model.")) and "merger" not in name:
        return "vision"
    return "projector"


def grad_err(name: str, grad: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative gradient error; a key projection's bias has a zero gradient in exact arithmetic (a softmax does
    not change when every score of a row moves by the same amount), so both sides hold rounding noise: its
    error is measured against a floor of 1e-3."""
    return rel_err(grad, ref, 1e-3 if name.endswith(("k_proj.bias", "key.bias")) else 1e-30)


def packed_batch(
    model: torch.nn.Module, kind: str, spec: list[list], seed: int = 0
) -> tuple[dict, list[dict]]:
    """One packed row of the documents of ``spec`` (one document per entry), and the documents alone.
    Labels of every document's first token are -100 (no target crosses a document border)."""
    docs = [vlm_batch(model, kind, [row], seed=seed + i) for i, row in enumerate(spec)]
    packed: dict = {}
    for key in docs[0]:
        parts = [d[key] for d in docs if key in d]
        dim = 1 if key in ("input_ids", "labels", *TOKEN_KEYS) else 0
        packed[key] = torch.cat(parts, dim=dim)
    for key in {k for d in docs for k in d} - set(packed):
        packed[key] = torch.cat([d[key] for d in docs if key in d])
    packed["position_ids"] = torch.cat([torch.arange(d["input_ids"].shape[1]) for d in docs])[None]
    starts = torch.cumsum(torch.tensor([0] + [d["input_ids"].shape[1] for d in docs[:-1]]), 0)
    packed["labels"] = packed["labels"].clone()
    packed["labels"][0, starts] = -100
    return packed, docs


def split_runs(model: torch.nn.Module, ids: torch.Tensor, mesh) -> int:
    """How many runs of image / video placeholder tokens lie on more than one rank's shard."""
    image, video, _, _ = token_ids(model)
    layout = input_layout(mesh)
    seq_len = -(-ids.shape[1] // layout.multiple) * layout.multiple
    owner = torch.empty(seq_len, dtype=torch.long)
    for r in range(mesh.sp_size):
        owner[layout.local_positions(seq_len, r)] = r
    visual = ((ids[0] == image) | (ids[0] == video)).tolist()
    runs, count = [], 0
    for i, v in enumerate(visual):
        if v and (i == 0 or not visual[i - 1]):
            runs.append([i])
        elif v:
            runs[-1].append(i)
    for run in runs:
        count += len(set(owner[run].tolist())) > 1
    return count


def _cast(batch: dict, dtype: torch.dtype) -> dict:
    return {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in batch.items()}


def reference_loss(ref: torch.nn.Module, docs: list[dict]) -> torch.Tensor:
    """The token-weighted mean loss of the plain model over ``docs`` (each run alone)."""
    total, count = 0.0, 0
    for doc in docs:
        n = int((doc["labels"][:, 1:] != -100).sum())
        total = total + ref(**doc).loss * n
        count += n
    return total / count


def vlm_sp_vs_reference(
    kind: str, u: int, layout: str, spec: list[list], packed: bool = False, dtype: torch.dtype = torch.float64
) -> dict:
    """One forward/backward with and without SP; loss error and the worst gradient error of each part."""
    mesh = sp_mesh(u, layout)
    ref = tiny_vlm(kind).to(dtype)
    model = copy.deepcopy(ref)
    if packed:
        batch, docs = packed_batch(ref, kind, spec)
    else:
        batch = vlm_batch(ref, kind, spec)
        docs = [batch]
    batch, docs = _cast(batch, dtype), [_cast(d, dtype) for d in docs]
    ref_loss = reference_loss(ref, docs)
    ref_loss.backward()
    sp = SeqParVisionLM(model, mesh)
    vision = {k: v for k, v in batch.items() if k not in TEXT_KEYS}
    shard = shard_batch({k: v for k, v in batch.items() if k in TEXT_KEYS}, mesh)
    loss = sp(**shard, **vision)
    loss.backward()
    worst = {"language": 0.0, "projector": 0.0, "vision": 0.0}
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad, group=mesh.group("sp"))
        if p_ref.grad is None:
            worst[part_of(name)] = max(worst[part_of(name)], grad.abs().max().item())
            continue
        worst[part_of(name)] = max(worst[part_of(name)], grad_err(name, grad, p_ref.grad))
    return {
        "loss_err": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        "grad": worst,
        "tokens": int(batch["input_ids"].shape[1]),
        "split_runs": split_runs(ref, batch["input_ids"], mesh),
        "vision_grads": sum(p.grad is not None for n, p in ref.named_parameters() if part_of(n) == "vision"),
    }


def vlm_zero3_vs_reference(
    kind: str, spec: list[list], u: int = 2, packed: bool = False, steps: int = 2, lr: float = 0.05
) -> dict:
    """``steps`` SGD steps with ds_seqpar.initialize under ZeRO-3 (fp32, Ulysses degree ``u`` over the world,
    zigzag) and in-process without SP; the first step's gathered gradient errors per part and every step's loss
    error. ``packed``: every step's batch is the documents of ``spec`` packed in one row."""
    import deepspeed

    ref = tiny_vlm(kind)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    config = ab_ds_config(dist.get_world_size(), u, 3)
    engine, _, _, _ = ds_seqpar.initialize(
        model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=lr)
    )
    mesh = engine.seqpar_mesh
    names = [n for n, _ in ref.named_parameters()]
    losses, worst = [], {"language": 0.0, "projector": 0.0, "vision": 0.0}
    for step in range(steps):
        batch, docs = (
            packed_batch(ref, kind, spec, seed=step)
            if packed
            else (vlm_batch(ref, kind, spec, seed=step),) * 2
        )
        ref_opt.zero_grad()
        ref_loss = reference_loss(ref, docs if packed else [batch])
        ref_loss.backward()
        loss = engine(**shard_batch(batch, mesh, whole=engine.module.whole_inputs))
        engine.backward(loss)
        if step == 0:
            for name, p, p_ref in zip(names, engine.module.model.parameters(), ref.parameters(), strict=True):
                grad = deepspeed.utils.safe_get_full_grad(p)
                if p_ref.grad is None:
                    assert grad is None or not grad.any(), (
                        f"{name}: a gradient where the plain model has none"
                    )
                    continue
                worst[part_of(name)] = max(worst[part_of(name)], grad_err(name, grad, p_ref.grad))
        engine.step()
        ref_opt.step()
        losses.append(abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
    return {"loss_err": max(losses), "grad": worst}


def long_video_inputs(kind: str, frames: int, g: torch.Generator) -> dict:
    """The tower's inputs for one video of ``frames`` temporal units (Qwen: temporal patches of a 4x4 grid;
    SigLIP families: frames of 8x8 pixels)."""
    if kind.startswith("qwen"):
        return {
            "hidden_states": torch.randn(frames * 16, 24, generator=g),
            "grid_thw": torch.tensor([[frames, 4, 4]]),
        }
    return {"pixel_values": torch.randn(frames, 3, 8, 8, generator=g)}


def tower_split_vs_whole(kind: str, frames: int) -> dict:
    """A long video through the VLM's vision tower whole and split over the SP group (fp64): the worst error of
    every output field and of the input gradient, and this rank's units."""
    from ds_seqpar.integrations.vision.split_tower import split_towers, vision_towers

    mesh = sp_mesh(1, "contiguous")
    model = tiny_vlm(kind).double()
    (_, tower, rule), *_ = vision_towers(model)
    inputs = long_video_inputs(kind, frames, torch.Generator().manual_seed(3))
    key = "hidden_states" if "hidden_states" in inputs else "pixel_values"
    inputs[key] = inputs[key].double().requires_grad_(True)
    whole = tower(**inputs)
    probe = torch.randn_like(whole.pooler_output if kind.startswith("qwen") else whole.last_hidden_state)
    field = "pooler_output" if kind.startswith("qwen") else "last_hidden_state"
    (dx_whole,) = torch.autograd.grad((whole[field] * probe).sum(), inputs[key])
    with split_towers(model, mesh) as split:
        out = tower(**inputs)
    # every rank uses the whole output here, so each takes 1/P of the probe (training: each its own tokens)
    (dx,) = torch.autograd.grad((out[field] * probe).sum() / mesh.sp_size, inputs[key])
    dist.all_reduce(dx, group=mesh.group("sp"))  # each rank holds the gradient of its own units
    err = max((out[k] - whole[k]).abs().max().item() for k in (field,))
    units = rule.split(dict(inputs)).costs if rule else ()
    return {"out_err": err, "dx_err": (dx - dx_whole).abs().max().item(), "split": split, "units": len(units)}


def _message(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def vlm_refusals() -> dict[str, str]:
    """The errors of inputs and models SeqParVisionLM refuses (every rank raises the same, no collective hangs)."""
    from transformers.masking_utils import blockwise_overlay

    from ds_seqpar.integrations.vision.language import TokenShard, _local_inputs
    from ds_seqpar.integrations.vision.masks import MaskProbe, block_ids
    from ds_seqpar.integrations.vision.towers import TOWER_RULES

    mesh = sp_mesh(2, "zigzag")
    model = tiny_vlm("gemma3")
    sp = SeqParVisionLM(copy.deepcopy(model), mesh)
    batch = vlm_batch(model, "gemma3", [[5, "image", 9]])
    shard = shard_batch({k: batch[k] for k in ("input_ids", "labels")}, mesh)
    blocks = (batch["input_ids"] == 150).long()
    layout = input_layout(mesh)
    frames = TOWER_RULES["frames"].split
    return {
        "token_type_ids": _message(lambda: block_ids("paligemma", {"token_type_ids": blocks})),
        "probe": _message(
            lambda: MaskProbe(None, 16, "gemma3")(
                1, 16, 16, mask_function=blockwise_overlay(blocks[:, :16] - 1)
            )
        ),
        "unknown": _message(lambda: sp(**shard, pixel_values=batch["pixel_values"], pixel_mask=blocks)),
        "language_keyword": _message(
            lambda: _local_inputs({"cross_attention_states": blocks}, TokenShard(layout, 0, 16, True))
        ),
        "text_model": _message(lambda: SeqParVisionLM(tiny_model("llama"), mesh)),
        "grid": _message(
            lambda: frames({"hidden_states": torch.zeros(10, 24), "grid_thw": torch.tensor([[1, 4, 4]])})
        ),
        "tower_tensor": _message(
            lambda: frames(
                {
                    "hidden_states": torch.zeros(16, 24),
                    "grid_thw": torch.tensor([[1, 4, 4]]),
                    "mask": torch.ones(16),
                }
            )
        ),
    }


def vlm_variant_vs_reference(kind: str, mode: str) -> float:
    """The worst gradient error (fp64, U2 x R2) of a VLM trained with HF gradient checkpointing (``"gc"``), as a
    PEFT LoRA model (``"lora"``) or with ``sequence_parallel.memory.activation_checkpointing`` (``"memory"``)."""
    from tests.helpers.meshes import mesh_for

    memory = {"activation_checkpointing": True} if mode == "memory" else None
    mesh = mesh_for(
        {"size": dist.get_world_size(), "ulysses_degree": 2} | ({"memory": memory} if memory else {})
    )
    ref = tiny_vlm(kind).double()
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        ref = get_peft_model(ref, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for name, param in ref.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.1)
    model = copy.deepcopy(ref)
    if mode == "gc":
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = _cast(vlm_batch(tiny_vlm(kind), kind, [[5, "image", 7, "image", 3, "image", 4]]), torch.float64)
    ref(**batch).loss.backward()
    sp = SeqParVisionLM(model, mesh)
    sp(**shard_batch(batch, mesh, whole=sp.whole_inputs)).backward()
    worst = 0.0
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
        if p_ref.grad is not None:
            grad = p.grad.clone()
            dist.all_reduce(grad, group=mesh.group("sp"))
            worst = max(worst, grad_err(name, grad, p_ref.grad))
    return worst
