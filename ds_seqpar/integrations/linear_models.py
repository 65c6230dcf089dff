"""Route the linear-attention layers of HuggingFace hybrid models through ``ds_seqpar.linear_attention``.

transformers (pinned 5.x) ships one family whose linear layers are a diagonal-decay linear attention:
**MiniMax** (``MiniMaxLightningAttention``: Lightning attention, a constant decay per head, hybrid with
softmax layers chosen by ``config.layer_types``). Its softmax layers already dispatch through the
``"ds_seqpar"`` attention implementation; its linear layers compute their core inline, so each
instance gets its forward replaced (``route_linear_layers``) by one that keeps the module's own
projections, activation, norm and output gate and hands only the recurrence to the sequence-parallel
scan:

    qkv = silu(qkv_proj(x)) -> q, k, v [B, n, H, D] (interleaved per head)
    o   = linear_attention(q, k, v, log_decay = -slope_rate[h])   # S_t = e^{-s_h} S_{t-1} + k_tᵀ v_t
    out = out_proj(sigmoid(output_gate(x)) * norm(o))

Other hybrid families in this transformers version use delta-rule, Mamba or convolution layers, which
this recurrence does not cover; they are rejected by name (see docs/linear.md).
"""

from __future__ import annotations

import types
from typing import Any

import torch

from ds_seqpar.integrations.hf_model import UnsupportedModelError

LINEAR_CLASSES = ("MiniMaxLightningAttention",)
UNSUPPORTED_LINEAR = (
    "GatedDeltaNet",
    "DeltaAttention",
    "Mamba",
    "Mixer",
    "ShortConv",
    "Rglru",
    "RwkvLinearAttention",
)


def _lightning_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: Any = None,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``MiniMaxLightningAttention.forward`` with the recurrence run by ``ds_seqpar.linear_attention``."""
    from ds_seqpar.integrations.transformers import SeqParContext, current_context
    from ds_seqpar.parallel.linear_scan import linear_attention

    ctx = current_context(kwargs)
    name = type(self).__name__
    if not isinstance(ctx, SeqParContext):
        raise RuntimeError(
            f"{name} (layer {self.layer_idx}) runs under ds_seqpar without a ds_seqpar context; run the model "
            "through ds_seqpar.SeqParCausalLM / ds_seqpar.initialize, or disable_sequence_parallel(model)"
        )
    if cache is not None or kwargs.get("use_cache"):
        raise RuntimeError(
            f"{name}: a recurrent cache is in use (generation); sequence-parallel linear attention needs the whole "
            "sequence at once: pass use_cache=False, and generate with an unwrapped model"
        )
    b, n, _ = hidden_states.shape
    h, d = self.num_attention_heads, self.head_dim
    qkv = self.act_fn(self.qkv_proj(hidden_states)).reshape(b, n, h, 3 * d)
    q, k, v = torch.split(qkv, d, dim=3)
    if ctx.doc_ids is not None:  # padding (doc id < 0) contributes nothing, as HF's padding mask does
        real = ctx.doc_ids if ctx.doc_ids.dim() == 2 else ctx.doc_ids.expand(b, -1)
        from ds_seqpar.layout import input_layout

        keep = input_layout(ctx.mesh).shard(real, ctx.mesh.coords.sp_rank, dim=1) >= 0
        q, k, v = (x * keep[:, :, None, None].to(x.dtype) for x in (q, k, v))
    out = linear_attention(q, k, v, mesh=ctx.mesh, log_decay=-self.slope_rate.view(h).to(q.dtype))
    out = self.norm(out.reshape(b, n, h * d))
    out = torch.sigmoid(self.output_gate(hidden_states)) * out
    ctx.record(self)
    return self.out_proj(out), None


def refuse_recurrent_layers(model: torch.nn.Module) -> None:
    """Raise ``UnsupportedModelError`` naming the first recurrent layer kind ds_seqpar cannot split."""
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls not in LINEAR_CLASSES and any(cls.endswith(bad) for bad in UNSUPPORTED_LINEAR):
            raise UnsupportedModelError(
                f"{type(model).__name__}.{name} is a {cls}: a recurrent layer ds_seqpar cannot split over the "
                "sequence (supported: diagonal-decay linear attention, i.e. MiniMax Lightning attention)"
            )


def route_linear_layers(model: torch.nn.Module) -> int:
    """Give every supported linear-attention layer of ``model`` the sequence-parallel forward.

    Returns the number of routed layers. Raises a ``TypeError`` naming the module when the model has
    a linear/recurrent layer kind ds_seqpar cannot split (delta rule, Mamba, convolution, RWKV).
    """
    refuse_recurrent_layers(model)
    routed = 0
    for module in model.modules():
        if type(module).__name__ in LINEAR_CLASSES:
            module.forward = types.MethodType(_lightning_forward, module)
            routed += 1
    return routed


def has_routed_layers(model: torch.nn.Module) -> bool:
    """Whether ``model`` has linear-attention layers that ``route_linear_layers`` routes."""
    return any(type(m).__name__ in LINEAR_CLASSES for m in model.modules())


def unroute_linear_layers(model: torch.nn.Module) -> None:
    """Restore the original forward of every routed layer."""
    for module in model.modules():
        if type(module).__name__ in LINEAR_CLASSES and "forward" in module.__dict__:
            del module.forward
