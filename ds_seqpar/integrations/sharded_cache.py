"""A KV cache split across the SP group: what ``ds_seqpar.prefill`` leaves and decoding reads (docs/inference.md).

Legend: P SP ranks, B batch, H_kv key/value heads, D / D_v key / value head dims, n_r the entries this rank
holds of one layer, t the global index (row position) of the token being decoded.

Every rank keeps the K/V of its own prompt tokens (RoPE applied, as the attention layer received them),
sorted by global index, in buffers with room to grow; a decoded token's K/V go to ONE rank, ``t mod P``
(round robin), so the shards stay balanced. Nothing is communicated here: the decoding attention
(``parallel/decode.py``) merges the ranks' partial results. Recurrent layers keep their state in
``states`` (layer index -> the layer's own object), replicated on every rank.
"""

from __future__ import annotations

import bisect
from array import array
from dataclasses import dataclass, field
from typing import Any

import torch

from ds_seqpar.mesh import SeqParMesh

__all__ = ["LayerShard", "ShardedCache"]


@dataclass
class LayerShard:
    """One attention layer's entries on this rank: ``keys [B, H_kv, cap, D]``, ``values [B, H_kv, cap, D_v]``,
    their global indices ``positions`` (a host ``array('q')`` of ``length`` ascending entries: window starts are
    found by bisection, no device read), and, for packed prompts, their document ids ``docs [B, cap]``; the
    first ``length`` slots are filled."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: array
    docs: torch.Tensor | None
    length: int

    def _grow(self, need: int) -> None:
        cap = self.keys.shape[2]
        if need <= cap:
            return
        more = max(need, 2 * cap, 16) - cap

        def pad(x: torch.Tensor, dim: int) -> torch.Tensor:
            shape = list(x.shape)
            shape[dim] = more
            return torch.cat([x, x.new_zeros(shape)], dim=dim)

        self.keys, self.values = pad(self.keys, 2), pad(self.values, 2)
        self.docs = None if self.docs is None else pad(self.docs, 1)

    def append(self, key: torch.Tensor, value: torch.Tensor, index: int, doc: torch.Tensor | None) -> None:
        """Store one token's ``key [B, H_kv, 1, D]`` / ``value`` at global index ``index`` (larger than any held)."""
        self._grow(self.length + 1)
        i = self.length
        self.keys[:, :, i : i + 1] = key
        self.values[:, :, i : i + 1] = value
        self.positions.append(index)
        if self.docs is not None:
            self.docs[:, i] = doc
        self.length += 1

    def visible(self, first: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The entries with global index >= ``first`` (host bisection, no device sync): keys, values, docs."""
        start = bisect.bisect_left(self.positions, first) if first > 0 else 0
        docs = None if self.docs is None else self.docs[:, start : self.length]
        return self.keys[:, :, start : self.length], self.values[:, :, start : self.length], docs

    def bytes(self) -> int:
        n = self.length
        per = (self.keys[:, :, :1].numel() * self.keys.element_size()) + (
            self.values[:, :, :1].numel() * self.values.element_size()
        )
        return n * per


@dataclass
class ShardedCache:
    """This rank's part of the KV cache of one batch of prompts.

    ``seq_len``: tokens of every row so far (prompt + decoded); ``order`` / ``kept``: the global indices of this
    rank's prompt rows as the attention layers receive them, and which of them are real tokens (right padding
    to the layout's multiple is dropped) — set by ``prefill``; ``last_doc [B]``: the document the decoded tokens
    continue (packed prompts), else None; ``next_positions [B]``: the position id (RoPE) of each row's next token;
    ``reserve``: free slots each layer allocates at prefill.
    ``decoding``: True while a decoding step runs (the attention layers append and read instead of storing).
    """

    mesh: SeqParMesh
    seq_len: int
    order: torch.Tensor
    kept: torch.Tensor
    docs: torch.Tensor | None = None
    last_doc: torch.Tensor | None = None
    next_positions: torch.Tensor | None = None
    reserve: int = 0
    layers: dict[int | tuple[int, int], LayerShard] = field(default_factory=dict)
    states: dict[int, Any] = field(default_factory=dict)
    decoding: bool = False

    @property
    def owner(self) -> int:
        """The SP rank that stores the token being decoded (index ``seq_len``): round robin."""
        return self.seq_len % self.mesh.sp_size

    def store(self, layer: int | tuple[int, int], key: torch.Tensor, value: torch.Tensor) -> None:
        """Prefill: keep this rank's ``key [B, H_kv, n, D]`` / ``value [B, H_kv, n, D_v]`` of layer ``layer``
        (rows in ``order``), padding dropped, sorted by global index, with ``reserve`` free slots."""
        if layer in self.layers:
            raise RuntimeError(f"ds_seqpar prefill: layer {layer} stored its keys twice in one forward")
        if key.shape[2] != self.order.numel():
            raise RuntimeError(
                f"ds_seqpar prefill: layer {layer} passed {key.shape[2]} keys for {self.order.numel()} local tokens"
            )
        rows = torch.argsort(self.order[self.kept])
        index = torch.nonzero(self.kept).flatten()[rows]
        n, cap = index.numel(), index.numel() + self.reserve
        keys = key.new_zeros(*key.shape[:2], cap, key.shape[3])
        values = value.new_zeros(*value.shape[:2], cap, value.shape[3])
        keys[:, :, :n] = key.index_select(2, index.to(key.device))
        values[:, :, :n] = value.index_select(2, index.to(value.device))
        positions = array("q", self.order[index].tolist())
        docs = None
        if self.docs is not None:
            docs = key.new_zeros(self.docs.shape[0], cap, dtype=self.docs.dtype)
            docs[:, :n] = self.docs[:, self.order[index].to(self.docs.device)].to(key.device)
        self.layers[layer] = LayerShard(keys, values, positions, docs, n)

    def read(
        self, layer: int | tuple[int, int], key: torch.Tensor, value: torch.Tensor, window: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Decoding: store the new token's ``key / value [B, H_kv, 1, D]`` if this rank owns it, then return the
        entries the new token sees — keys, values and a ``[B, n]`` document mask (None: all visible)."""
        shard = self.layers.get(layer)
        if shard is None:
            raise RuntimeError(
                f"ds_seqpar decoding: layer {layer} has no cache entries; it made no attention call during prefill"
            )
        t = self.seq_len
        if self.owner == self.mesh.coords.sp_rank:
            shard.append(key, value, t, self.last_doc)
        first = 0 if window is None else t - window + 1
        keys, values, docs = shard.visible(first)
        mask = None if docs is None else docs == self.last_doc.to(docs.device)[:, None]
        return keys, values, mask

    def bytes(self) -> int:
        """Bytes of the cached K/V entries on this rank (recurrent states not counted)."""
        return sum(shard.bytes() for shard in self.layers.values())
