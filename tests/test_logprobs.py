"""``ds_seqpar.token_logprobs``: per-token log-probs and entropies of a sharded sequence equal one process's.

4 gloo ranks, U 2 x R 2 (zigzag) and a pure ring (R 4, contiguous / stripe), plain and packed rows, for a
softcapped family (Gemma 2), logit-scaled ones (Cohere, Granite), a hybrid with gated delta-rule layers
(Qwen3-Next) and Llama. The reference runs the plain model over the whole row (each packed document on its
own), divides its logits by the temperature and takes ``log_softmax``. Gradients: every rank computes the
same weighted sum of the gathered log-probs; the SP ranks' parameter gradients sum to the reference's.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist

import ds_seqpar
from ds_seqpar import SeqParCausalLM, shard_batch
from tests.helpers.hf_ab import grad_floor, rel_err, sp_mesh
from tests.helpers.hf_models import batches, tiny_model

TOL = 1e-6  # relative to max(|value|, 1)


def reference_logprobs(
    model: torch.nn.Module, batch: dict, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """One process: log p(next token) ``[B, S]`` (0 at the last position), the entropies, the labels and the
    per-token statistics of ``TokenLogprobs.stats``."""
    ids = batch["input_ids"]
    if "position_ids" in batch:
        rows = []
        for row, pos in zip(ids, batch["position_ids"], strict=True):
            starts = [0, *(i for i in range(1, len(pos)) if pos[i] <= pos[i - 1]), len(pos)]
            rows.append(
                torch.cat([model(input_ids=row[a:b][None]).logits for a, b in itertools.pairwise(starts)], 1)
            )
        logits = torch.cat(rows)
    else:
        logits = model(input_ids=ids).logits
    scaled = logits.float() / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    picked = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    keep = labels != -100
    stats = {
        "mean_logits": scaled.mean(-1),
        "is_top1": (scaled.argmax(-1) == labels).float(),
        "log_sum_sq_probs": torch.logsumexp(2 * logp, -1),
    }
    return picked * keep, ent * keep, labels, {k: (v * keep).detach() for k, v in stats.items()}


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest error relative to max(|b|, 1) (log-probs and entropies of a few nats: one float32 ulp ~5e-7)."""
    return ((a - b).abs() / b.abs().clamp(min=1.0)).max().item()


def packed(batch: dict, cuts: tuple[int, ...]) -> dict:
    """``batch`` as packed rows: positions restart at every cut."""
    seq_len = batch["input_ids"].shape[1]
    pos = torch.cat([torch.arange(b - a) for a, b in itertools.pairwise((0, *cuts, seq_len))])
    return {**batch, "position_ids": pos.expand_as(batch["input_ids"]).clone()}


def logprob_case(kind: str, u: int, layout: str, seq_len: int, pack: bool, temperature: float) -> dict:
    """Errors of the sharded and gathered log-probs, entropies and of the gradients of a gathered loss."""
    batch = batches(1, 2, seq_len, seed=3)[0]
    if pack:
        batch = packed(batch, (seq_len // 3, seq_len // 2 + 5))
    mesh = sp_mesh(u, layout)
    ref = tiny_model(kind)
    model = copy.deepcopy(ref)
    ref_logp, ref_ent, labels, ref_stats = reference_logprobs(ref, batch, temperature)
    weights = torch.linspace(-1.0, 2.0, labels.numel()).view_as(labels)
    (ref_logp * weights).sum().backward()

    sp = SeqParCausalLM(model, mesh)
    shard = shard_batch(batch, mesh)
    full = ds_seqpar.token_logprobs(
        sp, shard, gather=True, entropy=True, temperature=temperature, stats=tuple(ref_stats)
    )
    seq = full.logprobs.shape[1]
    ref_pad = torch.nn.functional.pad(ref_logp, (0, seq - seq_len))
    errors = {
        "gathered": close(full.logprobs[:, :seq_len], ref_logp),
        "entropy": close(full.entropy[:, :seq_len], ref_ent),
        "labels": float(not torch.equal(full.labels[:, :seq_len], labels)),
        "padding": full.logprobs[:, seq_len:].abs().max().item() if seq > seq_len else 0.0,
        **{name: close(full.stats[name][:, :seq_len], ref) for name, ref in ref_stats.items()},
    }
    layout_ = ds_seqpar.input_layout(mesh, shard["doc_ids"])
    with torch.no_grad():
        local = ds_seqpar.token_logprobs(sp, shard, temperature=temperature)
    errors["sharded"] = close(local.logprobs, layout_.shard(ref_pad, mesh.coords.sp_rank))
    weights_pad = torch.nn.functional.pad(weights, (0, seq - seq_len))
    (full.logprobs * weights_pad).sum().backward()
    worst, floor = (
        0.0,
        grad_floor("causal", kind, ref),
    )  # hybrids: 1 % of the gradient's norm (hf_ab.grad_floor)
    for p, p_ref in zip(model.parameters(), ref.parameters(), strict=True):
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad, group=mesh.group("sp"))
        if p_ref.grad is not None:
            worst = max(worst, rel_err(grad, p_ref.grad, max(floor, 1e-4)))
    errors["grad"] = worst
    return errors


CASES = [
    ("gemma2", 2, "zigzag", 48, False, 1.0),  # attention and final logit soft-caps, sliding window
    ("cohere", 1, "contiguous", 46, True, 0.7),  # logit scale; packed; end padding; temperature
    ("granite", 1, "stripe", 48, False, 1.3),  # logit divisor, pure ring of stripes
    ("qwen3_next", 2, "zigzag", 48, False, 1.0),  # hybrid: gated delta rule + attention (packed rows do not
    # reset its recurrent state, as in HF: docs/delta.md; no one-process reference separates only the attention)
    ("llama", 2, "zigzag", 62, True, 0.5),
]


@pytest.mark.parametrize(("kind", "u", "layout", "seq_len", "pack", "temperature"), CASES)
def test_token_logprobs_equal_one_process(dist_pool, kind, u, layout, seq_len, pack, temperature):
    for rank, errors in enumerate(
        dist_pool(4).run(logprob_case, kind, u, layout, seq_len, pack, temperature)
    ):
        where = f"rank {rank}: {errors}"
        assert errors["labels"] == 0.0, where
        assert errors["padding"] == 0.0, where
        assert errors["gathered"] <= TOL and errors["sharded"] <= TOL and errors["entropy"] <= TOL, where
        assert errors["grad"] <= 1e-5, where
        assert max(errors[name] for name in ("mean_logits", "is_top1", "log_sum_sq_probs")) <= TOL, where


def test_token_logprobs_needs_a_wrapper():
    with pytest.raises(TypeError, match="SeqParCausalLM"):
        ds_seqpar.token_logprobs(torch.nn.Linear(2, 2), {})
