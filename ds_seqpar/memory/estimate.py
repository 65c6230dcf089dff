"""The memory model: predicted peak bytes per rank of one training step, by category (docs/memory.md).

Legend: P = SP degree, n = S / P local tokens, B = micro-batch, E = hidden size, H / H_kv / D = query heads,
K/V heads, head dim, I = MLP intermediate size (MoE: experts per token x expert size), V = vocabulary,
L = decoder layers, b = bytes per activation element, W = ranks of the ZeRO group, N = parameters.

Activations are counted in the sizes of one rank's tensors: a hidden state ``h = B·n·E·b``, queries
``a_q = B·n·H·D·b``, keys or values ``a_kv``, an MLP intermediate ``B·n·I·b``. What each module of a
Llama-style layer keeps for backward, and which phase of the step holds the peak (a layer's attention
backward, its MLP backward, or the loss), is in docs/memory.md ("The memory model"); the counts were
read off live-tensor traces of the step (``ds_seqpar/memory/trace.py``), and the memory suite
compares prediction and measurement at every probe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ds_seqpar.config import SequenceParallelConfig, parse_section
from ds_seqpar.settings import SeqParSettings, model_value

LOSS_CHUNK_TENSORS = 4  # fp32 [B, c, V] tensors of one logits chunk: logits, log-softmax, their gradients


@dataclass
class MemoryEstimate:
    """Predicted bytes per rank. ``device`` categories add up to ``device_peak``; ``host`` is the
    offloaded checkpoints (host memory, not on the device)."""

    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    resting: set[str] = field(default_factory=set)  # device categories allocated before the step
    phase: str = ""  # where the step's peak is: "layer backward" or "loss"

    @property
    def device_peak(self) -> int:
        return sum(self.device.values())

    @property
    def activation_peak(self) -> int:
        """The part that grows with the sequence (activations, checkpoints on the device, logits chunk)."""
        return sum(
            v for k, v in self.device.items() if k.startswith(("activations", "checkpoints", "logits"))
        )

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    def step_bytes(self) -> int:
        """What one step allocates on top of the resting state (parameters, optimizer states, persistent
        gradients, and the pooled host buffers of the offloaded checkpoints, which the first step
        allocates and later steps reuse): the growth a step shows."""
        return sum(v for k, v in self.device.items() if k not in self.resting)

    def table(self) -> str:
        rows = [f"  {k:<58} {v / 2**20:10.1f} MiB" for k, v in self.device.items()]
        rows.append(f"  {'= device peak per rank':<58} {self.device_peak / 2**20:10.1f} MiB")
        rows += [f"  {k + ' (host)':<58} {v / 2**20:10.1f} MiB" for k, v in self.host.items()]
        return "\n".join(rows)


@dataclass(frozen=True)
class _Dims:
    """The sizes of a Llama-style decoder that the model reads (``inter``: the MLP width one token uses,
    ``experts`` x the expert size over ``experts_per_token`` for MoE)."""

    hidden: int
    vocab: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    experts: int
    expert_inter: int
    tied: bool

    @staticmethod
    def read(cfg: Any) -> _Dims:
        missing = [k for k in ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads")
                   if model_value(cfg, k) is None]  # fmt: skip
        experts = model_value(cfg, "num_experts", model_value(cfg, "num_local_experts", 0)) or 0
        expert_inter = (
            model_value(cfg, "moe_intermediate_size", model_value(cfg, "intermediate_size")) if experts else 0
        )
        dense_inter = model_value(cfg, "intermediate_size")
        if (expert_inter if experts else dense_inter) is None:
            missing.append("moe_intermediate_size" if experts else "intermediate_size")
        if missing:
            raise ValueError(
                f"memory_estimate: the model config has no {', '.join(missing)}; it models Llama-style decoders "
                "(hidden_size, intermediate_size, heads, layers, vocab_size): pass a config or dict with them"
            )
        e, h = model_value(cfg, "hidden_size"), model_value(cfg, "num_attention_heads")
        inter = expert_inter * model_value(cfg, "num_experts_per_tok", 1) if experts else dense_inter
        return _Dims(
            e, model_value(cfg, "vocab_size"), model_value(cfg, "num_hidden_layers"), h, model_value(cfg, "num_key_value_heads", h),
            model_value(cfg, "head_dim", e // h), inter, experts, expert_inter, bool(model_value(cfg, "tie_word_embeddings", False)),
        )  # fmt: skip

    def params(self) -> tuple[int, int]:
        """(all parameters, parameters of one decoder layer)."""
        e = self.hidden
        mlp = (
            3 * e * self.expert_inter * self.experts + e * self.experts
            if self.experts
            else 3 * e * self.inter
        )
        layer = e * self.head_dim * (2 * self.heads + 2 * self.kv_heads) + mlp + 2 * e
        embed = self.vocab * e * (1 if self.tied else 2)
        return embed + self.layers * layer + e, layer


def memory_estimate(
    model_config: Any,
    seq_len: int,
    config: Any,
    *,
    world_size: int | None = None,
    zero_stage: int = 3,
    micro_batch: int = 1,
    bytes_per_element: int = 4,
    loss_chunk: int = 1024,
    optimizer_states: int = 2,
) -> MemoryEstimate:
    """Predicted peak bytes per rank of one step (forward, backward, optimizer) of a causal LM.

    Args:
        model_config: the HF config (or a dict) of a Llama-style decoder (MoE: ``num_experts`` /
            ``num_local_experts``, ``moe_intermediate_size``, ``num_experts_per_tok``).
        seq_len: S, tokens per sequence (split over the ``size`` SP ranks).
        config: the ``sequence_parallel`` section (``SequenceParallelConfig`` or a dict, resolved against
            the model) or its ``SeqParSettings``: its ``memory`` settings and U decide what is kept.
        world_size: ranks in the ZeRO group (default: ``size``); zero_stage: 0-3.
        bytes_per_element: 4 (fp32) or 2 (bf16 / fp16 activations and parameters; master weights,
            gradients and optimizer states are counted in fp32).
        loss_chunk: tokens per logits chunk; optimizer_states: fp32 states per parameter (AdamW: 2).
    """
    if zero_stage not in (0, 1, 2, 3) or bytes_per_element not in (2, 4):
        raise ValueError(
            f"memory_estimate: zero_stage={zero_stage!r} must be 0-3 and bytes_per_element={bytes_per_element!r} "
            "2 (bf16 / fp16) or 4 (fp32)"
        )
    settings = _settings(config, model_config)
    dims = _Dims.read(model_config)
    sizes = _activation_sizes(settings, dims, seq_len, micro_batch, bytes_per_element, loss_chunk)
    est = MemoryEstimate()
    _add_model_states(est, dims, world_size or settings.size, zero_stage, bytes_per_element, optimizer_states)
    _add_activations(est, settings.memory, dims.layers, sizes)
    return est


def _settings(config: Any, model_config: Any) -> SeqParSettings:
    if isinstance(config, SeqParSettings):
        return config
    section = config if isinstance(config, SequenceParallelConfig) else parse_section(config)
    return section.validate(model_config, None)


@dataclass(frozen=True)
class _Tensors:
    """Bytes of one rank's tensors on ``n`` tokens (docs/memory.md "The memory model", symbol table)."""

    h: int  # hidden state [B, n, E]
    a_q: int  # queries or the attention output, all heads [B, n, H, D]
    a_kv: int  # keys or values in the head layout (K/V heads replicated when U > H_kv)
    kv: int  # keys or values in the token layout [B, n, H_kv, D]: what a K/V cache keeps per layer
    lse: int  # fp32 [B, n, H]
    m: int  # one MLP intermediate [B, n, I]
    rope: int  # RoPE's cos and sin [B, n, D]

    @staticmethod
    def of(dims: _Dims, n: int, batch: int, b: int, u: int) -> _Tensors:
        d = dims.head_dim
        return _Tensors(
            batch * n * dims.hidden * b, batch * n * dims.heads * d * b, batch * n * max(dims.kv_heads, u) * d * b,
            batch * n * dims.kv_heads * d * b, batch * n * dims.heads * 4, batch * n * dims.inter * b,
            2 * batch * n * d * b,
        )  # fmt: skip


@dataclass(frozen=True)
class _Sizes:
    """Bytes of one rank's tensors of one layer, and of the step's peaks (docs/memory.md "The memory model")."""

    h: int  # one hidden state
    rope: int  # cos, sin (shared by the layers)
    norm_kept: int
    attn_kept: int
    layer_kept: int
    attn_backward: int
    mlp_backward: int
    final_norm: int
    logits: int
    token_out: int
    mlp_kept: int


def _activation_sizes(
    settings: SeqParSettings, dims: _Dims, seq_len: int, batch: int, b: int, loss_chunk: int
) -> _Sizes:
    p, u, mem = settings.size, settings.ulysses_degree, settings.memory
    r, n = p // u, math.ceil(seq_len / p)
    t = _Tensors.of(dims, n, batch, b, u)
    h, a_q, a_kv, lse, mlp_act = t.h, t.a_q, t.a_kv, t.lse, t.m
    tile = min(n, mem.mlp_tile_tokens)
    norm_kept = h if mem.tiled_norms else 2 * h  # output (+ the normalised input when not tiled)
    # q, k, v, lse (head layout), and the output, except with R > 1: the ring's backward then runs on
    # rowsum(dout · out), and the output is kept in the token layout only (parallel/usp.py)
    attn_kept = a_q + 2 * a_kv + lse + (a_q if r == 1 else 0)
    token_out = a_q if p > 1 else 0  # the output again in the token layout (o_proj's input)
    mlp_kept = 0 if mem.tiled_mlp else 4 * mlp_act  # gate, up, activation, product
    # kept per layer: two norms, attention, MLP, and the residual sum the second norm reads; the layer's
    # output is the next layer's input (a re-run layer's output is freed before its backward)
    layer_kept = 2 * norm_kept + attn_kept + token_out + mlp_kept + h
    # R > 1: dout, the dq and dK/dV accumulators, the K/V block received, and one dK (or dV) arriving
    # while the accumulators move on (the backward's tiles are 1/16 of a segment pair: left out).
    # R = 1: dout (+ copy), dq, dk, dv.
    attn_backward = 2 * a_q + 5 * a_kv if r > 1 else 3 * a_q + 2 * a_kv
    # the MLP's backward: a tile's intermediates re-run (gate, up, activation, product) and one gradient,
    # or, untiled, two gradients of [n, I] next to the kept intermediates
    mlp_backward = 5 * batch * tile * dims.inter * b if mem.tiled_mlp else 2 * mlp_act
    final_norm = h if mem.tiled_norms else 2 * h
    logits = LOSS_CHUNK_TENSORS * batch * min(loss_chunk, n) * dims.vocab * 4
    return _Sizes(h, t.rope, norm_kept, attn_kept, layer_kept, attn_backward, mlp_backward, final_norm, logits,
                  token_out, mlp_kept)  # fmt: skip


def _add_model_states(
    est: MemoryEstimate, dims: _Dims, world: int, zero_stage: int, b: int, states: int
) -> None:
    """Parameters, gradients, optimizer states and master weights as ZeRO partitions them."""
    n_params, layer_params = dims.params()
    shard = world if zero_stage >= 3 else 1
    est.device["parameters (ZeRO shard)"] = n_params * b // shard
    est.resting.add("parameters (ZeRO shard)")
    if zero_stage >= 3:
        est.device["parameters (one layer gathered)"] = layer_params * b
    est.device["gradients"] = n_params * 4 // (world if zero_stage >= 2 else 1)
    if zero_stage >= 1:
        est.resting.add("gradients")  # DeepSpeed keeps its (partitioned) gradient buffers
    est.device["optimizer states"] = states * n_params * 4 // (world if zero_stage >= 1 else 1)
    est.resting.add("optimizer states")
    if b < 4:
        est.device["fp32 master weights"] = n_params * 4 // (world if zero_stage >= 1 else 1)
        est.resting.add("fp32 master weights")


def _add_activations(est: MemoryEstimate, mem: Any, layers: int, s: _Sizes) -> None:
    """The activations the step keeps and its peak phase (checkpointed: one layer re-run at a time)."""
    if mem.activation_checkpointing:
        on_device = 1 if mem.offload else layers  # offload: only the last layer's input stays
        est.device["checkpoints (layer inputs)"] = on_device * s.h
        if mem.offload and layers > 1:
            est.host["checkpoints (layer inputs)"] = (layers - 1) * s.h
        phases = {  # 2h: the layer's output gradient and the one summed at its residual
            "attention backward": 2 * s.h + s.norm_kept + s.attn_kept + s.attn_backward + s.rope,
            "MLP backward": 2 * s.h + s.layer_kept + s.mlp_backward + s.rope,
            "loss": s.final_norm + s.h + s.logits,
        }
        est.phase = max(phases, key=phases.__getitem__)
        est.device[f"activations (one layer re-run, peak in {est.phase})"] = phases[est.phase]
        return
    est.device["activations (all layers)"] = layers * (s.layer_kept + s.h)  # + each layer's output
    phases = {
        "backward start": s.final_norm + s.rope + 3 * s.h,
        # the last layer's attention backward: its MLP and second norm are freed by then
        "attention backward": s.rope + 2 * s.h + s.attn_backward - s.token_out - s.mlp_kept - s.norm_kept,
        "loss": s.final_norm + s.rope + s.logits,
    }
    est.phase = max(phases, key=phases.__getitem__)
    est.device[f"activations (peak in {est.phase})"] = phases[est.phase]


def largest_seq_len(
    model_config: Any, config: Any, budget_bytes: int, *, multiple: int = 1, **kwargs: Any
) -> int:
    """The largest S (a multiple of ``multiple``) whose predicted device peak fits ``budget_bytes``; 0 if none."""
    lo, hi = 0, multiple
    while memory_estimate(model_config, hi, config, **kwargs).device_peak <= budget_bytes and hi < 2**34:
        lo, hi = hi, hi * 2
    while hi - lo > multiple:
        mid = (lo + hi) // 2 // multiple * multiple
        if mid <= lo:
            break
        if memory_estimate(model_config, mid, config, **kwargs).device_peak <= budget_bytes:
            lo = mid
        else:
            hi = mid
    return lo
