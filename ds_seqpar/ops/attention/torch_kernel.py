"""The ``torch`` block kernel: pure PyTorch, chunked over query and key blocks (memory O(chunk²)); the
reference among the kernels, any device and dtype, and the one that applies a softcap and ALiBi everywhere."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from ds_seqpar.ops.attention.contract import Alibi, AttentionKernel
from ds_seqpar.ops.backends import always_available
from ds_seqpar.ops.precision import accumulation_dtype

__all__ = ["DEFAULT_CHUNK", "torch_chunked_kernel"]

NEG_INF = float("-inf")
DEFAULT_CHUNK = 512


def _mask_chunk(
    mask: torch.Tensor | None, causal: bool, qs: int, qe: int, ks: int, ke: int, device: torch.device
) -> torch.Tensor | None:
    """Visibility of query rows [qs, qe) x keys [ks, ke) as bool [B|1, 1, cq, ck]; None = all visible."""
    if mask is not None:
        return mask[:, qs:qe, ks:ke].unsqueeze(1)
    if causal and ke - 1 > qs:
        rows = torch.arange(qs, qe, device=device).unsqueeze(-1)
        return (rows >= torch.arange(ks, ke, device=device)).view(1, 1, qe - qs, ke - ks)
    return None


def _key_chunks(
    mask: torch.Tensor | None, causal: bool, qs: int, qe: int, sk: int, chunk: int, device: torch.device
) -> Iterator[tuple[int, int, torch.Tensor | None]]:
    """Yield ``(ks, ke, visible)`` for the key chunks that causality does not rule out. A chunk the mask
    hides entirely is still computed (its probabilities are 0): testing for it would be a host sync."""
    for ks in range(0, sk, chunk):
        if causal and ks > qe - 1:
            return
        ke = min(ks + chunk, sk)
        yield ks, ke, _mask_chunk(mask, causal, qs, qe, ks, ke, device)


def _masked_scores(
    q_c: torch.Tensor,
    k_c: torch.Tensor,
    scale: float,
    visible: torch.Tensor | None,
    g: int,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores ``[B, H_kv, g*cq, ck]`` for grouped queries ``[B, H_kv, g*cq, D]`` and keys ``[B, H_kv, ck, D]``.

    Returns ``(scores, tanh)``: with ``softcap`` c the scores are c·tanh(s/c) and ``tanh`` is tanh(s/c)
    (for the backward's chain factor 1 - tanh²), else ``tanh`` is None. ``bias`` (ALiBi, ``[B|1, H_kv,
    g*cq, ck]``) is added after the cap.
    """
    s = (q_c @ k_c.transpose(-1, -2)).mul_(scale)
    t = None
    if softcap is not None:
        t = torch.tanh(s.div_(softcap))
        s = t * softcap
    if bias is not None:
        s = s + bias
    if visible is not None:
        b, hkv, _, ck = s.shape
        s.view(b, hkv, g, -1, ck).masked_fill_(~visible.unsqueeze(1), NEG_INF)
    return s, t


def _chunk_bias(
    alibi: Alibi | None, hkv: int, qs: int, qe: int, ks: int, ke: int, acc: torch.dtype
) -> torch.Tensor | None:
    """The ALiBi bias of one (query chunk, key chunk) in the grouped row order ``[B|1, H_kv, g*cq, ck]``."""
    if alibi is None:
        return None
    bias = alibi.bias(qs, qe, ks, ke, acc)
    return bias.reshape(bias.shape[0], hkv, -1, ke - ks)


def _grouped(x: torch.Tensor, hkv: int, qs: int, qe: int, acc: torch.dtype) -> torch.Tensor:
    """Rows [qs, qe) of ``[B, S, H, D]`` as ``[B, H_kv, g*cq, D]`` (head h = kv_head * g + j)."""
    b, _, h, d = x.shape
    chunk = x[:, qs:qe].to(acc).reshape(b, qe - qs, hkv, h // hkv, d)
    return chunk.permute(0, 2, 3, 1, 4).reshape(b, hkv, -1, d)


def _ungroup(x: torch.Tensor, g: int) -> torch.Tensor:
    """Inverse of :func:`_grouped` for one chunk: ``[B, H_kv, g*cq, D]`` -> ``[B, cq, H, D]``."""
    b, hkv, _, d = x.shape
    return x.view(b, hkv, g, -1, d).permute(0, 3, 1, 2, 4).reshape(b, -1, hkv * g, d)


def _torch_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    causal: bool,
    softcap: float | None = None,
    *,
    chunk: int,
    alibi: Alibi | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    acc = accumulation_dtype(q.dtype)
    k_h = k.transpose(1, 2)  # [B, H_kv, Sk, D]
    v_h = v.transpose(1, 2)
    out = torch.empty(b, sq, h, d, dtype=acc, device=q.device)
    lse = torch.empty(b, h, sq, dtype=acc, device=q.device)
    for qs in range(0, sq, chunk):
        qe = min(qs + chunk, sq)
        q_c = _grouped(q, hkv, qs, qe, acc)
        row_max = torch.full(q_c.shape[:-1], NEG_INF, dtype=acc, device=q.device)  # [B, H_kv, g*cq]
        row_sum = torch.zeros_like(row_max)
        o_c = torch.zeros_like(q_c)
        for ks, ke, visible in _key_chunks(mask, causal, qs, qe, sk, chunk, q.device):
            bias = _chunk_bias(alibi, hkv, qs, qe, ks, ke, acc)
            s, _ = _masked_scores(q_c, k_h[:, :, ks:ke].to(acc), scale, visible, g, softcap, bias)
            new_max = torch.maximum(row_max, s.amax(dim=-1))
            safe_max = new_max.masked_fill(new_max == NEG_INF, 0.0)  # row still empty: avoid -inf - -inf
            p = torch.exp(s - safe_max.unsqueeze(-1))
            rescale = torch.exp(row_max - safe_max)
            row_sum = row_sum * rescale + p.sum(dim=-1)
            o_c = o_c * rescale.unsqueeze(-1) + p @ v_h[:, :, ks:ke].to(acc)
            row_max = new_max
        nonempty = row_sum > 0
        o_c = o_c / torch.where(nonempty, row_sum, 1.0).unsqueeze(-1)
        lse_c = torch.where(nonempty, row_max + torch.log(row_sum), NEG_INF)
        out[:, qs:qe] = _ungroup(o_c, g)
        lse[:, :, qs:qe] = lse_c.view(b, h, qe - qs)
    return out, lse


def _torch_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    causal: bool,
    softcap: float | None = None,
    *,
    chunk: int,
    alibi: Alibi | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    acc = accumulation_dtype(q.dtype)
    k_h = k.transpose(1, 2)  # [B, H_kv, Sk, D]
    v_h = v.transpose(1, 2)
    delta = (dout.to(acc) * out.to(acc)).sum(dim=-1, keepdim=True)  # [B, Sq, H, 1], Δ = rowsum(dO·O)
    lse_rows = lse.to(acc).transpose(1, 2).unsqueeze(-1)  # [B, Sq, H, 1]
    dq = torch.zeros(b, sq, h, d, dtype=acc, device=q.device)
    dk = torch.zeros(b, hkv, sk, d, dtype=acc, device=q.device)
    dv = torch.zeros_like(dk)
    for qs in range(0, sq, chunk):
        qe = min(qs + chunk, sq)
        q_c = _grouped(q, hkv, qs, qe, acc)
        do_c = _grouped(dout, hkv, qs, qe, acc)
        lse_c = _grouped(lse_rows, hkv, qs, qe, acc)  # [B, H_kv, g*cq, 1]
        delta_c = _grouped(delta, hkv, qs, qe, acc)
        dq_c = torch.zeros_like(q_c)
        for ks, ke, visible in _key_chunks(mask, causal, qs, qe, sk, chunk, q.device):
            k_c = k_h[:, :, ks:ke].to(acc)
            v_c = v_h[:, :, ks:ke].to(acc)
            bias = _chunk_bias(alibi, hkv, qs, qe, ks, ke, acc)
            s, t = _masked_scores(q_c, k_c, scale, visible, g, softcap, bias)
            p = torch.exp(s - lse_c)  # [B, H_kv, g*cq, ck]
            dv[:, :, ks:ke] += p.transpose(-1, -2) @ do_c
            dz = p * (do_c @ v_c.transpose(-1, -2) - delta_c)
            if t is not None:  # d(c·tanh(s/c))/ds = 1 - tanh²(s/c)
                dz = dz * (1.0 - t * t)
            dq_c += dz @ k_c
            dk[:, :, ks:ke] += dz.transpose(-1, -2) @ q_c
        dq[:, qs:qe] = _ungroup(dq_c, g) * scale
    return dq, (dk * scale).transpose(1, 2).contiguous(), dv.transpose(1, 2).contiguous()


def torch_chunked_kernel(chunk: int = DEFAULT_CHUNK) -> AttentionKernel:
    """The pure-PyTorch kernel with ``chunk`` query rows x ``chunk`` keys per step (any device)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} is invalid: use an int >= 1 (e.g. {DEFAULT_CHUNK})")
    return AttentionKernel(
        name="torch",
        forward=functools.partial(_torch_forward, chunk=chunk),
        backward=functools.partial(_torch_backward, chunk=chunk),
        unavailable=always_available,
        softcap=True,
        alibi=True,
        summary="chunked reference",
    )
