"""The block-sparse kernel of non-causal (DiT) attention: one (query shard, key shard) pair under a
``BlockPattern`` (docs/dit_sparse.md "The kernel"), with the block-kernel contract of
``ops/attention/contract.py`` (out / lse forward; gradients from the FINAL out / lse of the rows).

    forward   (q [B, Sq, H, D], k, v [B, Sk, H_kv, D], q_pos [Sq], k_pos [Sk], pattern, *, scale, spec,
               q_doc, k_doc, softcap) -> out [B, Sq, H, D], lse [B, H, Sq] (fp32; fp64 for fp64), pairs
    backward  (dout, q, k, v, out, lse, q_pos, k_pos, pattern, *, ...) -> dq, dk, dv

When both shards are made of whole G-aligned blocks, each (row, head, query block) gathers only its kept
key blocks; query blocks with the same number c of kept key blocks form one batched product
``[N, G, D] x [N, D, c·G]`` (no padding, no block mask). Other shards run one exact token-masked product
(as slow as dense). Document ids mask inside the gathered blocks (same document, padding < 0 never seen;
a query that sees nothing gets out 0, lse -inf). Host syncs: the pattern becomes index lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_seqpar.ops.masks import MaskSpec
from ds_seqpar.ops.sparse.block_pattern import BlockPattern

__all__ = ["DIT_BLOCK_KERNEL", "block_sparse_backward", "block_sparse_forward"]

NON_CAUSAL = MaskSpec(causal=False)
ROWS_PER_CALL = 1 << 22  # score elements of one batched product (bounds the temporary memory)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(q, k, q_pos, k_pos, pattern, spec, softcap) -> None:
    if not isinstance(pattern, BlockPattern):
        raise TypeError(f"the DiT block kernel takes a BlockPattern, got {type(pattern).__name__}")
    if spec.causal or spec.window is not None or softcap is not None:
        raise ValueError(
            f"the DiT block kernel is non-causal without window or softcap; got {spec!r}, softcap={softcap!r}"
        )
    if pattern.num_heads != q.shape[2] or pattern.batch not in (1, q.shape[0]):
        raise ValueError(
            f"the block pattern covers B={pattern.batch}, H={pattern.num_heads} but q is {tuple(q.shape)}; "
            "take the pattern of the same heads (after the head permutation / Ulysses split)"
        )
    if q_pos.numel() != q.shape[1] or k_pos.numel() != k.shape[1]:
        raise ValueError(f"q_pos / k_pos ({q_pos.numel()}, {k_pos.numel()}) must match q / k rows")


def _whole_blocks(pos: torch.Tensor, g: int) -> bool:
    """Whether ``pos`` is a run of whole, G-aligned blocks (each block's tokens consecutive, in order)."""
    if pos.numel() % g:
        return False
    tiles = pos.view(-1, g)
    return bool((tiles[:, 0] % g == 0).all()) and bool(
        (tiles == tiles[:, :1] + torch.arange(g, device=pos.device)).all()
    )


@dataclass
class _TokenMask:
    """Visibility ``[B, H, Sq, Sk]`` of a pair whose shards are not whole blocks, and its documents."""

    tok: torch.Tensor
    q_doc: torch.Tensor | None
    k_doc: torch.Tensor | None


@dataclass
class _Pair:
    """The pair cut into tiles: ``q`` ``[B·nq·H, Gq, D]``, ``k`` / ``v`` ``[B·nk·H_kv, Gk, D]``, docs
    ``[B·nq, Gq]`` / ``[B·nk, Gk]`` (or None), and the kept tiles ``sub [B, H, nq, nk]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_doc: torch.Tensor | None
    k_doc: torch.Tensor | None
    sub: torch.Tensor
    shape: tuple[int, ...]  # B, nq, Gq, H, nk, Gk, H_kv, D
    token: _TokenMask | None = None  # shards that are not whole blocks: the token visibility


def _tiles(x: torch.Tensor, n: int, acc: torch.dtype) -> torch.Tensor:
    b, s, h, d = x.shape
    return x.to(acc).view(b, n, s // n, h, d).permute(0, 1, 3, 2, 4).reshape(b * n * h, s // n, d)


def _doc_tiles(doc: torch.Tensor | None, b: int, n: int) -> torch.Tensor | None:
    return None if doc is None else doc.expand(b, -1).reshape(b * n, -1)


def _pair(q, k, v, q_pos, k_pos, pattern: BlockPattern, q_doc, k_doc) -> _Pair:
    b, sq, h, d = q.shape
    sk, hkv, g, acc = k.shape[1], k.shape[2], pattern.block_size, _acc(q.dtype)
    if _whole_blocks(q_pos, g) and _whole_blocks(k_pos, g):
        nq, nk = sq // g, sk // g
        qb, kb = q_pos.view(-1, g)[:, 0] // g, k_pos.view(-1, g)[:, 0] // g
        sub = pattern.mask[:, :, qb][:, :, :, kb].expand(b, -1, -1, -1)
        tiles = (_tiles(q, nq, acc), _tiles(k, nk, acc), _tiles(v, nk, acc))
        docs = (_doc_tiles(q_doc, b, nq), _doc_tiles(k_doc, b, nk))
        return _Pair(*tiles, *docs, sub, (b, nq, sq // nq, h, nk, sk // nk, hkv, d))
    nq = nk = 1  # one tile per shard under the token mask
    sub = torch.ones(b, h, 1, 1, dtype=torch.bool, device=q.device)
    token = _TokenMask(pattern.visible(q_pos, k_pos).expand(b, -1, -1, -1), q_doc, k_doc)
    tiles = (_tiles(q, nq, acc), _tiles(k, nk, acc), _tiles(v, nk, acc))
    return _Pair(*tiles, None, None, sub, (b, nq, sq, h, nk, sk, hkv, d), token)


def _mask(pair: _Pair, rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor | None:
    """Bool ``[N, Gq, c·Gk]`` for the gathered rows (row ids ``rows [N, 3]`` = (b, h, i); key tiles ``idx``)."""
    b_i, h_i, q_i = rows.unbind(1)
    _, nq, _, _, nk, _, _, _ = pair.shape
    if pair.token is not None:  # token fallback: one tile per shard
        tm = pair.token
        m = tm.tok[b_i, h_i]
        if tm.q_doc is not None:
            qd, kd = tm.q_doc.expand(tm.tok.shape[0], -1)[b_i], tm.k_doc.expand(tm.tok.shape[0], -1)[b_i]
            m = m & (qd[:, :, None] == kd[:, None, :]) & (qd >= 0)[:, :, None] & (kd >= 0)[:, None, :]
        return m
    if pair.q_doc is None:
        return None
    qd = pair.q_doc[b_i * nq + q_i]  # [N, Gq]
    kd = pair.k_doc[(b_i[:, None] * nk + idx).reshape(-1)].view(idx.shape[0], -1)  # [N, c·Gk]
    return (qd[:, :, None] == kd[:, None, :]) & (qd >= 0)[:, :, None] & (kd >= 0)[:, None, :]


def _groups(pair: _Pair):
    """Yield (rows [N, 3] = (b, h, i), key tiles idx [N, c]) per kept count c, chunked by memory."""
    counts = pair.sub.sum(-1)  # [B, H, nq]
    gq, gk = pair.shape[2], pair.shape[5]
    for c in torch.unique(counts).tolist():
        if c == 0:
            continue
        rows = (counts == c).nonzero()
        step = max(1, ROWS_PER_CALL // (gq * gk * c))
        for s in range(0, rows.shape[0], step):
            r = rows[s : s + step]
            idx = pair.sub[r[:, 0], r[:, 1], r[:, 2]].nonzero()[:, 1].view(-1, c)
            yield r, idx


def _gather(pair: _Pair, rows: torch.Tensor, idx: torch.Tensor):
    """q ``[N, Gq, D]``, k / v ``[N, c·Gk, D]`` and the flat indices of the tiles."""
    _, nq, _, h, nk, _, hkv, d = pair.shape
    b_i, h_i, q_i = rows.unbind(1)
    q_flat = (b_i * nq + q_i) * h + h_i
    k_flat = ((b_i[:, None] * nk + idx) * hkv + (h_i // (h // hkv))[:, None]).reshape(-1)
    n = rows.shape[0]
    return q_flat, k_flat, pair.q[q_flat], pair.k[k_flat].view(n, -1, d), pair.v[k_flat].view(n, -1, d)


def _scores(qt, kt, mask, scale):
    s = torch.bmm(qt, kt.transpose(1, 2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def block_sparse_forward(
    q,
    k,
    v,
    q_pos,
    k_pos,
    pattern,
    *,
    scale,
    spec=NON_CAUSAL,
    q_doc=None,
    k_doc=None,
    softcap=None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One pair's out ``[B, Sq, H, D]`` and lse ``[B, H, Sq]`` (acc dtype) and the score pairs computed."""
    _check(q, k, q_pos, k_pos, pattern, spec, softcap)
    pair = _pair(q, k, v, q_pos, k_pos, pattern, q_doc, k_doc)
    b, nq, gq, h, _, _, _, d = pair.shape
    out = torch.zeros_like(pair.q)
    lse = torch.full(pair.q.shape[:2], float("-inf"), dtype=out.dtype, device=q.device)
    pairs = 0
    for rows, idx in _groups(pair):
        q_flat, _, qt, kt, vt = _gather(pair, rows, idx)
        s = _scores(qt, kt, _mask(pair, rows, idx), scale)
        m = torch.logsumexp(s, dim=-1)  # [N, Gq]
        p = torch.exp(s - m.nan_to_num(neginf=0.0)[..., None])
        out[q_flat] = torch.bmm(p, vt)
        lse[q_flat] = m
        pairs += s.numel()
    out = out.view(b, nq, h, gq, d).permute(0, 1, 3, 2, 4).reshape(b, nq * gq, h, d)
    return out, lse.view(b, nq, h, gq).permute(0, 2, 1, 3).reshape(b, h, nq * gq), pairs


# the contract's arguments on two lines
# fmt: off
def block_sparse_backward(
    dout, q, k, v, out, lse, q_pos, k_pos, pattern,
    *, scale, spec=NON_CAUSAL, q_doc=None, k_doc=None, softcap=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # fmt: on
    """dq ``[B, Sq, H, D]``, dk, dv ``[B, Sk, H_kv, D]`` (acc dtype) from the rows' FINAL out / lse."""
    _check(q, k, q_pos, k_pos, pattern, spec, softcap)
    pair = _pair(q, k, v, q_pos, k_pos, pattern, q_doc, k_doc)
    b, nq, gq, h, nk, gk, hkv, d = pair.shape
    acc = pair.q.dtype
    do_t = _tiles(dout, nq, acc)
    delta = (do_t * _tiles(out, nq, acc)).sum(-1)  # [B·nq·H, Gq]
    lse_t = lse.to(acc).view(b, h, nq, gq).permute(0, 2, 1, 3).reshape(b * nq * h, gq)
    dq, dk, dv = torch.zeros_like(pair.q), torch.zeros_like(pair.k), torch.zeros_like(pair.v)
    for rows, idx in _groups(pair):
        q_flat, k_flat, qt, kt, vt = _gather(pair, rows, idx)
        s = _scores(qt, kt, _mask(pair, rows, idx), scale)
        m = lse_t[q_flat]
        p = torch.exp(s - m.nan_to_num(neginf=0.0)[..., None]).masked_fill(torch.isinf(m)[..., None], 0.0)
        dot = do_t[q_flat]
        dv.index_add_(0, k_flat, torch.bmm(p.transpose(1, 2), dot).view(-1, gk, d))
        ds = p * (torch.bmm(dot, vt.transpose(1, 2)) - delta[q_flat][..., None])
        dq[q_flat] = torch.bmm(ds, kt) * scale
        dk.index_add_(0, k_flat, (torch.bmm(ds.transpose(1, 2), qt) * scale).view(-1, gk, d))
    dq = dq.view(b, nq, h, gq, d).permute(0, 1, 3, 2, 4).reshape(b, nq * gq, h, d)
    dk, dv = (x.view(b, nk, hkv, gk, d).permute(0, 1, 3, 2, 4).reshape(b, nk * gk, hkv, d) for x in (dk, dv))
    return dq, dk, dv


@dataclass(frozen=True)
class BlockKernel:
    """The kernel object the ring engine's sparse step calls (``SparseKernel``'s fields it reads)."""

    name: str = "dit_blocks"
    host_sync: bool = True

    forward = staticmethod(block_sparse_forward)
    backward = staticmethod(block_sparse_backward)


DIT_BLOCK_KERNEL = BlockKernel()
