"""Per-token log-probabilities (and entropies) of a sharded sequence: what post-training losses consume.

Legend: B = batch, n = this rank's tokens, S = the padded global length (``seq_len`` of ``shard_batch``),
V = vocabulary, P = SP degree, c = ``chunk_size``.

``ds_seqpar.token_logprobs(model, batch)`` runs the decoder over the group as training does (every
layer's attention and recurrence split over the SP ranks), then, ``c`` tokens at a time, the model's own
logits path (``integrations/hf_model.ModelLogits``: final norm, LM head, logit scale or divisor, final
soft-cap), divides by ``temperature`` and takes ``log_softmax``:

    logprobs[b, t] = log p(label[b, t] | tokens before)     0 where the label is -100
    entropy[b, t]  = -sum_v p_v log p_v                       (``entropy=True``; 0 where unlabelled)

Each chunk is recomputed in backward (activation checkpointing), so no ``[B, n, V]`` tensor exists at
once; the peak of the pass is one chunk's ``[B, c, V]`` in float32 (docs/post_training.md has the
measurement).

``gather=False``: the tensors are this rank's ``[B, n]`` in its shard order (the labels' order,
``TokenLogprobs.labels``). ``gather=True``: ``[B, S]`` in global order on every rank of the group (one
all-gather of ``B·n`` values per tensor per peer). The gathered tensors are *replicated*: every rank of the
group is expected to compute the same function of them (a TRL loss does), so in backward each rank keeps
the gradient of its own tokens and nothing travels. Both forms carry the wrapper's ``grad_scale``
(``ds_seqpar.loss.sp_grad_scale``), so the parameter gradients after DeepSpeed's reduction equal the
gradients of that function in one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ds_seqpar.comm.team import TeamComm
from ds_seqpar.integrations.hf_model import UnsupportedModelError
from ds_seqpar.loss import IGNORE_INDEX, Head, scale_grad
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.settings import input_layout

__all__ = ["TokenLogprobs", "chunked_logprobs", "gather_sequence", "sharded_logprobs", "token_logprobs"]


STATS = (
    "mean_logits",
    "is_top1",
    "log_sum_sq_probs",
)  # per-token statistics without gradient (TRL's metrics)


@dataclass(frozen=True)
class TokenLogprobs:
    """``logprobs`` ``[B, n]`` (or ``[B, S]`` gathered), ``entropy`` (same shape, or None), the ``labels`` they score
    (-100 = unlabelled, where every field is 0), in the same order, and the requested ``stats`` (no gradient):
    ``mean_logits`` (mean of the temperature-scaled logits over V), ``is_top1`` (the label is the arg max, 0/1),
    ``log_sum_sq_probs`` (log sum_v p_v^2)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    labels: torch.Tensor
    stats: dict[str, torch.Tensor] = field(default_factory=dict)


def _chunk(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: Head,
    temperature: float,
    with_entropy: bool,
    stats: tuple[str, ...],
) -> tuple[torch.Tensor, ...]:
    """Log-prob of ``labels [B, c]``, entropy (zeros unless ``with_entropy``) and ``stats`` from ``hidden [B, c, E]``."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    labelled = labels != IGNORE_INDEX
    safe = labels.clamp(min=0).unsqueeze(-1)
    zero = torch.zeros(labels.shape, dtype=logp.dtype, device=logp.device)
    out = [torch.where(labelled, logp.gather(-1, safe).squeeze(-1), zero)]
    out.append(torch.where(labelled, -(logp.exp() * logp).sum(-1), zero) if with_entropy else zero)
    with torch.no_grad():
        values = {
            "mean_logits": lambda: logits.mean(-1),
            "is_top1": lambda: (logits.argmax(-1, keepdim=True) == safe).squeeze(-1).to(logp.dtype),
            "log_sum_sq_probs": lambda: torch.logsumexp(2 * logp, dim=-1),
        }
        out += [torch.where(labelled, values[name](), zero) for name in stats]
    return tuple(out)


def chunked_logprobs(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: Head,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
    stats: tuple[str, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """Per-token log-probs ``[B, n]`` of ``labels [B, n]`` from ``hidden [B, n, E]``, the entropies (or None) and
    ``stats`` (names of :data:`STATS`), ``chunk_size`` tokens of logits at a time (each chunk recomputed in backward
    when gradients are needed)."""
    if hidden.shape[:2] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree on [B, n]")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0 (the logits are divided by it)")
    unknown = sorted(set(stats) - set(STATS))
    if unknown:
        raise ValueError(f"unknown per-token statistics {unknown}; valid: {', '.join(STATS)}")
    parts: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, hidden.shape[1], chunk_size):
        h, y = hidden[:, start : start + chunk_size], labels[:, start : start + chunk_size]
        args = (h, y, head, temperature, with_entropy, tuple(stats))
        if torch.is_grad_enabled() and h.requires_grad:
            parts.append(checkpoint(_chunk, *args, use_reentrant=False))
        else:
            parts.append(_chunk(*args))
    cols = [torch.cat(list(col), dim=1) for col in zip(*parts, strict=True)]
    return cols[0], (cols[1] if with_entropy else None), dict(zip(stats, cols[2:], strict=True))


class _GatherReplicated(torch.autograd.Function):
    """All-gather ``[B, n]`` -> ``[B, P·n]`` (member order); backward keeps this rank's columns (the result is
    replicated: every member computes the same function of it, so its gradient is the same everywhere)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, team: TeamComm) -> torch.Tensor:
        ctx.n, ctx.index = x.shape[1], team.index
        return team.gather(x.contiguous(), dim=1)[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[:, ctx.index * ctx.n : (ctx.index + 1) * ctx.n].contiguous(), None


def gather_sequence(x: torch.Tensor, team: TeamComm, permutation: torch.Tensor) -> torch.Tensor:
    """Every member's ``x [B, n]`` as the global ``[B, S]``: gathered in member order, then put back in global
    order (``permutation``: the layout's positions of all members concatenated, ``Layout.permutation``)."""
    full = _GatherReplicated.apply(x, team) if team.size > 1 else x
    return full.index_select(1, torch.argsort(permutation.to(full.device)))


def sharded_logprobs(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: Head,
    mesh: SeqParMesh,
    doc_ids: torch.Tensor | None,
    *,
    gather: bool,
    entropy: bool,
    temperature: float,
    chunk_size: int,
    grad_scale: float,
    stats: tuple[str, ...] = (),
) -> TokenLogprobs:
    """The wrappers' ``token_logprobs`` from this rank's final hidden states ``[B, n, E]`` and ``labels [B, n]``:
    chunked log-probs with the gradient factor ``grad_scale``, gathered over the SP group in global order when
    ``gather`` (the batch's layout from ``doc_ids``, as ``shard_batch`` sharded it)."""
    logp, ent, extra = chunked_logprobs(hidden, labels, head, chunk_size, temperature, entropy, stats)
    if grad_scale != 1.0:
        logp = scale_grad(logp, grad_scale)
        ent = None if ent is None else scale_grad(ent, grad_scale)
    if not gather or mesh.sp_size == 1:
        return TokenLogprobs(logp, ent, labels, extra)
    layout = input_layout(mesh, doc_ids)
    if layout.world != mesh.sp_size or layout.group_degree is not None:
        raise UnsupportedModelError(
            f"token_logprobs(gather=True): this batch runs in groups of {layout.group_degree} ranks "
            "(sequence_parallel.dynamic_degree), so no single gather over the SP group restores its order; valid: "
            "gather=False (each rank's tokens, with their labels), or dynamic_degree off"
        )
    perm = layout.permutation(labels.shape[1] * mesh.sp_size)
    team = TeamComm(mesh.group("sp"), mesh.members["sp"], mesh.coords.sp_rank, mesh.comm_stats)
    with torch.no_grad():
        full_labels = gather_sequence(labels, team, perm)
        full_stats = {name: gather_sequence(value, team, perm) for name, value in extra.items()}
    return TokenLogprobs(
        gather_sequence(logp, team, perm),
        None if ent is None else gather_sequence(ent, team, perm),
        full_labels,
        full_stats,
    )


def token_logprobs(
    model: torch.nn.Module,
    batch: dict[str, Any],
    *,
    gather: bool = False,
    entropy: bool = False,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    stats: tuple[str, ...] = (),
) -> TokenLogprobs:
    """Per-token log-probs of ``batch`` (the output of ``ds_seqpar.shard_batch``) under ``model``.

    Args:
        model: a ``SeqParCausalLM`` / ``SeqParMaskedLM``, or the DeepSpeed engine around one
            (``ds_seqpar.initialize``'s).
        batch: this rank's shard (``input_ids``, ``shift_labels`` or ``labels``, ``position_ids``, ``doc_ids``,
            ``seq_len``).
        gather: return the whole sequence ``[B, S]`` on every rank of the group instead of this rank's ``[B, n]``.
        entropy: also return the entropy of every labelled token's distribution.
        temperature: the logits are divided by it before ``log_softmax`` (a sampler's temperature).
        chunk_size: tokens per logits chunk (default: the wrapper's ``loss_chunk_size``).
        stats: per-token statistics to add, without gradient (names of :data:`STATS`).
    """
    wrapper = getattr(model, "module", model)
    method = getattr(wrapper, "token_logprobs", None)
    if method is None:
        raise TypeError(
            f"token_logprobs needs a ds_seqpar model wrapper (SeqParCausalLM, SeqParMaskedLM) or the DeepSpeed engine "
            f"around one (ds_seqpar.initialize); got {type(model).__name__}"
        )
    return method(
        **batch, gather=gather, entropy=entropy, temperature=temperature, chunk_size=chunk_size, stats=stats
    )
