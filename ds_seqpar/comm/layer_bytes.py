"""The vocabulary of the closed-form byte model: one ring rank's share of a layer, and bytes per peer.

Legend (one ring rank, one layer):
    B, n     batch rows, tokens held by this rank
    h, h_kv  query / K/V heads on this rank,  D head dim
    b, a     bytes per element of q, k, v / of the accumulator dtype (``ops/precision.py``)
    E_q = B·n·h·D,  E_kv = B·n·h_kv·D  (elements of this rank's Q, and of one of its K or V)

``PeerBytes`` = {peer ring rank: {collective kind: bytes this rank sends to it}}, kinds ``p2p``,
``all_gather``, ``reduce_scatter``, ``all_to_all`` (as ``CommStats`` names them); zero entries, empty
peers and the rank itself are left out. A collective counts as the bytes this rank sends to each member.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_seqpar.ops.precision import accumulator_bytes

__all__ = ["KINDS", "LayerShape", "PeerBytes", "add_bytes"]

KINDS = ("p2p", "all_gather", "reduce_scatter", "all_to_all")

PeerBytes = dict[int, dict[str, int]]


@dataclass(frozen=True)
class LayerShape:
    """One ring rank's share of one attention layer: q [batch, tokens, heads, head_dim], k and v
    [batch, tokens, kv_heads, head_dim]; ``element_bytes`` of q/k/v, ``acc_bytes`` of the accumulators."""

    batch: int
    tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    element_bytes: int
    acc_bytes: int

    def __post_init__(self) -> None:
        for name in ("batch", "tokens", "heads", "kv_heads", "head_dim", "element_bytes", "acc_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LayerShape.{name} must be a positive int; got {value!r}")

    @classmethod
    def of(
        cls, batch: int, tokens: int, heads: int, kv_heads: int, head_dim: int, element_bytes: int
    ) -> LayerShape:
        """The shape with the accumulator dtype that goes with ``element_bytes``."""
        return cls(batch, tokens, heads, kv_heads, head_dim, element_bytes, accumulator_bytes(element_bytes))

    @property
    def q_elements(self) -> int:
        """E_q = B·n·h·D."""
        return self.batch * self.tokens * self.heads * self.head_dim

    @property
    def kv_elements(self) -> int:
        """E_kv = B·n·h_kv·D (one of K or V)."""
        return self.batch * self.tokens * self.kv_heads * self.head_dim

    @property
    def row_heads(self) -> int:
        """B·n·h: one value per query row and head (lse, Δ)."""
        return self.batch * self.tokens * self.heads


def add_bytes(out: PeerBytes, rank: int, peer: int, kind: str, nbytes: int) -> None:
    """Add ``nbytes`` of ``kind`` sent by ``rank`` to ``peer`` (nothing for 0 bytes or the rank itself)."""
    if nbytes and peer != rank:
        kinds = out.setdefault(peer, {})
        kinds[kind] = kinds.get(kind, 0) + nbytes
