"""Linear attention under sequence parallelism: Ulysses over heads, All-Scan over the ring (docs/linear.md).

Legend: P = U · R SP ranks, n = S / P tokens per rank, H heads, d_k / d_v key / value head dims.

    q, k [B, n, H, d_k], v [B, n, H, d_v], gate [B, n, H, d_k] (UspLayout order)
      -> Ulysses all-to-all (one call: q, k, v and the gate packed)  [B, S/R, h_u, d]
      -> the ring rank's pieces of the sequence (contiguous: one piece; zigzag: two, c_r and c_{2R-1-r})
         1. each piece's state summary (``ops/linear/chunk.piece_state``; one pass, no outputs yet)
         2. All-Scan of the entering states over the ring group (``comm/scan.py``), K row blocks along
            d_k, pipelined; the intra-chunk outputs of the pieces are computed between scan blocks
         3. out = local output + (q ⊙ A) · E_entering
      -> inverse all-to-all                                       out [B, n, H, d_v]

Linear attention is per head, so the Ulysses axis needs no state at all; only the ring axis scans.
Backward: the reverse scan of the state gradient (dE_loc of every piece first, then the chain),
then each piece's gradients by autograd through its local computation with the received gradient of
its leaving state. Communication per rank and layer: Ulysses as in USP, plus ONE state per ring hop
and direction (``[B, h_u, d_k, d_v]``), independent of S; ``scan: all_gather`` receives R - 1 (LASP-2).
Every SP rank must pass the same shapes: the first call with a new shape on a mesh checks it over the SP
group (``parallel/agree.py``; ``RankShapeError`` on every rank), later calls run no extra collective.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ds_seqpar.comm.all_to_all import HeadPlan, head_to_seq, seq_to_head
from ds_seqpar.comm.scan import StateScan, chain_owners
from ds_seqpar.errors import SeqParConfigError
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.ops.linear import advance_state, entering_state_output, local_scan, piece_state
from ds_seqpar.parallel.agree import check_same_inputs
from ds_seqpar.settings import input_layout


@dataclass(frozen=True)
class ScanPlan:
    """This rank's pieces (local row slices, in ``scan.mine`` order) and the scan over the ring group."""

    scan: StateScan
    pieces: tuple[slice, ...]
    chunk_size: int
    scale: float


def _decay(log_decay: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """The piece's log decay: the per-head ``[H]`` as is, a per-token gate sliced to the piece's rows."""
    return log_decay if log_decay is None or log_decay.dim() == 1 else log_decay[:, rows]


class _LinearScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q, k, v, log_decay, initial, plan: ScanPlan):
        scan = plan.scan
        pieces = dict(zip(scan.mine, plan.pieces, strict=True))
        summary = {i: piece_state(q[:, r], k[:, r], v[:, r], _decay(log_decay, r)) for i, r in pieces.items()}
        local = {}

        def run(i: int, r: slice) -> None:
            local[i] = local_scan(
                q[:, r], k[:, r], v[:, r], _decay(log_decay, r), plan.chunk_size, scale=plan.scale
            )

        tasks = [lambda i=i, r=r: run(i, r) for i, r in pieces.items()]  # overlapped with the scan
        entering, final = scan.forward(
            {i: s[1] for i, s in summary.items()}, {i: s[0] for i, s in summary.items()}, initial, tasks
        )
        out = torch.empty(*v.shape, dtype=entering[scan.mine[0]].dtype, device=v.device)
        for i, r in pieces.items():
            out[:, r] = local[i].out + entering_state_output(
                q[:, r], local[i].cum_log_decay, entering[i], scale=plan.scale
            )
        ctx.save_for_backward(q, k, v, log_decay, *[entering[i] for i in scan.mine])
        ctx.plan, ctx.has_initial = plan, initial is not None
        if final is None:
            final = torch.zeros_like(entering[scan.mine[0]])
        return out.to(v.dtype), final

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, dfinal: torch.Tensor):
        plan: ScanPlan = ctx.plan
        scan = plan.scan
        q, k, v, log_decay, *entering_list = ctx.saved_tensors
        entering = dict(zip(scan.mine, entering_list, strict=True))
        pieces = dict(zip(scan.mine, plan.pieces, strict=True))
        acc = entering_list[0].dtype
        dout = dout.to(acc)
        # dE_loc of every piece = scale * Σ_t diag(A_t) q_tᵀ dO_t (needs no other rank)
        summary = {i: piece_state(q[:, r], k[:, r], v[:, r], _decay(log_decay, r)) for i, r in pieces.items()}
        local_grad = {
            i: plan.scale * torch.einsum("bshk,bshv->bhkv", q[:, r].to(acc) * summary[i][2].exp(), dout[:, r])
            for i, r in pieces.items()
        }
        leaving, initial_grad = scan.backward(
            {i: s[1] for i, s in summary.items()},
            local_grad,
            dfinal if scan.owners[-1] == scan.me else None,
        )
        grads = {name: torch.zeros_like(t, dtype=acc) for name, t in (("q", q), ("k", k), ("v", v))}
        decay_grad = None if log_decay is None else torch.zeros_like(log_decay, dtype=acc)
        for i, r in pieces.items():
            with torch.enable_grad():
                qi, ki, vi = (x[:, r].detach().to(acc).requires_grad_() for x in (q, k, v))
                di = _decay(log_decay, r)
                di = None if di is None else di.detach().to(acc).requires_grad_()
                loc = local_scan(qi, ki, vi, di, plan.chunk_size, scale=plan.scale)
                out_i = loc.out + entering_state_output(qi, loc.cum_log_decay, entering[i], scale=plan.scale)
                leave_i = advance_state(entering[i], loc.total_log_decay, loc.state)
                inputs = [qi, ki, vi] + ([di] if di is not None else [])
                got = torch.autograd.grad(
                    [out_i, leave_i], inputs, [dout[:, r], leaving[i]], allow_unused=True
                )
            for name, g in zip(("q", "k", "v"), got[:3], strict=True):
                grads[name][:, r] += g
            if di is not None and got[3] is not None:
                if log_decay.dim() == 1:
                    decay_grad += got[3]
                else:
                    decay_grad[:, r] += got[3]
        init = None
        if ctx.has_initial:
            init = initial_grad if initial_grad is not None else torch.zeros_like(entering_list[0])
        return (
            grads["q"].to(q.dtype),
            grads["k"].to(k.dtype),
            grads["v"].to(v.dtype),
            None if decay_grad is None else decay_grad.to(log_decay.dtype),
            init,
            None,
        )


SAME_SCAN_SHARDS = (
    "every SP rank must pass the same shapes and dtypes (n = S / P tokens each: shard each batch with "
    "ds_seqpar.shard_batch / seqpar_dataloader) and run the same layers"
)


def check_heads(h: int, mesh: SeqParMesh, what: str) -> None:
    """A recurrent layer splits its heads over Ulysses: refuse U > H by name (before any collective)."""
    if h < mesh.ulysses_size:
        raise SeqParConfigError(
            f"{what} has H={h} heads but ulysses_degree U={mesh.ulysses_size}: its heads cannot be split U ways; "
            f"set sequence_parallel.ulysses_degree <= {h} (the rest of the SP degree goes to the ring)"
        )


def to_heads(
    parts: list[torch.Tensor], heads: HeadPlan, group: object, me: int, stats: object
) -> list[torch.Tensor]:
    """Ulysses all-to-all of ``[B, n, H, d_i]`` tensors in ONE call (packed along the last axis in the
    widest of their dtypes, so an fp32 gate beside bf16 q/k/v keeps its precision) -> ``[B, U·n, h_u, d_i]``
    each, back in the parts' own dtypes."""
    if len(heads.q_counts) == 1:  # U = 1: nothing moves, nothing to pack
        return list(parts)
    widths = [x.shape[-1] for x in parts]
    wide = functools.reduce(torch.promote_types, [x.dtype for x in parts])
    packed = torch.cat([x.to(wide) for x in parts], dim=-1)
    (moved,) = seq_to_head((packed,), (heads.q_counts,), group, me, stats)
    return [y.to(x.dtype) for y, x in zip(moved.split(widths, dim=-1), parts, strict=True)]


def scan_plan(
    mesh: SeqParMesh, local_len: int, chunk_size: int, blocks: int, mode: str, scale: float
) -> ScanPlan:
    """The scan over ``mesh``'s ring group for a ring shard of ``local_len`` tokens: its pieces are the ring
    layout's segments (zigzag: first half, then second half), in the layout's chain order."""
    ring = input_layout(mesh).ring
    owners = chain_owners(ring)
    scan = StateScan(
        mesh.group("ring"), mesh.members["ring"], mesh.coords.ring_rank, owners, blocks, mode, mesh.comm_stats
    )
    pieces = tuple(slice(a, b) for a, b in ring.segments(local_len * ring.world))
    return ScanPlan(scan, pieces, chunk_size, scale)


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh: SeqParMesh,
    log_decay: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """Linear attention of the whole sequence the SP group shares (``S_t = diag(α_t) S_{t-1} + k_tᵀ v_t``,
    ``o_t = scale · q_t S_t``); exact, equal to the single-process recurrence.

    Args:
        q, k: ``[B, n, H, d_k]``; v: ``[B, n, H, d_v]``: this rank's tokens in ``input_layout(mesh)`` order
            (ring layout contiguous or zigzag).
        mesh: the mesh; ``mesh.settings.linear`` gives scan mode, K blocks and chunk size.
        log_decay: None, ``[H]`` (one log decay per head), ``[B, n, H]`` (one per token and head, Mamba2)
            or ``[B, n, H, d_k]`` (per-token gate); the per-token ones sharded like q. Log decays must be <= 0.
        initial_state: ``[B, H, d_k, d_v]`` state before the first token, or None (zeros).

    Returns:
        ``out [B, n, H, d_v]`` in v.dtype; differentiable in q, k, v, log_decay and initial_state.
    """
    cfg = mesh.settings
    lin = cfg.linear
    b, n, h, d_k = q.shape
    layout = input_layout(mesh)
    seq_len = n * layout.world
    layout.check_length(seq_len)
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"linear attention takes q, k [B, n, H, d_k] and v [B, n, H, d_v]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if log_decay is not None and tuple(log_decay.shape) not in ((h,), (b, n, h), (b, n, h, d_k)):
        raise ValueError(
            f"log_decay shape {tuple(log_decay.shape)} must be [H] = ({h},), [B, n, H] = {(b, n, h)} or "
            f"[B, n, H, d_k] = {(b, n, h, d_k)}"
        )
    chunk_size, blocks, mode = lin.chunk_size, lin.blocks, lin.scan
    chain_owners(layout.ring)  # layout check, pre-comm
    check_heads(h, mesh, "a linear-attention layer")
    heads = HeadPlan.build(h, h, mesh.ulysses_size)
    check_same_inputs(mesh, "linear_attention", ("q", "k", "v", "log_decay", "initial_state"),
                      (q, k, v, log_decay, initial_state), fix=SAME_SCAN_SHARDS)  # fmt: skip
    group, me, stats = mesh.group("ulysses"), mesh.coords.ulysses_rank, mesh.comm_stats
    per_token = log_decay is not None and log_decay.dim() > 1
    parts = [q, k, v] + (
        [log_decay if log_decay.dim() == 4 else log_decay.unsqueeze(-1)] if per_token else []
    )
    q2, k2, v2, *rest = to_heads(parts, heads, group, me, stats)
    start = sum(heads.q_counts[:me])
    mine = slice(start, start + heads.q_counts[me])
    if per_token:
        decay2 = rest[0] if log_decay.dim() == 4 else rest[0].squeeze(-1)
    else:
        decay2 = None if log_decay is None else log_decay[mine]
    init2 = None if initial_state is None else initial_state[:, mine]
    plan = scan_plan(mesh, q2.shape[1], chunk_size, blocks, mode, scale)
    out, _ = _LinearScan.apply(q2, k2, v2, decay2, init2, plan)
    (full,) = head_to_seq((out,), (heads.q_counts,), group, me, stats)
    return full
