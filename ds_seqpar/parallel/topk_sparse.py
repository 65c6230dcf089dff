"""DeepSeek sparse attention (DSA) over the SP group: all-gather CP (docs/dsa.md).

Each rank keeps its n = S / P query tokens in the input layout (``settings.input_layout``; zigzag or any
other order); what every query may select from is the whole sequence, so:

    1. the indexer keys ``[B, n, D_i]`` of every rank are all-gathered (no gradient: the indexer is not
       trained by the attention) and put in global order: ``[B, S, D_i]``;
    2. each rank scores its queries over the S keys exactly as one process does (``ops/sparse/topk``) and
       keeps the top-k visible keys per query (global positions ``[B, n, K]``): the same set as one process;
    3. the layer's keys and values (or a latent they are expanded from) are all-gathered with autograd
       (backward: one reduce-scatter of their gradients) and each rank attends its queries over their
       selected keys.

Bytes per rank and layer (P ranks, B·n local tokens, itemsizes e_i / e_kv, widths D_i of the indexer key
and W of what is gathered for the attention, e.g. MLA's kv_lora_rank + qk_rope_head_dim):

    forward   all_gather      (P-1) · B·n · (D_i·e_i + W·e_kv)
    backward  reduce_scatter  (P-1) · B·n · W·e_kv

``SequenceGather`` holds what one forward's DSA layers share (the team, the global order, the visibility of
this rank's queries); ``dsa_select`` is steps 1-2.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_seqpar.comm.team import TeamComm
from ds_seqpar.comm.token_gather import gather_tokens
from ds_seqpar.ops.masks import MaskSpec, token_mask
from ds_seqpar.ops.sparse.topk import indexer_scores, select_topk
from ds_seqpar.settings import input_layout

__all__ = ["SequenceGather", "dsa_select"]


class SequenceGather:
    """The SP group's tokens in global order, for this rank's queries.

    ``gather(x [B, n, ...], grad)`` -> ``[B, S, ...]`` in global order; ``visible`` ``[B|1, n, S]`` bool: the
    keys each local query may see (causal in global positions, same document, no padding); ``q_pos [n]``.
    """

    def __init__(
        self, mesh: Any, seq_len_local: int, doc_ids: torch.Tensor | None, device: torch.device
    ) -> None:
        p, me = mesh.sp_size, mesh.coords.sp_rank
        self.seq_len = seq_len = seq_len_local * p
        layout = input_layout(mesh, doc_ids)
        order = torch.cat([layout.local_positions(seq_len, r) for r in range(p)])
        if not torch.equal(order.sort().values, torch.arange(seq_len)):
            raise ValueError(
                f"the input layout {type(layout).__name__} does not give each of the {p} SP ranks its own "
                f"{seq_len_local} of the {seq_len} tokens; DeepSeek sparse attention gathers the whole sequence"
            )
        self.inverse = torch.argsort(order).to(device)  # gathered row of global position t
        self.q_pos = layout.local_positions(seq_len, me).to(device)
        k_pos = torch.arange(seq_len, device=device)
        q_pos, q_doc, k_doc = self.q_pos, None, None
        if doc_ids is not None:
            k_doc = doc_ids.to(device)
            q_doc = k_doc[..., self.q_pos]
            q_pos, k_pos = q_pos.expand_as(q_doc), k_pos.expand_as(k_doc)
        mask = token_mask(q_pos, k_pos, MaskSpec(causal=True), q_doc, k_doc)
        self.visible = mask if mask.dim() == 3 else mask.unsqueeze(0)
        self.team = TeamComm(mesh.group("sp"), mesh.members["sp"], me, mesh.comm_stats)

    def gather(self, x: torch.Tensor, grad: bool = True) -> torch.Tensor:
        """``x [B, n, ...]`` of every rank, in global order ``[B, S, ...]``; ``grad``: see ``gather_tokens``."""
        return gather_tokens(x, self.team, grad=grad).index_select(1, self.inverse)


def dsa_select(
    seq: SequenceGather,
    q: torch.Tensor,
    k_local: torch.Tensor,
    weights: torch.Tensor,
    scale: float,
    topk: int,
) -> torch.Tensor:
    """Global key positions ``[B, n, K]`` selected for this rank's queries: indexer queries ``q [B, n, H_i, D_i]``,
    this rank's indexer keys ``k_local [B, n, D_i]`` (gathered here, no gradient), head weights
    ``weights [B, n, H_i]`` (fp32); the same set as one process selects for these queries."""
    with torch.no_grad():
        k = seq.gather(k_local, grad=False)
        return select_topk(indexer_scores(q, k, weights, scale), seq.visible, topk)
