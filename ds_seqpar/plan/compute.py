"""The compute model: seconds of one rank's share of a causal LM's training step, without communication
(docs/plan.md "The compute model").

Legend: S = tokens per sequence, P = SP degree = U·R, n = S / P tokens per rank, B = micro-batch, E =
hidden size, H / H_kv / D = query heads, K/V heads, head dim, I = MLP width one token uses (MoE: experts
per token × expert size), V = vocabulary, L = layers. FLOPs count a multiply-add as 2.

    attention   query-key pairs a rank computes per head, split into pairs of full blocks and the area of
                causal (diagonal) blocks: time = (full + causal_cost·causal_area)·(H/U)·4·D / attention_flops
                + calls·call_overhead; backward = attention_backward × forward
    linear      a decoder layer without its attention core (norms, q/k/v/o projections, RoPE, MLP, residuals)
                and the LM head with its loss: measured seconds per token (``--cluster local``) or, for a
                preset, matmul FLOPs / matmul_flops + elementwise bytes / memory_bw (fwd + bwd = 3 × fwd)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ds_seqpar.settings import model_value

__all__ = [
    "ELEMENTWISE_PASSES",
    "AttentionWork",
    "ModelDims",
    "documents_work",
    "zigzag_row_work",
    "zigzag_work",
]

# elementwise passes over one token's tensors in a layer's forward (norms, residuals, RoPE, SiLU x up,
# layout copies), each reading and writing: an assumption of the preset model (docs/plan.md)
ELEMENTWISE_PASSES = {"hidden": 24, "mlp": 5, "qkv": 8}


@dataclass(frozen=True)
class ModelDims:
    """The sizes of a Llama-style decoder that the planner reads from a transformers config."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int

    @staticmethod
    def read(config: Any, name: str = "model") -> ModelDims:
        """From a HF config (or its dict): hidden_size, num_attention_heads, num_key_value_heads, head_dim,
        intermediate_size (MoE: moe_intermediate_size × num_experts_per_tok), num_hidden_layers, vocab_size."""
        need = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
        missing = [k for k in need if model_value(config, k) is None]
        experts = model_value(config, "num_experts", model_value(config, "num_local_experts", 0)) or 0
        inter = model_value(config, "moe_intermediate_size" if experts else "intermediate_size")
        inter = inter if inter is not None else model_value(config, "intermediate_size")
        if inter is None:
            missing.append("intermediate_size")
        if missing:
            raise ValueError(
                f"the model config {name!r} has no {', '.join(missing)}; the planner models Llama-style "
                "decoders: pass a transformers config.json (or a model directory) that has them"
            )
        hidden, heads = (
            int(model_value(config, "hidden_size")),
            int(model_value(config, "num_attention_heads")),
        )
        if experts:
            inter = inter * int(model_value(config, "num_experts_per_tok", 1))
        return ModelDims(
            name,
            hidden,
            heads,
            int(model_value(config, "num_key_value_heads", heads)),
            int(model_value(config, "head_dim", hidden // heads)),
            int(inter),
            int(model_value(config, "num_hidden_layers")),
            int(model_value(config, "vocab_size")),
        )

    def layer_matmul_flops(self, tokens: float) -> float:
        """Forward FLOPs of one layer's projections (q, k, v, o) and MLP (gate, up, down) for ``tokens``."""
        e, d = self.hidden, self.head_dim
        attn = 2 * tokens * e * d * (2 * self.heads + 2 * self.kv_heads)
        return attn + self.mlp_matmul_flops(tokens)

    def mlp_matmul_flops(self, tokens: float) -> float:
        """Forward FLOPs of one layer's SwiGLU MLP."""
        return 2 * tokens * 3 * self.hidden * self.intermediate

    def head_matmul_flops(self, tokens: float) -> float:
        """Forward FLOPs of the LM head."""
        return 2 * tokens * self.hidden * self.vocab

    def layer_elementwise_bytes(self, tokens: float, element_bytes: int) -> float:
        """Bytes the elementwise ops of one layer's forward move (``ELEMENTWISE_PASSES``; an assumption)."""
        p = ELEMENTWISE_PASSES
        width = p["hidden"] * self.hidden + p["mlp"] * self.intermediate
        width += p["qkv"] * (self.heads + 2 * self.kv_heads) * self.head_dim
        return 2 * tokens * width * element_bytes


@dataclass(frozen=True)
class AttentionWork:
    """Query-key pairs one rank computes per head in one layer's forward: ``full`` = pairs of full
    blocks, ``causal_area`` = the area of causal (diagonal) blocks (they compute about half of it),
    ``calls`` = kernel calls, ``visible`` = visible pairs (the balance measure), ``side`` = tokens a side of
    the causal blocks (0: unknown; the profile's causal cost then holds for every side)."""

    full: float
    causal_area: float
    calls: int
    visible: float
    side: float = 0.0

    def cost(self, causal_cost: float) -> float:
        """Full-pair equivalents: a causal block of area A costs ``causal_cost`` × A."""
        return self.full + causal_cost * self.causal_area


def zigzag_work(seq_len: int, ring: int, batch: int = 1) -> AttentionWork:
    """One document of S tokens per row, zigzag over R ring ranks (every rank the same): rank r holds
    segments r and 2R−1−r of c = S/(2R) tokens; 2R−1 full c×c blocks and 2 causal ones. R = 1: the two
    segments are one run, one causal S×S block."""
    if ring == 1:
        visible = batch * seq_len * (seq_len + 1) / 2
        return AttentionWork(0.0, batch * float(seq_len) ** 2, batch, visible, float(seq_len))
    c = seq_len / (2 * ring)
    full = (2 * ring - 1) * c * c
    return AttentionWork(
        batch * full, batch * 2 * c * c, batch * (2 * ring + 1), batch * (full + c * (c + 1)), c
    )


def _range_work(docs: Sequence[tuple[int, int]], lo: int, hi: int) -> float:
    """Visible causal pairs of the query tokens in [lo, hi) of a packed row (``docs`` = (start, length))."""
    total = 0.0
    for start, length in docs:
        a, b = max(lo, start), min(hi, start + length)
        if a < b:  # token at offset t of its document sees t + 1 keys
            ta, tb = a - start, b - start
            total += (tb * (tb + 1) - ta * (ta + 1)) / 2
    return total


def _starts(lengths: Sequence[int]) -> list[tuple[int, int]]:
    out, pos = [], 0
    for length in lengths:
        out.append((pos, int(length)))
        pos += int(length)
    return out


def zigzag_row_work(lengths: Sequence[int], seq_len: int, ring: int) -> AttentionWork:
    """A packed row (documents of ``lengths``, padding to S) zigzagged over R ranks: the slowest rank's
    visible pairs; every pair is counted at the causal rate (area = 2 × pairs: blocks cut by documents)."""
    docs = _starts(lengths)
    c = seq_len / (2 * ring)
    per_rank = [
        _range_work(docs, int(r * c), int((r + 1) * c))
        + _range_work(docs, int((2 * ring - 1 - r) * c), int((2 * ring - r) * c))
        for r in range(ring)
    ]
    worst = max(per_rank)
    return AttentionWork(0.0, 2 * worst, max(1, len(lengths)) * (2 * ring + 1) // ring, worst)


def documents_work(lengths: Sequence[int], ring: int, balance: float) -> AttentionWork:
    """A packed row placed by documents (docs/balance.md): the mean visible pairs per rank × ``balance``
    (max / mean of the placement), counted at the causal rate."""
    total = sum(length * (length + 1) / 2 for length in lengths)
    worst = total / ring * (balance if ring > 1 else 1.0)
    return AttentionWork(0.0, 2 * worst, max(1, len(lengths)) * (2 * ring + 1) // ring, worst)
