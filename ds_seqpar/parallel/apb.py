"""APB and Star Attention: approximate prefill attention over the SP group (docs/inference.md "APB and Star
Attention"; the math and its single-process reference: ``ops/apb.py``).

Legend: P SP ranks, rank r holds the contiguous block of global positions [r·n, (r+1)·n); n_a = l_a + l_q
anchor rows (the first l_a tokens of the input, then the last l_q tokens: the embedded query) at
positions 0 .. n_a - 1; l_p passing length; B, H, H_kv, D as usual.

    rows q [B, n_a + n, H, D], k / v [B, n_a + n, H_kv, D] = [anchor rows ; local block rows]
      anchor rows: causal over the anchor rows only                       (no communication)
      select: l_p local keys per KV head scored by the query rows         (ops/apb.py)
      ONE all-gather over the SP group of the selected (K | V | position) bytes
      local rows: anchor prefix (r > 0) + keys passed by ranks < r + own block causal, merged by lse

Rank 0's first l_a tokens ARE the anchor: it never passes them and its rows do not see the anchor rows.
Star Attention is ``l_p = 0`` (no collective at all). Bytes sent per rank and layer (``all_gather``):
``(P - 1) · B · H_kv · b · ((D_k + D_v) · itemsize + 8)`` with b = min(l_p, n) (``apb_layer_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_seqpar.comm.collectives import all_gather_single
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.ops.apb import passing_scores, select_passing
from ds_seqpar.ops.attention import block_attn_forward, check_softcap
from ds_seqpar.ops.merge import apply_sink, merge_attn_
from ds_seqpar.parallel.ring import check_qkv, check_sinks

__all__ = ["ApbSpec", "apb_attention", "apb_layer_bytes"]

POS_BYTES = 8  # one int64 global position per passed entry


@dataclass(frozen=True)
class ApbSpec:
    """The APB parameters: ``anchor_len`` l_a, ``query_len`` l_q, ``passing_len`` l_p (0: Star Attention)."""

    anchor_len: int
    query_len: int
    passing_len: int

    @property
    def anchor_rows(self) -> int:
        return self.anchor_len + self.query_len

    def budget(self, block: int) -> int:
        """Entries per KV head each rank sends: ``min(l_p, n)`` (rank 0 pads its shorter candidate list)."""
        return min(self.passing_len, block)


def apb_layer_bytes(spec: ApbSpec, world: int, batch: int, block: int, h_kv: int, d_k: int, d_v: int,
                    itemsize: int) -> int:  # fmt: skip
    """Bytes one rank sends in one layer's all-gather (0 for Star Attention or P = 1)."""
    b = spec.budget(block)
    if world == 1 or b == 0:
        return 0
    return (world - 1) * batch * h_kv * b * ((d_k + d_v) * itemsize + POS_BYTES)


def _check(q, k, v, spec: ApbSpec, window, sinks) -> int:
    """Everything before the collective; returns the block length n."""
    check_qkv(q, k, v, "apb_attention")
    check_sinks(sinks, q, "apb_attention")
    for name in ("anchor_len", "query_len", "passing_len"):
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"apb_attention: {name}={value!r}; use an int >= 0")
    n = q.shape[1] - spec.anchor_rows
    if n < max(1, spec.anchor_len):
        raise ValueError(
            f"apb_attention: {q.shape[1]} rows hold {spec.anchor_rows} anchor rows (anchor_len {spec.anchor_len} + "
            f"query_len {spec.query_len}) and a block of {n}; the block must hold at least max(1, anchor_len) "
            "tokens (rank 0's block contains the anchor): lower anchor_len or use fewer ranks"
        )
    if spec.passing_len > 0 and spec.query_len == 0:
        raise ValueError(
            f"apb_attention: passing_len={spec.passing_len} with query_len=0; the passed keys are chosen by the "
            "query rows: set query_len >= 1, or passing_len=0 (Star Attention)"
        )
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"apb_attention: window={window!r}; use an int >= 1 or None")
    return n


def _band(rows: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """Bool ``[Sq, Sk]`` causal (+ window) mask from global positions ``rows [Sq]``, ``keys [Sk]``."""
    diff = rows.view(-1, 1) - keys.view(1, -1)
    return (diff >= 0) & (diff < window) if window is not None else diff >= 0


def _select(q_query, k_loc, v_loc, rank, spec, scale, softcap):
    """This rank's passing entries: ``keys [B, H_kv, b, D]``, ``values``, ``positions [B, H_kv, b]`` (local
    indices; -1 = padding on rank 0)."""
    n = k_loc.shape[1]
    start = spec.anchor_len if rank == 0 else 0
    b = spec.budget(n)
    take = min(b, n - start)
    idx = select_passing(passing_scores(q_query, k_loc[:, start:], scale, softcap), take) + start
    if take < b:
        pad = idx.new_full((*idx.shape[:2], b - take), -1)
        idx = torch.cat([idx, pad], dim=-1)
    gather = idx.clamp(min=0).unsqueeze(-1)
    kh, vh = k_loc.transpose(1, 2), v_loc.transpose(1, 2)  # [B, H_kv, n, D]
    keys = torch.gather(kh, 2, gather.expand(-1, -1, -1, kh.shape[-1]))
    values = torch.gather(vh, 2, gather.expand(-1, -1, -1, vh.shape[-1]))
    return keys, values, idx


def _exchange(mesh: SeqParMesh, keys, values, positions) -> torch.Tensor:
    """ONE all-gather over the SP group of the packed bytes ``[B, H_kv, b, (D_k + D_v)·itemsize + 8]``;
    returns ``[P, B, H_kv, b, row]`` uint8."""
    parts = [keys.contiguous(), values.contiguous(), positions.unsqueeze(-1).contiguous()]
    buf = torch.cat([t.view(torch.uint8) for t in parts], dim=-1)
    out = buf.new_empty((mesh.sp_size * buf.shape[0], *buf.shape[1:]))
    all_gather_single(out, buf, group=mesh.group("sp"))
    members = mesh.members["sp"]
    me = members[mesh.coords.sp_rank]
    mesh.comm_stats.record_tensors("all_gather", buf, peers=[p for p in members if p != me])
    return out.view(mesh.sp_size, *buf.shape)


def _unpack(gathered, rank, n, spec, d_k, d_v, dtype):
    """Keys ``[B, L, H_kv, D_k]``, values, global positions ``[B, H_kv, L]`` passed by the ranks < r (rank 0's
    padding dropped: it pads the same count on every head), L = min(b, n - l_a) + (r - 1)·b."""
    item = torch.empty((), dtype=dtype).element_size()
    kb, vb = d_k * item, d_v * item
    b = spec.budget(n)
    keys, values, positions = [], [], []
    for src in range(rank):
        part = gathered[src]  # [B, H_kv, b, row]
        if src == 0:
            part = part[:, :, : min(b, n - spec.anchor_len)]
        keys.append(part[..., :kb].contiguous().view(dtype))
        values.append(part[..., kb : kb + vb].contiguous().view(dtype))
        positions.append(part[..., kb + vb :].contiguous().view(torch.int64).squeeze(-1) + src * n)
    keys, values = torch.cat(keys, dim=2).transpose(1, 2), torch.cat(values, dim=2).transpose(1, 2)
    return keys, values, torch.cat(positions, dim=2)


def _over_passing(q_loc, keys, values, positions, row_pos, window, *, scale, softcap, kernel):
    """Local rows over the passed keys (per-KV-head key sets, all earlier than the rows): ``(out, lse)``; one
    call without a window, else one call per KV head masked by the window."""
    if window is None:
        return block_attn_forward(q_loc, keys, values, scale=scale, softcap=softcap, kernel=kernel)
    h_kv = keys.shape[2]
    g = q_loc.shape[2] // h_kv
    outs, lses = [], []
    for h in range(h_kv):
        pos = positions[:, h].unsqueeze(1)  # [B, 1, L]
        diff = row_pos.view(1, -1, 1) - pos
        mask = (diff >= 0) & (diff < window)
        out, lse = block_attn_forward(q_loc[:, :, h * g : (h + 1) * g], keys[:, :, h : h + 1],
                                      values[:, :, h : h + 1], scale=scale, mask=mask, softcap=softcap,
                                      kernel=kernel)  # fmt: skip
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=1)


def apb_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh: SeqParMesh,
    spec: ApbSpec,
    softmax_scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """APB attention of this rank's rows ``q [B, n_a + n, H, D]``, ``k, v [B, n_a + n, H_kv, D]`` (anchor rows
    first, then the local block; causal) -> ``out [B, n_a + n, H, D]`` in q's dtype. ``window``: query i sees
    key j iff 0 <= pos_i - pos_j < window (global positions); ``softcap``, ``sinks [H]`` as in
    ``ds_seqpar.attention``. Communicates one all-gather over the SP group (none when l_p = 0 or P = 1)."""
    n = _check(q, k, v, spec, window, sinks)
    softcap = check_softcap(softcap)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    kernel, rank, world = mesh.settings.kernel, mesh.coords.sp_rank, mesh.sp_size
    n_a, l_a = spec.anchor_rows, spec.anchor_len
    qa, ka, va = q[:, :n_a], k[:, :n_a], v[:, :n_a]
    ql, kl, vl = q[:, n_a:], k[:, n_a:], v[:, n_a:]
    apos = torch.arange(n_a, device=q.device)
    lpos = torch.arange(rank * n, (rank + 1) * n, device=q.device)
    common = {"scale": scale, "softcap": softcap, "kernel": kernel}
    amask = None if window is None else _band(apos, apos, window)
    anchor = block_attn_forward(qa, ka, va, mask=amask, causal=amask is None, **common)
    own_mask = None if window is None else _band(lpos, lpos, window)
    out, lse = block_attn_forward(ql, kl, vl, mask=own_mask, causal=own_mask is None, **common)
    if rank > 0 and l_a > 0:
        pre_mask = None if window is None else _band(lpos, apos[:l_a], window)
        merge_attn_(out, lse, *block_attn_forward(ql, ka[:, :l_a], va[:, :l_a], mask=pre_mask, **common))
    if world > 1 and spec.budget(n) > 0:
        keys, values, idx = _select(qa[:, l_a:], kl, vl, rank, spec, scale, softcap)
        gathered = _exchange(mesh, keys, values, idx)
        if rank > 0:
            pk, pv, ppos = _unpack(gathered, rank, n, spec, k.shape[-1], v.shape[-1], k.dtype)
            merge_attn_(out, lse, *_over_passing(ql, pk, pv, ppos, lpos, window, **common))
    out = torch.cat([anchor[0], out], dim=1)
    if sinks is not None:
        out, _ = apply_sink(out, torch.cat([anchor[1], lse], dim=2), sinks)
    return out.to(q.dtype)
