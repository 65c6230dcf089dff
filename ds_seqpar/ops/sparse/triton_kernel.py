"""The ``triton`` sparse kernel: vertical-slash block-sparse attention with LSE, forward and backward.

docs/sparse.md "Sparse kernels". One (query shard, key shard) pair of the sparse ring, exactly the
visibility of ``SparsePattern.visible`` plus the window / document rules of ``ops/masks.py``:

    visible(i, j) = pos_i >= pos_j  and  (slash[b, h, pos_i // G - pos_j // G]  or  vertical[b, h, pos_j])
                    and  pos_i - pos_j < window          (if a window is set)
                    and  doc_i == doc_j >= 0             (if documents are set)

Each program owns BLOCK_M query rows of one (row, head) and walks the key tiles; a tile with no visible
pair is skipped by a test inside the kernel, so the pattern (a device tensor, re-estimated every step)
is never read on the host: no host sync, no index lists. Work is proportional to the visible tiles.
Scores, softmax and gradients accumulate in fp32; out / lse / gradients come back fp32.

    forward   q [B, Sq, H, D], k, v [B, Sk, H_kv, D] -> out [B, Sq, H, D], lse [B, H, Sq] (-inf: no key)
    backward  given the FINAL out / lse of the rows (merged over the ring), like every block kernel:
              one kernel for dq (programs over query tiles), one for dk, dv (programs over key tiles
              and K/V heads, looping over the GQA group's query heads and the query tiles)

Runs on CUDA; under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (how CI tests them).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ds_seqpar.ops.merge import inert_empty_rows

__all__ = ["DTYPES", "interpreted", "sparse_triton_backward", "sparse_triton_forward"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_M = 64
BLOCK_N = 64


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _tanh(x):
    """tanh from exp (no libdevice call, so the interpreter runs it too); saturates to +-1."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _tokens(POS, DOC, doc_stride, b, idx, count, HAS_DOC: tl.constexpr):
    """Validity, global positions and document ids (-1 when invalid) of the token indices ``idx``."""
    ok = idx < count
    pos = tl.load(POS + idx, mask=ok, other=0)
    doc = pos
    if HAS_DOC:
        doc = tl.load(DOC + b * doc_stride + idx, mask=ok, other=-1)
    return ok, pos, doc


@triton.jit
def _visible(
    q_pos, q_doc, q_ok, k_pos, k_doc, k_ok, slash_row, vert_row, block_size, window,
    HAS_WINDOW: tl.constexpr, HAS_DOC: tl.constexpr,
):  # fmt: skip
    """Bool [M, N] visibility of query positions ``q_pos [M]`` x key positions ``k_pos [N]``."""
    delta = q_pos[:, None] - k_pos[None, :]
    ok = q_ok[:, None] & k_ok[None, :] & (delta >= 0)
    d_blk = q_pos[:, None] // block_size - k_pos[None, :] // block_size
    slash = tl.load(slash_row + tl.maximum(d_blk, 0), mask=ok, other=0)
    vert = tl.load(vert_row + k_pos, mask=k_ok, other=0)
    ok = ok & ((slash != 0) | (vert[None, :] != 0))
    if HAS_WINDOW:
        ok = ok & (delta < window)
    if HAS_DOC:
        ok = ok & (q_doc[:, None] == k_doc[None, :]) & (q_doc[:, None] >= 0)
    return ok


@triton.jit
def _scores(q, k, ok, scale, softcap, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """Masked scores [M, N] (-inf where hidden) and tanh(s / softcap) for the backward's chain factor."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    t = s
    if HAS_SOFTCAP:
        t = _tanh(s / softcap)
        s = t * softcap
    return tl.where(ok, s, float("-inf")), t


@triton.jit
def _forward_kernel(
    Q, K, V, OUT, LSE, QPOS, KPOS, QDOC, KDOC, SLASH, VERT,
    sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, so_b, so_s, so_h, sl_b, sl_h,
    ssl_b, ssl_h, sve_b, sve_h, sqd_b, skd_b,
    seq_q, seq_k, heads, group, head_dim, scale, softcap, block_size, window,
    HAS_WINDOW: tl.constexpr, HAS_DOC: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    hk = h // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q_ok, q_pos, q_doc = _tokens(QPOS, QDOC, sqd_b, b, rows, seq_q, HAS_DOC)
    d_ok = dims < head_dim
    q = tl.load(
        Q + b * sq_b + h * sq_h + rows[:, None] * sq_s + dims[None, :],
        mask=q_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    slash_row = SLASH + b * ssl_b + h * ssl_h
    vert_row = VERT + b * sve_b + h * sve_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, seq_k, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k_ok, k_pos, k_doc = _tokens(KPOS, KDOC, skd_b, b, cols, seq_k, HAS_DOC)
        ok = _visible(
            q_pos,
            q_doc,
            q_ok,
            k_pos,
            k_doc,
            k_ok,
            slash_row,
            vert_row,
            block_size,
            window,
            HAS_WINDOW,
            HAS_DOC,
        )
        if tl.max(ok.to(tl.int32)) > 0:  # skip tiles the pattern hides entirely
            kv_mask = k_ok[:, None] & d_ok[None, :]
            kv_off = b * sk_b + hk * sk_h + cols[:, None] * sk_s + dims[None, :]
            k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
            v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
            s, _t = _scores(q, k, ok, scale, softcap, HAS_SOFTCAP, PRECISION)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(
        OUT + b * so_b + h * so_h + rows[:, None] * so_s + dims[None, :],
        out,
        mask=q_ok[:, None] & d_ok[None, :],
    )
    tl.store(LSE + b * sl_b + h * sl_h + rows, lse, mask=q_ok)


@triton.jit
def _dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, QPOS, KPOS, QDOC, KDOC, SLASH, VERT,
    sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sl_b, sl_h,
    ssl_b, ssl_h, sve_b, sve_h, sqd_b, skd_b,
    seq_q, seq_k, heads, group, head_dim, scale, softcap, block_size, window,
    HAS_WINDOW: tl.constexpr, HAS_DOC: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    hk = h // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q_ok, q_pos, q_doc = _tokens(QPOS, QDOC, sqd_b, b, rows, seq_q, HAS_DOC)
    d_ok = dims < head_dim
    q_off = b * sq_b + h * sq_h + rows[:, None] * sq_s + dims[None, :]
    qd_mask = q_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + q_off, mask=qd_mask, other=0.0)
    do = tl.load(DO + q_off, mask=qd_mask, other=0.0)
    lse = tl.load(LSE + b * sl_b + h * sl_h + rows, mask=q_ok, other=0.0)
    delta = tl.load(DELTA + b * sl_b + h * sl_h + rows, mask=q_ok, other=0.0)
    slash_row = SLASH + b * ssl_b + h * ssl_h
    vert_row = VERT + b * sve_b + h * sve_h
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, seq_k, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k_ok, k_pos, k_doc = _tokens(KPOS, KDOC, skd_b, b, cols, seq_k, HAS_DOC)
        ok = _visible(
            q_pos,
            q_doc,
            q_ok,
            k_pos,
            k_doc,
            k_ok,
            slash_row,
            vert_row,
            block_size,
            window,
            HAS_WINDOW,
            HAS_DOC,
        )
        if tl.max(ok.to(tl.int32)) > 0:
            kv_mask = k_ok[:, None] & d_ok[None, :]
            kv_off = b * sk_b + hk * sk_h + cols[:, None] * sk_s + dims[None, :]
            k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
            v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
            s, t = _scores(q, k, ok, scale, softcap, HAS_SOFTCAP, PRECISION)
            p = tl.exp(s - lse[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            if HAS_SOFTCAP:
                ds = ds * (1.0 - t * t)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + q_off, dq * scale, mask=qd_mask)


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, QPOS, KPOS, QDOC, KDOC, SLASH, VERT,
    sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sl_b, sl_h,
    ssl_b, ssl_h, sve_b, sve_h, sqd_b, skd_b,
    seq_q, seq_k, kv_heads, group, head_dim, scale, softcap, block_size, window,
    HAS_WINDOW: tl.constexpr, HAS_DOC: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // kv_heads
    hk = bh % kv_heads
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    k_ok, k_pos, k_doc = _tokens(KPOS, KDOC, skd_b, b, cols, seq_k, HAS_DOC)
    d_ok = dims < head_dim
    kv_off = b * sk_b + hk * sk_h + cols[:, None] * sk_s + dims[None, :]
    kv_mask = k_ok[:, None] & d_ok[None, :]
    k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for j in range(0, group):
        h = hk * group + j
        slash_row = SLASH + b * ssl_b + h * ssl_h
        vert_row = VERT + b * sve_b + h * sve_h
        for start in range(0, seq_q, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            q_ok, q_pos, q_doc = _tokens(QPOS, QDOC, sqd_b, b, rows, seq_q, HAS_DOC)
            ok = _visible(
                q_pos,
                q_doc,
                q_ok,
                k_pos,
                k_doc,
                k_ok,
                slash_row,
                vert_row,
                block_size,
                window,
                HAS_WINDOW,
                HAS_DOC,
            )
            if tl.max(ok.to(tl.int32)) > 0:
                q_off = b * sq_b + h * sq_h + rows[:, None] * sq_s + dims[None, :]
                qd_mask = q_ok[:, None] & d_ok[None, :]
                q = tl.load(Q + q_off, mask=qd_mask, other=0.0)
                do = tl.load(DO + q_off, mask=qd_mask, other=0.0)
                lse = tl.load(LSE + b * sl_b + h * sl_h + rows, mask=q_ok, other=0.0)
                delta = tl.load(DELTA + b * sl_b + h * sl_h + rows, mask=q_ok, other=0.0)
                s, t = _scores(q, k, ok, scale, softcap, HAS_SOFTCAP, PRECISION)
                p = tl.exp(s - lse[:, None])  # [M, N]
                dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
                dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
                ds = p * (dp - delta[:, None])
                if HAS_SOFTCAP:
                    ds = ds * (1.0 - t * t)
                dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
    tl.store(DK + kv_off, dk * scale, mask=kv_mask)
    tl.store(DV + kv_off, dv, mask=kv_mask)


def _meta(
    q: torch.Tensor,
    k: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    vertical: torch.Tensor,
    slash: torch.Tensor,
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
) -> tuple[list, dict]:
    """Positions / documents / pattern as the kernels read them, and the arguments every kernel shares."""
    as_i32 = [x.to(torch.int32).contiguous() for x in (q_pos, k_pos)]
    has_doc = q_doc is not None and k_doc is not None
    if has_doc:
        docs = [(x if x.dim() == 2 else x[None]).to(torch.int32).contiguous() for x in (q_doc, k_doc)]
        doc_strides = [x.stride(0) if x.shape[0] > 1 else 0 for x in docs]
    else:
        docs, doc_strides = as_i32, [0, 0]
    vert = vertical.to(torch.int8)
    sl = slash.to(torch.int8)
    strides = [
        sl.stride(0) if sl.shape[0] > 1 else 0,
        sl.stride(1),
        vert.stride(0) if vert.shape[0] > 1 else 0,
        vert.stride(1),
        *doc_strides,
    ]
    tensors = [*as_i32, *docs, sl, vert]
    flags = dict(
        HAS_DOC=has_doc,
        PRECISION="ieee" if q.dtype == torch.float32 else None,
        BLOCK_D=max(16, triton.next_power_of_2(q.shape[-1])),
    )
    return tensors, dict(strides=strides, flags=flags)


def _check(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.dtype not in DTYPES:
        raise ValueError(f"the triton sparse kernel takes float16, bfloat16 or float32 (got {q.dtype})")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(
            "the triton sparse kernel needs a unit stride over the head dim (call .contiguous())"
        )


def sparse_triton_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    vertical: torch.Tensor,
    slash: torch.Tensor,
    block_size: int,
    *,
    scale: float,
    window: int | None = None,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, Sq, H, D]``, ``k, v [B, Sk, H_kv, D]``, pattern ``vertical [B|1, H, S]`` / ``slash [B|1, H, nB]``
    -> ``out [B, Sq, H, D]`` fp32, ``lse [B, H, Sq]`` fp32 (rows that see no key: out 0, lse -inf)."""
    _check(q, k)
    q, k, v = (x.contiguous() for x in (q, k, v))
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    out = torch.empty(b, sq, h, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
    tensors, meta = _meta(q, k, q_pos, k_pos, vertical, slash, q_doc, k_doc)
    grid = (triton.cdiv(sq, BLOCK_M), b * h)
    _forward_kernel[grid](
        q, k, v, out, lse, *tensors,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), *meta["strides"],
        sq, sk, h, h // hkv, d, scale, softcap or 1.0, block_size, window or 0,
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        **meta["flags"],
    )  # fmt: skip
    return out, lse


def sparse_triton_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    vertical: torch.Tensor,
    slash: torch.Tensor,
    block_size: int,
    *,
    scale: float,
    window: int | None = None,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients given the FINAL ``out [B, Sq, H, D]`` / ``lse [B, H, Sq]`` of the rows (-inf rows allowed):
    ``dq [B, Sq, H, D]``, ``dk, dv [B, Sk, H_kv, D]`` in fp32."""
    _check(q, k)
    q, k, v = (x.contiguous() for x in (q, k, v))
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    dout, lse = inert_empty_rows(dout.to(q.dtype), lse.float())
    dout, lse = dout.contiguous(), lse.contiguous()
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # [B, H, Sq], Δ = rowsum(dO·O)
    dq = torch.empty(b, sq, h, d, dtype=torch.float32, device=q.device)
    dk = torch.empty(b, sk, hkv, d, dtype=torch.float32, device=q.device)
    dv = torch.empty_like(dk)
    tensors, meta = _meta(q, k, q_pos, k_pos, vertical, slash, q_doc, k_doc)
    common = (
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        lse.stride(0), lse.stride(1), *meta["strides"], sq, sk,
    )  # fmt: skip
    flags = dict(
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        **meta["flags"],
    )  # fmt: skip
    tail = (d, scale, softcap or 1.0, block_size, window or 0)
    _dq_kernel[(triton.cdiv(sq, BLOCK_M), b * h)](
        q, k, v, dout, lse, delta, dq, *tensors, *common, h, h // hkv, *tail, **flags
    )
    _dkdv_kernel[(triton.cdiv(sk, BLOCK_N), b * hkv)](
        q, k, v, dout, lse, delta, dk, dv, *tensors, *common, hkv, h // hkv, *tail, **flags
    )
    return dq, dk, dv
