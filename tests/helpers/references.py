"""Inputs and single-process fp64 references shared by the distributed attention tests."""

from __future__ import annotations

import torch

from ds_seqpar.ops.attention.reference import dense_attention_reference
from ds_seqpar.ops.masks import MaskSpec, token_mask

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}  # max abs error of a distributed result vs the reference
B, H, D = 2, 4, 8  # batch rows, query heads and head dim of ``qkv_inputs``


def qkv_inputs(seq_len: int, h_kv: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Global q ``[B, S, H, D]``, k, v ``[B, S, h_kv, D]`` and dout (the same on every rank for one seed)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, seq_len, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, seq_len, h_kv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, seq_len, h_kv, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, seq_len, H, D, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, dout)]


def dense_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    spec: MaskSpec,
    docs: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """Dense fp64 attention on the whole sequence: ``(out, lse, dq, dk, dv)``."""
    seq_len = q.shape[1]
    pos = torch.arange(seq_len)
    mask = token_mask(pos, pos, spec) if docs is None else token_mask(pos, pos, spec, docs, docs)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = dense_attention_reference(q64, k64, v64, mask)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def grad_errors(
    out: torch.Tensor, leaves: tuple[torch.Tensor, ...], refs: tuple[torch.Tensor, ...]
) -> dict[str, float | bool]:
    """Max abs errors of a rank's ``out`` and of the grads of its ``leaves`` (q, k, v) against the
    reference shards ``refs`` (out, dq, dk, dv), and whether any of them holds a NaN."""
    got = (out, *(t.grad for t in leaves))
    errors: dict[str, float | bool] = {
        name: (g.double() - r).abs().max().item()
        for name, g, r in zip(("out", "dq", "dk", "dv"), got, refs, strict=True)
    }
    errors["nan"] = any(bool(torch.isnan(t).any()) for t in got)
    return errors


def assert_within(errors: dict[str, float], tol: float, where: object) -> None:
    """Every error of ``errors`` (which must name at least one) is at most ``tol``."""
    assert errors, f"{where}: no errors were measured"
    bad = {name: e for name, e in errors.items() if not e <= tol}
    assert not bad, f"{where}: {bad} above {tol} (all: {errors})"
