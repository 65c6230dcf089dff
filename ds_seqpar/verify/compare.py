"""The comparison itself, on every rank: the user's model with sequence parallelism (``ds_seqpar.initialize``,
the config's ZeRO stage) and without (a copy with the same initial weights: the plain HF forward on the
full sequence, in this process), step by step.

Per step, data-parallel group g reads sample ``step · dp + g`` (random token ids of ``--seq-len``, seeded).
The reference's loss is the mean over the dp groups of each sample's token-mean loss, which is what the
SP engine optimises. Gradients are compared after ``engine.backward`` (DeepSpeed's reduction over dp x sp
done, ZeRO's partitions gathered with ``deepspeed.utils.safe_get_full_grad``, every rank the same in the
same order: a collective per parameter under ZeRO-1/2/3), before clipping; then both take the same SGD
step, the reference clipping by ``gradient_clipping`` as DeepSpeed does.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ModuleDiff", "StepLoss", "VerifyResult", "module_of", "run_comparison"]

REL_FLOOR = 1e-6  # a module's gradient norm is floored at this fraction of the whole model's (see module_of)


@dataclass
class StepLoss:
    """One step's losses: with SP (mean over the ranks of the SP-group losses) and of the reference."""

    step: int
    sp: float
    reference: float
    sp_seconds: float
    reference_seconds: float

    @property
    def abs_diff(self) -> float:
        return abs(self.sp - self.reference)

    @property
    def rel_diff(self) -> float:
        return self.abs_diff / max(abs(self.reference), 1e-30)


@dataclass
class ModuleDiff:
    """A module's worst gradient difference over the steps: ``rel`` = ‖g_sp − g_ref‖ / ‖g_ref‖ over its
    parameters (the norm floored at ``REL_FLOOR`` of the model's), ``abs`` = max |g_sp − g_ref|."""

    rel: float = 0.0
    abs: float = 0.0
    step: int = 0
    params: int = 0


@dataclass
class VerifyResult:
    losses: list[StepLoss] = field(default_factory=list)
    modules: dict[str, ModuleDiff] = field(default_factory=dict)


def module_of(param_name: str) -> str:
    """The module a parameter's difference is reported under: its owner, cut after the first child of a
    numbered block (``model.layers.0.self_attn.q_proj.weight`` -> ``model.layers.0.self_attn``,
    ``model.layers.3.mlp.experts.1.w1`` -> ``model.layers.3.mlp``, ``lm_head.weight`` -> ``lm_head``)."""
    parts = param_name.split(".")[:-1]
    for i, part in enumerate(parts):
        if part.isdigit() and i + 1 < len(parts):
            return ".".join(parts[: i + 2])
    return ".".join(parts) or param_name


def _device() -> torch.device:
    """cuda:LOCAL_RANK with TF32 off (float32 matmuls in full precision), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", local)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """``--model`` in float32, training mode, dropout off: loaded, or random (seeded) with ``--random-init``."""
    from ds_seqpar.verify.args import model_class

    auto = model_class(args.objective)
    common = dict(dtype=torch.float32, trust_remote_code=args.trust_remote_code)
    if args.random_init:
        torch.manual_seed(args.seed)
        model = auto.from_config(args.model_config, **common)
    else:
        model = auto.from_pretrained(args.model, config=args.model_config, **common)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.float().train()


def make_data(args: argparse.Namespace, num: int) -> list[dict[str, torch.Tensor]]:
    """``num`` samples ``{"input_ids" [1, S]}`` of random ids below the vocabulary size (masked LMs: 15 % of
    the tokens masked by BERT's rule, with ``labels``), from ``--seed``."""
    config = getattr(args.model_config, "text_config", None) or args.model_config
    vocab = int(config.vocab_size)
    gen = torch.Generator().manual_seed(args.seed)
    data = []
    for _ in range(num):
        ids = torch.randint(0, vocab, (1, args.seq_len), generator=gen)
        if args.objective == "masked":
            from ds_seqpar.tasks.masking import mask_tokens

            ids, labels = mask_tokens(ids, mask_token_id=args.mask_token_id, vocab_size=vocab, generator=gen)
            data.append({"input_ids": ids, "labels": labels})
        else:
            data.append({"input_ids": ids})
    return data


def reference_loss(model: torch.nn.Module, sample: dict[str, torch.Tensor], objective: str) -> torch.Tensor:
    """The plain HF forward on the full sequence; token-mean cross-entropy of the next token (causal) or of
    the masked tokens (masked), in float32."""
    ids = sample["input_ids"]
    extra = {"use_cache": False} if objective == "causal" else {}
    logits = model(input_ids=ids, **extra).logits.float()
    labels = sample.get("labels", ids)
    if objective == "causal":
        labels = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _timed(device: torch.device, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and its wall time in seconds (CUDA synchronised)."""
    start = time.perf_counter()
    out = fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def run_comparison(
    args: argparse.Namespace, progress: Callable[[StepLoss], None] | None = None
) -> VerifyResult:
    """Both runs for ``args.steps`` steps on this rank (every rank returns the same result)."""
    from ds_seqpar.integrations.deepspeed import init_distributed

    device = _device()
    init_distributed(args.settings.fault_timeout_s)
    model = build_model(args)
    ref = copy.deepcopy(model).to(device)
    trained = [p for p in model.parameters() if p.requires_grad]
    engine = _sp_engine(model, args.ds_config_dict, torch.optim.SGD(trained, lr=args.lr))
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=args.lr)
    mesh = engine.seqpar_mesh
    dp = dist.get_world_size() // mesh.sp_size
    data = make_data(args, args.steps * dp)
    clip = float(engine.gradient_clipping() or 0.0)  # DeepSpeed's, default included
    result = VerifyResult()
    for step in range(args.steps):
        samples = data[step * dp : (step + 1) * dp]
        ref_loss, ref_s = _timed(device, _reference_backward, ref, samples, args.objective, device)
        sample = samples[mesh.coords.dp_rank]
        sp_loss, sp_s = _timed(device, _sp_backward, engine, mesh, sample, step, device)
        _compare_grads(engine.module.model, ref, step + 1, result.modules)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], clip)
        _, step_s = _timed(device, engine.step)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        loss = StepLoss(step + 1, sp_loss, ref_loss, sp_s + step_s, ref_s)
        result.losses.append(loss)
        if progress is not None:
            progress(loss)
    return result


class _Without(logging.Filter):
    """Drops the log records whose message contains ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def _sp_engine(model: torch.nn.Module, ds_config: dict[str, Any], optimizer: torch.optim.Optimizer) -> Any:
    """``ds_seqpar.initialize`` of ``model`` with verify's SGD (DeepSpeed's "untested optimizer" warning,
    which plain SGD under ZeRO draws, left out: SGD is chosen here on purpose)."""
    from deepspeed.utils import logger

    import ds_seqpar

    quiet = _Without("untested optimizer")
    logger.addFilter(quiet)
    try:
        engine, _, _, _ = ds_seqpar.initialize(model=model, config=ds_config, optimizer=optimizer)
    finally:
        logger.removeFilter(quiet)
    return engine


def _reference_backward(
    ref: torch.nn.Module, samples: list[dict[str, torch.Tensor]], objective: str, device: torch.device
) -> float:
    """Mean over the dp groups' samples of the reference loss, backward; returns the loss."""
    losses = [reference_loss(ref, {k: v.to(device) for k, v in s.items()}, objective) for s in samples]
    total = torch.stack(losses).mean()
    total.backward()
    return total.item()


def _sp_backward(
    engine: Any, mesh: Any, sample: dict[str, torch.Tensor], step: int, device: torch.device
) -> float:
    """This rank's shard through the SP engine, backward; returns the mean over all ranks of the SP-group loss
    (= the mean over the dp groups)."""
    from ds_seqpar import shard_batch

    engine.module.step = step
    shard = shard_batch(sample, mesh, objective=engine.module.objective)
    shard = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in shard.items()}
    loss = engine(**shard)
    engine.backward(loss)
    mean = loss.detach().clone().float()
    dist.all_reduce(mean)
    return (mean / dist.get_world_size()).item()


def _compare_grads(
    sp_model: torch.nn.Module, ref: torch.nn.Module, step: int, modules: dict[str, ModuleDiff]
) -> None:
    """Every trained parameter's full gradient (gathered) against the reference's; updates each module's
    worst difference in ``modules``."""
    from deepspeed.utils import safe_get_full_grad

    sums: dict[str, list[float]] = {}  # module -> [‖Δ‖², ‖g_ref‖², max |Δ|, parameters]
    for (name, p), (ref_name, p_ref) in zip(sp_model.named_parameters(), ref.named_parameters(), strict=True):
        if name != ref_name:
            raise RuntimeError(f"parameter order differs: {name} (SP) vs {ref_name} (reference)")
        if not p_ref.requires_grad:
            continue
        grad = safe_get_full_grad(p)
        want = p_ref.grad if p_ref.grad is not None else torch.zeros_like(p_ref)
        got = grad.detach().double() if grad is not None else torch.zeros_like(want, dtype=torch.float64)
        diff = got.to(want.device).reshape(want.shape) - want.double()
        acc = sums.setdefault(module_of(name), [0.0, 0.0, 0.0, 0])
        acc[0] += diff.pow(2).sum().item()
        acc[1] += want.double().pow(2).sum().item()
        acc[2] = max(acc[2], diff.abs().max().item()) if diff.numel() else acc[2]
        acc[3] += p_ref.numel()
    floor = REL_FLOOR * math.sqrt(sum(acc[1] for acc in sums.values()))
    for name, (d2, r2, worst_abs, count) in sums.items():
        rel = math.sqrt(d2) / max(math.sqrt(r2), floor, 1e-30) if d2 == d2 else math.nan
        seen = modules.setdefault(name, ModuleDiff(params=count))
        seen.abs = max(seen.abs, worst_abs)
        if not math.isnan(seen.rel) and (math.isnan(rel) or rel > seen.rel or seen.step == 0):
            seen.rel, seen.step = rel, step  # the first NaN stays
