"""Token-weighted causal-LM loss over the SP group, with logits computed in sequence chunks.

Legend: B = batch, n = local tokens, E = hidden size, V = vocabulary, P = SP degree.

The loss of one sample group is ``L = (sum over the SP group of token losses) / N`` with N the
number of labelled tokens of the whole group (labels pre-shifted by ``ds_seqpar.data``). Each rank
holds the token losses of its n tokens; N is one all-reduce of a count (a tensor, never a host
sync), and a rank whose shard has no labelled token contributes exactly 0 (finite loss and
gradients).

``grad_scale``: DeepSpeed averages gradients over a group that includes the SP ranks, with a
divisor that depends on the ZeRO stage. The returned loss has the VALUE ``L`` (what you log) and the
GRADIENT of ``grad_scale · (local token-loss sum) / N``, so that after DeepSpeed's reduction the
parameter gradients equal those of ``L`` without SP. ``ds_seqpar.initialize`` picks the factor
(``sp_grad_scale``) and the A/B tests check it for ZeRO-1, 2 and 3.

Memory: logits are computed ``chunk_size`` tokens at a time and recomputed in backward
(activation checkpointing per chunk), so ``[n, V]`` never exists at once; peak is ``[B, chunk, V]``
fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


Head = Callable[[torch.Tensor], torch.Tensor]  # hidden [B, c, E] -> logits [B, c, V]


def _chunk_loss_sum(hidden: torch.Tensor, labels: torch.Tensor, head: Head) -> torch.Tensor:
    """Sum of token cross-entropies of one chunk: hidden ``[B, c, E]``, labels ``[B, c]``."""
    logits = head(hidden).float()
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def chunked_token_loss_sum(
    hidden: torch.Tensor, labels: torch.Tensor, head: Head, chunk_size: int = 1024
) -> torch.Tensor:
    """Sum of token losses over this rank's tokens, ``chunk_size`` tokens of logits at a time.

    Args:
        hidden: final hidden states ``[B, n, E]``; labels: pre-shifted ``[B, n]`` (-100 = ignore).
        head: hidden ``[B, c, E]`` -> logits ``[B, c, V]``: the LM head, or the model's whole logits
            computation (``integrations/hf_model.ModelLogits``: head plus any post-head transform).
    """
    if hidden.shape[:2] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree on [B, n]")
    total = hidden.new_zeros((), dtype=torch.float32)
    n = hidden.shape[1]
    for start in range(0, n, chunk_size):
        h, y = hidden[:, start : start + chunk_size], labels[:, start : start + chunk_size]
        if torch.is_grad_enabled() and h.requires_grad:
            total = total + checkpoint(_chunk_loss_sum, h, y, head, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(h, y, head)
    return total


def sp_causal_lm_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: Head,
    sp_group: Any = None,
    *,
    grad_scale: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-weighted loss over the SP group (see the module docstring).

    Args:
        hidden: ``[B, n, E]``; labels: pre-shifted ``[B, n]``; head: hidden -> logits (see above).
        sp_group: the SP process group (None: no SP, plain mean over this rank's tokens).
        grad_scale: gradient multiplier matching DeepSpeed's reduction (see ``sp_grad_scale``).
        chunk_size: tokens per logits chunk.

    Returns:
        ``(loss, num_tokens)``: the group's mean token loss (a differentiable scalar) and the
        number of labelled tokens of the group (a tensor).
    """
    local_sum = chunked_token_loss_sum(hidden, labels, head, chunk_size)
    count = (labels != IGNORE_INDEX).sum().to(torch.float32)
    totals = torch.stack([local_sum.detach(), count])
    if sp_group is not None and dist.is_initialized() and dist.get_world_size(sp_group) > 1:
        dist.all_reduce(totals, group=sp_group)
    group_sum, group_count = totals[0], totals[1]
    denom = group_count.clamp(min=1.0)
    scaled_local = grad_scale * local_sum / denom
    loss = scaled_local + (group_sum / denom - scaled_local).detach()
    return loss, group_count


def sp_grad_scale(zero_stage: int, sp_size: int) -> float:
    """Gradient multiplier that makes DeepSpeed's reduction over dp x sp exact for the SP loss.

    DeepSpeed 0.19.8 divides the summed gradients by world / sp for ZeRO-0/1/2, so each rank's
    local share is already right (1.0); its ZeRO-3 reduce-scatter path divides by the whole
    world, so the SP ranks' shares must be multiplied by sp.
    """
    return float(sp_size) if zero_stage == 3 else 1.0


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` itself, whose gradient is multiplied by ``scale`` (DeepSpeed's reduction, ``sp_grad_scale``)."""
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)
