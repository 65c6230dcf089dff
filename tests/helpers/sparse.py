"""Single-process helpers of the sparse kernel tests: inputs, a small budget, every (query shard, key shard)
pair of a layout through one sparse kernel, and the fp64 reference (``test_ops_sparse.py``,
``test_sparse_kernels.py``)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ds_seqpar.ops.masks import MaskSpec
from ds_seqpar.ops.merge import merge_attn_
from ds_seqpar.ops.sparse import VerticalSlashBudget, sparse_attention_reference
from ds_seqpar.ops.sparse.kernels import SPARSE_KERNELS

CAUSAL = MaskSpec()


class SparseResult(NamedTuple):
    """Reassembled outputs and gradients of a sharded sparse run, and the pairs the kernel counted."""

    out: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    pairs: int

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """``(out, lse, dq, dk, dv)``: what the reference gives."""
        return self.out, self.lse, self.dq, self.dk, self.dv


def sparse_qkv(
    b: int, s: int, h: int, h_kv: int, d: int, dtype: torch.dtype, seed: int = 0
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, n, d, generator=g, dtype=torch.float64).to(dtype) for n in (h, h_kv, h_kv, h)]


def small_budget(block: int) -> VerticalSlashBudget:
    return VerticalSlashBudget(0.04, 0.04, block, last_q=16, sink_tokens=3, local_diagonals=5)


def sharded_sparse(q, k, v, dout, pattern, layout, spec=CAUSAL, docs=None, kernel="blocks", softcap=None):
    """Run the sparse kernel ``kernel`` (``SPARSE_KERNELS``) on every (query shard, key shard) pair of
    ``layout``; reassemble out, lse and the gradients."""
    kern = SPARSE_KERNELS[kernel]
    s = q.shape[1]
    scale = q.shape[-1] ** -0.5
    out, lse = (
        torch.zeros_like(q, dtype=torch.float64),
        torch.zeros(q.shape[0], q.shape[2], s, dtype=torch.float64),
    )
    dq, dk, dv = (torch.zeros_like(t, dtype=torch.float64) for t in (q, k, v))
    pairs = 0
    shard_docs = (lambda r: None) if docs is None else (lambda r: layout.shard(docs, r, dim=-1))
    for r in range(layout.world):
        qp = layout.local_positions(s, r)
        o = torch.zeros(q.shape[0], qp.numel(), q.shape[2], q.shape[3], dtype=torch.float64)
        lr = torch.full((q.shape[0], q.shape[2], qp.numel()), float("-inf"), dtype=torch.float64)
        for j in range(layout.world):
            kp = layout.local_positions(s, j)
            ob, lb, n = kern.forward(
                q[:, qp],
                k[:, kp],
                v[:, kp],
                qp,
                kp,
                pattern,
                scale=scale,
                spec=spec,
                q_doc=shard_docs(r),
                k_doc=shard_docs(j),
                softcap=softcap,
            )
            merge_attn_(o, lr, ob.double(), lb.double())
            pairs += n or 0
        for j in range(layout.world):
            kp = layout.local_positions(s, j)
            gq, gk, gv = kern.backward(
                dout[:, qp], q[:, qp], k[:, kp], v[:, kp], o.to(q.dtype), lr, qp, kp, pattern,
                scale=scale, spec=spec, q_doc=shard_docs(r), k_doc=shard_docs(j), softcap=softcap,
            )  # fmt: skip
            dq[:, qp] += gq.double()
            dk[:, kp] += gk.double()
            dv[:, kp] += gv.double()
        out[:, qp], lse[:, :, qp] = o, lr
    return SparseResult(out, lse, dq, dk, dv, pairs)


def sparse_reference(q, k, v, dout, pattern, spec=CAUSAL, docs=None, softcap=None):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = sparse_attention_reference(q64, k64, v64, pattern, spec=spec, doc_ids=docs, softcap=softcap)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad
