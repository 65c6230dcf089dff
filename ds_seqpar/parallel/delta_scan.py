"""Delta-rule layers (gated DeltaNet, KDA) under SP: Ulysses over heads, All-Scan of matrix transitions over the ring,
and the causal conv1d halo those layers put before the recurrence (docs/delta.md).

Legend: P = U · R SP ranks, n = S / P tokens per rank, H heads, d_k / d_v key / value head dims.

    q, k [B, n, H, d_k], v [B, n, H, d_v], beta [B, n, H], log_decay [B, n, H] or [B, n, H, d_k]
      -> Ulysses all-to-all (ONE call: the five packed along the last axis)   [B, S/R, h_u, ...]
      -> per ring piece (contiguous: one; zigzag: two):
         1. ``ops/delta/chunk.delta_piece``: every state-independent chunk quantity
         2. ``piece_transition``: the affine map S_out = M S_in + N of the piece
         3. All-Scan of the entering states over the ring group with ``MatrixMap(M)`` transitions,
            K column blocks along d_v, pipelined (``comm/scan.py``); or the all-gather of (M, N)
         4. ``piece_outputs`` from the entering state
      -> inverse all-to-all                                                       out [B, n, H, d_v]

Backward: dE_loc of each piece (the gradient of its outputs with respect to its entering state, by
autograd of the linear correction term), the reverse scan with Mᵀ, then each piece's gradients by
autograd through its sweep from the entering state with the received gradient of its leaving state.
Communication per rank and layer: Ulysses as in USP, plus ONE state ``[B, h_u, d_k, d_v]`` per ring hop
and direction (independent of S and P); ``scan: all_gather`` receives the (M, N) of the R - 1 others.
Every SP rank must pass the same shapes (here and to ``sharded_causal_conv1d``): the first call with a new
shape on a mesh checks it over the SP group (``parallel/agree.py``), later calls run no extra collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ds_seqpar.comm.all_to_all import HeadPlan, head_to_seq
from ds_seqpar.comm.halo import HaloPlan, halo_exchange, halo_plan
from ds_seqpar.comm.scan import MatrixMap, chain_owners
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.ops.conv import causal_conv1d_runs
from ds_seqpar.ops.delta import entering_state_output, piece_outputs, piece_transition, prepare_piece
from ds_seqpar.ops.delta.checks import check_gates
from ds_seqpar.parallel.agree import check_same_inputs
from ds_seqpar.parallel.linear_scan import SAME_SCAN_SHARDS, ScanPlan, check_heads, scan_plan, to_heads
from ds_seqpar.settings import input_layout


def _piece(xs: tuple, rows: slice, plan: ScanPlan):
    """The prepared piece ``rows`` of the (already validated) inputs."""
    q, k, v, beta, g = xs
    return prepare_piece(
        q[:, rows], k[:, rows], v[:, rows], beta[:, rows], None if g is None else g[:, rows], plan.chunk_size,
        plan.scale,
    )  # fmt: skip


class _DeltaScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q, k, v, beta, log_decay, initial, plan: ScanPlan):
        scan = plan.scan
        xs = (q, k, v, beta, log_decay)
        pieces = dict(zip(scan.mine, plan.pieces, strict=True))
        prepared = {i: _piece(xs, r, plan) for i, r in pieces.items()}
        maps, offsets = {}, {}
        for i, piece in prepared.items():
            m, offsets[i] = piece_transition(piece)
            maps[i] = MatrixMap(m)
        entering, final = scan.forward(maps, offsets, initial)
        acc = offsets[scan.mine[0]].dtype
        out = torch.empty(*v.shape, dtype=acc, device=v.device)
        for i, r in pieces.items():
            out[:, r] = piece_outputs(prepared[i], entering[i])[0]
        ctx.save_for_backward(q, k, v, beta, log_decay, *[entering[i] for i in scan.mine])
        ctx.maps = maps
        ctx.plan, ctx.has_initial = plan, initial is not None
        if final is None:
            final = torch.zeros_like(entering[scan.mine[0]])
        return out.to(v.dtype), final

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, dfinal: torch.Tensor):
        plan: ScanPlan = ctx.plan
        scan = plan.scan
        q, k, v, beta, log_decay, *entering_list = ctx.saved_tensors
        entering = dict(zip(scan.mine, entering_list, strict=True))
        pieces = dict(zip(scan.mine, plan.pieces, strict=True))
        acc = entering_list[0].dtype
        dout = dout.to(acc)
        inputs = [x for x in (q, k, v, beta, log_decay) if x is not None]
        local_grad, graphs = {}, {}
        with torch.enable_grad():
            for i, r in pieces.items():
                leaves = [x.detach().requires_grad_() for x in inputs]
                it = iter(leaves)
                xs = tuple(next(it) if x is not None else None for x in (q, k, v, beta, log_decay))
                piece = _piece(xs, r, plan)
                e = entering[i].detach().requires_grad_()
                (local_grad[i],) = torch.autograd.grad(
                    entering_state_output(piece, e), e, dout[:, r], retain_graph=True
                )
                graphs[i] = (piece, leaves)
        leaving, initial_grad = scan.backward(
            ctx.maps, local_grad, dfinal.to(acc) if scan.owners[-1] == scan.me else None
        )
        grads = [torch.zeros_like(x, dtype=acc) for x in inputs]
        for i, r in pieces.items():
            piece, leaves = graphs[i]
            with torch.enable_grad():
                out_i, leave_i = piece_outputs(piece, entering[i])
            got = torch.autograd.grad([out_i, leave_i], leaves, [dout[:, r], leaving[i]], allow_unused=True)
            for total, g in zip(grads, got, strict=True):
                if g is not None:
                    total += g
        it = iter(g.to(x.dtype) for g, x in zip(grads, inputs, strict=True))
        dq, dk, dv, dbeta = (next(it) for _ in range(4))
        dg = next(it) if log_decay is not None else None
        init = None
        if ctx.has_initial:
            init = initial_grad if initial_grad is not None else torch.zeros_like(entering_list[0])
        return dq, dk, dv, dbeta, dg, init, None


def _check(q, k, v, beta, log_decay, initial_state) -> None:
    b, n, h, d_k = q.shape
    if k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"delta_rule_attention takes q, k [B, n, H, d_k] and v [B, n, H, d_v]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if tuple(beta.shape) != (b, n, h):
        raise ValueError(f"beta shape {tuple(beta.shape)} must be [B, n, H] = {(b, n, h)}")
    if log_decay is not None and tuple(log_decay.shape) not in ((b, n, h), (b, n, h, d_k)):
        raise ValueError(
            f"log_decay shape {tuple(log_decay.shape)} must be [B, n, H] = {(b, n, h)} (gated DeltaNet) or "
            f"[B, n, H, d_k] = {(b, n, h, d_k)} (KDA)"
        )
    check_gates(q, beta, log_decay)  # values too (decays <= 0), on every rank before the all-to-all
    if initial_state is not None and tuple(initial_state.shape) != (b, h, d_k, v.shape[-1]):
        raise ValueError(
            f"initial_state shape {tuple(initial_state.shape)} must be [B, H, d_k, d_v] = {(b, h, d_k, v.shape[-1])}"
        )


def delta_rule_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    mesh: SeqParMesh,
    log_decay: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scale: float = 1.0,
    final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over the whole sequence the SP group shares; exact, equal to one process.

    Args:
        q, k: ``[B, n, H, d_k]``; v: ``[B, n, H, d_v]``; beta: ``[B, n, H]``: this rank's tokens in
            ``input_layout(mesh)`` order (ring layout contiguous or zigzag). q and k are used as given
            (normalise them first if the model does).
        mesh: the mesh; ``mesh.settings.linear`` gives scan mode, K blocks (along d_v) and chunk size.
        log_decay: None, ``[B, n, H]`` (gated DeltaNet) or ``[B, n, H, d_k]`` (KDA); entries <= 0.
        initial_state: ``[B, H, d_k, d_v]`` state before the first token, or None (zeros).
        final_state: also return this rank's share of the state after the last token: ``[B, H, d_k, d_v]``
            (the scan's dtype), zeros except this rank's Ulysses heads on the ring rank that owns the chain's
            last piece; the sum over the SP group is the final state. Nothing more is communicated here.

    Returns:
        ``out [B, n, H, d_v]`` in v.dtype (differentiable in every input), or ``(out, share)``.
    """
    cfg = mesh.settings
    lin = cfg.linear
    _check(q, k, v, beta, log_decay, initial_state)
    _, n, h, _ = q.shape
    layout = input_layout(mesh)
    layout.check_length(n * layout.world)
    chain_owners(layout.ring)  # layout check, pre-comm
    check_heads(h, mesh, "a delta-rule layer")
    heads = HeadPlan.build(h, h, mesh.ulysses_size)
    check_same_inputs(mesh, "delta_rule_attention", ("q", "k", "v", "beta", "log_decay", "initial_state"),
                      (q, k, v, beta, log_decay, initial_state), fix=SAME_SCAN_SHARDS)  # fmt: skip
    group, me, stats = mesh.group("ulysses"), mesh.coords.ulysses_rank, mesh.comm_stats
    gate = None if log_decay is None else (log_decay if log_decay.dim() == 4 else log_decay.unsqueeze(-1))
    parts = [q, k, v, beta.unsqueeze(-1)] + ([gate] if gate is not None else [])
    q2, k2, v2, beta2, *rest = to_heads(parts, heads, group, me, stats)
    beta2 = beta2.squeeze(-1)
    decay2 = None
    if log_decay is not None:
        decay2 = rest[0] if log_decay.dim() == 4 else rest[0].squeeze(-1)
    start = sum(heads.q_counts[:me])
    init2 = None if initial_state is None else initial_state[:, start : start + heads.q_counts[me]]
    plan = scan_plan(mesh, q2.shape[1], lin.chunk_size, lin.blocks, lin.scan, scale)
    out, final = _DeltaScan.apply(q2, k2, v2, beta2, decay2, init2, plan)
    (full,) = head_to_seq((out,), (heads.q_counts,), group, me, stats)
    if not final_state:
        return full
    share = final.new_zeros(q.shape[0], h, *final.shape[2:])
    if plan.scan.owners[-1] == plan.scan.me:
        share[:, start : start + heads.q_counts[me]] = final
    return full, share


_HALO_PLANS: dict[tuple, HaloPlan] = {}


def conv_halo_plan(mesh: SeqParMesh, local_len: int, width: int) -> HaloPlan:
    """The halo plan of this SP rank for ``width`` rows before each run (cached per mesh layout and length)."""
    layout = input_layout(mesh)
    seq_len = local_len * layout.world
    key = (id(mesh), repr(layout), seq_len, width, mesh.coords.sp_rank)
    if key not in _HALO_PLANS:
        positions = [layout.local_positions(seq_len, r) for r in range(layout.world)]
        _HALO_PLANS[key] = halo_plan(positions, mesh.coords.sp_rank, width)
    return _HALO_PLANS[key]


def sharded_causal_conv1d(
    x: torch.Tensor,
    conv: torch.nn.Conv1d | tuple[torch.Tensor, torch.Tensor | None],
    *,
    mesh: SeqParMesh,
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The causal depthwise conv1d of the whole sequence on this rank's rows ``x [B, n, C]`` -> ``[B, n, C]``.

    ``conv``: the model's depthwise ``nn.Conv1d`` (called as a module, so ZeRO-3 gathers its weight), or
    ``(weight [C, K], bias)``. Sends each run's last K - 1 inputs to the rank whose next run starts after
    them (``comm/halo.py``), then convolves every local run with its halo as history, in one conv call.
    """
    if x.dim() != 3:
        raise ValueError(f"sharded_causal_conv1d takes x [B, n, C], got shape {tuple(x.shape)}")
    width = (conv.kernel_size[0] if isinstance(conv, torch.nn.Conv1d) else conv[0].shape[-1]) - 1
    plan = conv_halo_plan(mesh, x.shape[1], width)
    check_same_inputs(mesh, "sharded_causal_conv1d", ("x",), (x,), (width,), SAME_SCAN_SHARDS, ("halo",))
    sp = mesh.group("sp")
    halo = halo_exchange(x, plan, sp, mesh.members["sp"], mesh.coords.sp_rank, mesh.comm_stats)
    return causal_conv1d_runs(x, plan.runs, halo, conv, activation)
