"""Route the recurrent layers of HuggingFace hybrid models through ds_seqpar: a registry of layer class -> adapter.

"Recurrent" is the one word for these layers (linear attention, gated delta rules, Mamba2): everything
whose sequence mixing is a state carried along the sequence rather than softmax attention.

Each adapter replaces one layer instance's forward with one that keeps the module's own projections,
convolution weights, norms, gates and output, and hands only what spans the sequence to ds_seqpar
(``integrations/recurrent_adapters.py``, ``delta_adapters.py``, ``conv_adapters.py``, the Mamba mixers in
``mamba_adapters.py``; conventions per family in docs/delta.md):

    class (transformers 5.x)                               what runs under SP
    MiniMaxLightningAttention                              linear attention, decay per head (All-Scan)
    Qwen3NextGatedDeltaNet, Qwen3_5GatedDeltaNet           conv1d halo + gated delta rule (matrix All-Scan)
    Qwen3_5MoeGatedDeltaNet, LaraMiniGatedDeltaNet,
    Qwen4ExpTextGatedDeltaNet
    OlmoHybridGatedDeltaNet                                conv1d halo + gated delta rule, β ∈ [0, 2]
    KimiLinearDeltaAttention (Kimi Delta Attention)        conv1d halo + delta rule with per-channel decay
    BailingHybridDeltaAttention                            conv1d halo + KDA (delta_adapters.py)
    ZayaCCAProjection (ZAYA's q/k/v projection)            halo of the q/k convolutions + one-token value shift
    Lfm2ShortConv, Lfm2MoeShortConv, Lfm3ShortConv         gated short conv: conv1d halo only (conv_adapters.py)
    NemotronHMamba2Mixer, BambaMixer,                      conv1d halo + Mamba2 SSD (decay per token and head;
    GraniteMoeHybridMambaLayer, Zamba2MambaMixer,          heads < U split along head_dim)
    Mamba2Mixer, FalconH1Mixer (muP multipliers)
    MambaMixer, FalconMambaMixer, JambaMambaMixer          conv1d halo + Mamba v1 selective scan (one head per
    (dt / B / C norms), ZambaMambaMixer (per-head B, C)    channel, decay per token and state index)
    RecurrentGemmaRecurrentBlock + RecurrentGemmaRglru     conv1d halo + diagonal RG-LRU scan (rnn_adapters.py)
    RwkvSelfAttention, RwkvFeedForward                     token shift + WKV as a diagonal scan (rnn_adapters.py)
    xLSTMLayer                                             the mLSTM: max-stabiliser chain + C / n All-Scan

The DeepSeek sparse attention layers (DeepSeek-V3.2, GLM-MoE-DSA, AXK2, dots.3, HY-V4) are routed the same
way: their entries come from ``integrations/dsa_adapters.DSA_ADAPTERS`` (docs/dsa.md).

A family is one entry: ``register_recurrent_layer(cls, forward)``. Built-in entries are resolved only
when their transformers module is already imported (no model module is imported to look one up).
Softmax layers of the same models go through the ``"ds_seqpar"`` attention implementation. Any other
recurrent layer kind (``UNSUPPORTED_RECURRENT`` name endings) is refused by name.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch

from ds_seqpar.integrations import conv_adapters, delta_adapters, rnn_adapters
from ds_seqpar.integrations import mamba_adapters as mamba
from ds_seqpar.integrations import recurrent_adapters as adapters
from ds_seqpar.integrations.class_registry import registered_forward
from ds_seqpar.integrations.conv_projection_adapters import zaya_cca_forward
from ds_seqpar.integrations.dsa_adapters import DSA_ADAPTERS, refuse_unrouted_indexers
from ds_seqpar.integrations.hf_model import UnsupportedModelError
from ds_seqpar.integrations.recurrent_decoders import with_decoding

# transformers module, class name -> adapter forward (resolved lazily into REGISTRY)
BUILTIN_ADAPTERS: dict[tuple[str, str], Callable] = {
    ("transformers.models.minimax.modeling_minimax", "MiniMaxLightningAttention"): adapters.lightning_forward,
    (
        "transformers.models.qwen3_next.modeling_qwen3_next",
        "Qwen3NextGatedDeltaNet",
    ): adapters.qwen3_next_gdn_forward,
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet"): adapters.qwen3_5_gdn_forward,
    (
        "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
        "Qwen3_5MoeGatedDeltaNet",
    ): adapters.qwen3_5_gdn_forward,
    (
        "transformers.models.kimi_linear.modeling_kimi_linear",
        "KimiLinearDeltaAttention",
    ): adapters.kda_forward,
    ("transformers.models.nemotron_h.modeling_nemotron_h", "NemotronHMamba2Mixer"): mamba.mamba2_forward,
    ("transformers.models.bamba.modeling_bamba", "BambaMixer"): mamba.mamba2_forward,
    ("transformers.models.granitemoehybrid.modeling_granitemoehybrid", "GraniteMoeHybridMambaLayer"): (
        mamba.mamba2_forward
    ),
    ("transformers.models.zamba2.modeling_zamba2", "Zamba2MambaMixer"): mamba.mamba2_forward,
    ("transformers.models.mamba2.modeling_mamba2", "Mamba2Mixer"): mamba.mamba2_forward,
    ("transformers.models.falcon_h1.modeling_falcon_h1", "FalconH1Mixer"): mamba.falcon_h1_forward,
    ("transformers.models.mamba.modeling_mamba", "MambaMixer"): mamba.mamba_forward,
    (
        "transformers.models.falcon_mamba.modeling_falcon_mamba",
        "FalconMambaMixer",
    ): mamba.normed_mamba_forward,
    ("transformers.models.jamba.modeling_jamba", "JambaMambaMixer"): mamba.normed_mamba_forward,
    ("transformers.models.zamba.modeling_zamba", "ZambaMambaMixer"): mamba.zamba_forward,
    (
        "transformers.models.lara_mini.modeling_lara_mini",
        "LaraMiniGatedDeltaNet",
    ): adapters.qwen3_5_gdn_forward,
    (
        "transformers.models.qwen4_exp.modeling_qwen4_exp",
        "Qwen4ExpTextGatedDeltaNet",
    ): adapters.qwen3_5_gdn_forward,
    ("transformers.models.olmo_hybrid.modeling_olmo_hybrid", "OlmoHybridGatedDeltaNet"): (
        delta_adapters.olmo_hybrid_gdn_forward
    ),
    ("transformers.models.bailing_hybrid.modeling_bailing_hybrid", "BailingHybridDeltaAttention"): (
        delta_adapters.bailing_kda_forward
    ),
    ("transformers.models.lfm2.modeling_lfm2", "Lfm2ShortConv"): conv_adapters.short_conv_forward,
    ("transformers.models.lfm2_moe.modeling_lfm2_moe", "Lfm2MoeShortConv"): conv_adapters.short_conv_forward,
    ("transformers.models.lfm3.modeling_lfm3", "Lfm3ShortConv"): conv_adapters.short_conv_forward,
    ("transformers.models.zaya.modeling_zaya", "ZayaCCAProjection"): zaya_cca_forward,
    **rnn_adapters.ADAPTERS,  # RecurrentGemma, RWKV, xLSTM (integrations/rnn_adapters.py)
    **DSA_ADAPTERS,  # DeepSeek sparse attention layers (integrations/dsa_adapters.py)
}
REGISTRY: dict[type, Callable] = {}
UNSUPPORTED_RECURRENT = (
    "GatedDeltaNet",
    "DeltaAttention",
    "DeltaNet",
    "Mamba",
    "Mixer",
    "ShortConv",
    "Rglru",
    "RwkvLinearAttention",
    "LightningAttention",
)


def register_recurrent_layer(cls: type, forward: Callable) -> None:
    """Route every instance of ``cls`` through ``forward(self, hidden_states, ...)`` under ds_seqpar."""
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        raise TypeError(f"register_recurrent_layer takes an nn.Module subclass, got {cls!r}")
    REGISTRY[cls] = forward


def adapter_for(module: torch.nn.Module) -> Callable | None:
    """The registered forward for ``module``'s class (or a base class), else None."""
    return registered_forward(module, BUILTIN_ADAPTERS, REGISTRY)


def supported_layers() -> str:
    return ", ".join(name for _, name in BUILTIN_ADAPTERS)


def refuse_recurrent_layers(model: torch.nn.Module) -> None:
    """Raise ``UnsupportedModelError`` naming the first recurrent layer kind ds_seqpar cannot split (or a
    DeepSeek sparse attention indexer without a routed layer)."""
    refuse_unrouted_indexers(model, adapter_for)
    for name, module in model.named_modules():
        cls = type(module).__name__
        if adapter_for(module) is None and any(cls.endswith(bad) for bad in UNSUPPORTED_RECURRENT):
            raise UnsupportedModelError(
                f"{type(model).__name__}.{name} is a {cls}: a recurrent layer ds_seqpar cannot split over the "
                f"sequence (supported: {supported_layers()}; a new family is one "
                "ds_seqpar.register_recurrent_layer(cls, forward))"
            )


def route_recurrent_layers(model: torch.nn.Module) -> int:
    """Give every registered recurrent layer of ``model`` its sequence-parallel forward (which, while a sharded
    cache decodes, steps one token through the class's ``recurrent_decoders.RECURRENT_DECODERS`` entry).

    Returns the number of routed layers. Raises ``UnsupportedModelError`` naming the module when the
    model has a recurrent layer kind ds_seqpar cannot split.
    """
    refuse_recurrent_layers(model)
    routed = 0
    for module in model.modules():
        forward = adapter_for(module)
        if forward is not None:
            module.forward = types.MethodType(with_decoding(forward), module)
            routed += 1
    return routed


def has_recurrent_layers(model: torch.nn.Module) -> bool:
    """Whether ``model`` has recurrent layers that ``route_recurrent_layers`` routes."""
    return any(adapter_for(m) is not None for m in model.modules())


def unroute_recurrent_layers(model: torch.nn.Module) -> None:
    """Restore the original forward of every routed layer."""
    for module in model.modules():
        if adapter_for(module) is not None and "forward" in module.__dict__:
            del module.forward
