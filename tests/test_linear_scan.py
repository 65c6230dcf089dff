"""Linear attention under SP (Ulysses x All-Scan) on gloo ranks vs the single-process sequential recurrence.

Every rank builds the same global q, k, v, decay, initial state and upstream gradient, runs the
token-by-token reference (``ops/linear.linear_attention_reference``) on the whole sequence, then the
distributed path on its shard, and compares out and the gradients of q, k, v, the decay and the
initial state (fp64 <= 1e-10). Bytes per ring hop are checked against one state per direction.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from ds_seqpar import input_layout
from ds_seqpar.ops.linear import linear_attention_reference
from ds_seqpar.parallel.linear_scan import linear_attention
from tests.helpers.cases import ScanCase
from tests.helpers.meshes import mesh_for
from tests.helpers.references import assert_within

B, H, DK, DV = 2, 4, 4, 3


def _inputs(seq_len: int, decay: str, seed: int) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    t = {
        "q": torch.randn(B, seq_len, H, DK, generator=g, dtype=torch.float64),
        "k": torch.randn(B, seq_len, H, DK, generator=g, dtype=torch.float64),
        "v": torch.randn(B, seq_len, H, DV, generator=g, dtype=torch.float64),
        "init": torch.randn(B, H, DK, DV, generator=g, dtype=torch.float64),
        "dout": torch.randn(B, seq_len, H, DV, generator=g, dtype=torch.float64),
    }
    if decay == "scalar":
        t["decay"] = -torch.rand(H, generator=g, dtype=torch.float64) * 0.3
    elif decay == "token":  # Mamba2: one scalar per token and head
        t["decay"] = -torch.rand(B, seq_len, H, generator=g, dtype=torch.float64) * 0.3
    elif decay == "gate":
        t["decay"] = -torch.rand(B, seq_len, H, DK, generator=g, dtype=torch.float64) * 0.3
    else:
        t["decay"] = None
    return t


def run_linear_cases(cases: list[ScanCase]) -> list[dict]:
    world = dist.get_world_size()
    results = []
    for case in cases:
        mesh = mesh_for(case.section(world))
        layout = input_layout(mesh)
        seq_len = case.seq_len
        t = _inputs(seq_len, case.decay, case.seed)
        leaves = {n: x.clone().requires_grad_() for n, x in t.items() if n != "dout" and x is not None}
        ref, _ = linear_attention_reference(
            leaves["q"], leaves["k"], leaves["v"], leaves.get("decay"), leaves["init"], scale=0.5
        )
        ref.backward(t["dout"])
        me = mesh.coords.sp_rank
        local = {
            n: (x.detach() if x.dim() == 1 else layout.shard(x.detach(), me)).clone().requires_grad_()
            for n, x in leaves.items()
            if n != "init"
        }
        init = t["init"].clone().requires_grad_()
        with mesh.comm_stats.measure() as fwd:
            out = linear_attention(
                local["q"],
                local["k"],
                local["v"],
                mesh=mesh,
                log_decay=local.get("decay"),
                initial_state=init,
                scale=0.5,
            )
        with mesh.comm_stats.measure() as bwd:
            out.backward(layout.shard(t["dout"], me))
        errors = {"out": (out - layout.shard(ref.detach(), me)).abs().max().item()}
        for name in ("q", "k", "v") + (("decay",) if "decay" in local and local["decay"].dim() > 1 else ()):
            errors["d" + name] = (local[name].grad - layout.shard(leaves[name].grad, me)).abs().max().item()
        grads = {"init": init.grad}
        if "decay" in local:
            grads["decay"] = local["decay"].grad
        results.append(
            {
                "errors": errors,
                "grads": grads,
                "p2p_fwd": fwd.bytes("p2p"),
                "p2p_bwd": bwd.bytes("p2p"),
                "gather_fwd": fwd.bytes("all_gather"),
                "ref_init": leaves["init"].grad,
                "ref_decay": leaves["decay"].grad if "decay" in leaves else None,
            }
        )
    return results


def _check(cases: list[ScanCase], results: list[list[dict]], world: int) -> None:
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        for rank, res in enumerate(per_rank):
            assert_within(res["errors"], 1e-10, f"{case} rank {rank}")
        # replicated leaves (initial state, per-head decay): the SP group's gradients sum to the reference
        init = sum(r["grads"]["init"] for r in per_rank)
        assert (init - per_rank[0]["ref_init"]).abs().max() <= 1e-10, case
        if case.decay == "scalar":
            decay = sum(r["grads"]["decay"] for r in per_rank)
            assert (decay - per_rank[0]["ref_decay"]).abs().max() <= 1e-10, case
        # bytes: one [B, H/U, d_k, d_v] state per hop and direction, whatever S is (All-Scan);
        # the all-gather mode receives every other rank's pieces instead
        state = B * (H // case.u) * DK * DV * 8
        ring = world // case.u
        for sp_rank, res in enumerate(per_rank):
            r = sp_rank // case.u
            if case.mode == "all_scan" and case.layout == "contiguous":
                assert res["p2p_fwd"] == (state if r < ring - 1 else 0), (case, sp_rank, res["p2p_fwd"])
                assert res["p2p_bwd"] == (state if r > 0 else 0), (case, sp_rank, res["p2p_bwd"])
            elif case.mode == "all_scan":  # zigzag: up the ranks, turn on rank R-1, back down
                assert res["p2p_fwd"] == state * (2 if 0 < r < ring - 1 else (1 if ring > 1 else 0)), case
            else:
                pieces = case.segments
                per_piece = B * (H // case.u) * DK * (DV + 1) * 8  # state + log Gamma column
                assert res["gather_fwd"] == pieces * per_piece * (ring - 1), case


def _cases(p: int) -> list[ScanCase]:
    us = [u for u in (1, 2, 4) if p % u == 0 and H % u == 0]
    cases = [
        ScanCase(decay=decay, blocks=blocks, layout=layout, chunk=3)
        for decay, blocks, layout in itertools.product(
            ("none", "scalar", "token", "gate"), (1, 2, DK), ("contiguous", "zigzag")
        )
    ]
    cases += [
        ScanCase(u=u, decay="gate", blocks=2, layout=layout, mode=mode)
        for u, mode, layout in itertools.product(us, ("all_scan", "all_gather"), ("contiguous", "zigzag"))
    ]
    cases += [ScanCase(u=u, decay="token", blocks=2) for u in us]
    cases += [  # Mamba2's decay through the all-gather too
        ScanCase(decay="token", layout=layout, mode="all_gather", chunk=3)
        for layout in ("contiguous", "zigzag")
    ]
    return [replace(case, seq_len=6 * p * max(2, case.u), seed=i) for i, case in enumerate(cases)]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_linear_scan_matches_sequential_recurrence(dist_pool, p):
    cases = _cases(p)
    _check(cases, dist_pool(p).run(run_linear_cases, cases), p)


def run_error_cases(cases: list[dict]) -> list[str]:  # a list of bad inputs, not a sweep
    """Bad inputs raise on every rank before any collective (the pool stays usable afterwards)."""
    world = dist.get_world_size()
    messages = []
    for case in cases:
        mesh = mesh_for({"size": world, "ulysses_degree": 1, "ring": case["ring"]})
        q = torch.randn(1, 8, H, DK, dtype=torch.float64)
        try:
            linear_attention(
                q, q, torch.randn(1, 8, H, DV, dtype=torch.float64), mesh=mesh, log_decay=case["decay"]
            )
        except ValueError as exc:
            messages.append(str(exc))
        else:
            messages.append("no error")
    dist.barrier()
    return messages


def test_bad_inputs_fail_before_communication(dist_pool):
    cases = [
        dict(ring={"layout": "stripe", "granularity": 2}, decay=None),
        dict(ring={"layout": "contiguous"}, decay=torch.zeros(H + 1)),
    ]
    for messages in dist_pool(2).run(run_error_cases, cases):
        assert "layout='stripe' is not supported" in messages[0]
        assert "log_decay shape (5,) must be [H] = (4,)" in messages[1]


def test_unsupported_recurrent_layers_are_named():
    from ds_seqpar.integrations.recurrent_layers import route_recurrent_layers

    class TinyGatedDeltaNet(torch.nn.Module):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), TinyGatedDeltaNet())
    with pytest.raises(TypeError, match=r"Sequential\.1 is a TinyGatedDeltaNet"):
        route_recurrent_layers(model)
    assert route_recurrent_layers(torch.nn.Sequential(torch.nn.Linear(2, 2))) == 0


def run_diagonal_cases(cases: list[tuple[ScanCase, bool]]) -> list[dict]:
    """The diagonal recurrence (RG-LRU, RWKV's WKV) and the token shift on this rank's shard vs the whole
    sequence in one process: max errors of out, dx, da and of the shift and its gradient."""
    from ds_seqpar.ops.linear.diagonal import diagonal_reference
    from ds_seqpar.parallel.diagonal_scan import diagonal_recurrence, token_shift

    world, results = dist.get_world_size(), []
    for case, exclusive in cases:
        mesh = mesh_for(case.section(world))
        layout, me = input_layout(mesh), mesh.coords.sp_rank
        g = torch.Generator().manual_seed(case.seed)
        x, dout = (torch.randn(B, case.seq_len, 8, generator=g, dtype=torch.float64) for _ in range(2))
        a = torch.rand(B, case.seq_len, 8, generator=g, dtype=torch.float64)
        a[:, ::5] = 0.0  # resets, some on piece boundaries
        whole = [t.clone().requires_grad_() for t in (x, a)]
        diagonal_reference(*whole, exclusive).backward(dout)
        mine = [layout.shard(t, me).clone().requires_grad_() for t in (x, a)]
        out = diagonal_recurrence(*mine, mesh=mesh, exclusive=exclusive)
        out.backward(layout.shard(dout, me))
        errors = {"out": (out - layout.shard(diagonal_reference(x, a, exclusive), me)).abs().max().item()}
        errors |= {f"d{n}": (m.grad - layout.shard(w.grad, me)).abs().max().item()
                   for n, m, w in zip("xa", mine, whole, strict=True)}  # fmt: skip
        shifted_in = layout.shard(x, me).clone().requires_grad_()
        shifted = token_shift(shifted_in, mesh=mesh)
        shifted.backward(layout.shard(dout, me))
        full_shift = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
        full_grad = torch.cat([dout[:, 1:], torch.zeros_like(dout[:, :1])], dim=1)
        errors["shift"] = (shifted - layout.shard(full_shift, me)).abs().max().item()
        errors["dshift"] = (shifted_in.grad - layout.shard(full_grad, me)).abs().max().item()
        results.append(errors)
    return results


def test_diagonal_recurrence_and_token_shift_match_the_whole_sequence(dist_pool):
    cases = [
        (ScanCase(u=u, layout=layout, mode=mode, seq_len=48, seed=i), exclusive)
        for i, (u, layout, mode, exclusive) in enumerate(
            itertools.product((1, 2), ("contiguous", "zigzag"), ("all_scan", "all_gather"), (False, True))
        )
    ]
    for per_rank in dist_pool(4).run(run_diagonal_cases, cases):
        for (case, exclusive), errors in zip(cases, per_rank, strict=True):
            assert_within(errors, 1e-10, f"{case} exclusive={exclusive}")


def run_mlstm_cases(cases: list[ScanCase]) -> list[dict]:
    """``mlstm_attention`` on this rank's shard vs HF's token-by-token mLSTM (fp64, zero initial states) on
    the whole sequence: relative max errors of h and of the gradients of q, k, v and both gates."""
    from transformers.models.xlstm import modeling_xlstm

    from ds_seqpar.parallel.mlstm_scan import mlstm_attention

    world, results = dist.get_world_size(), []
    for case in cases:
        mesh = mesh_for(case.section(world))
        layout, me = input_layout(mesh), mesh.coords.sp_rank
        g = torch.Generator().manual_seed(case.seed)
        shapes = [(B, case.seq_len, H, DK)] * 2 + [(B, case.seq_len, H, DV), (B, case.seq_len, H)]
        q, k, v, i = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
        i = i * 6.0  # large input gates: the stabiliser moves, its eps term matters
        f = torch.randn(B, case.seq_len, H, generator=g, dtype=torch.float64) * 3.0 + 2.0
        dout = torch.randn(B, case.seq_len, H, DV, generator=g, dtype=torch.float64)
        whole = [t.clone().requires_grad_() for t in (q, k, v, i, f)]
        heads_first = [t.transpose(1, 2) for t in whole]
        ref = modeling_xlstm.mlstm_recurrent_sequence_native(*heads_first, dtype_state=torch.float64)
        ref = ref[0] if isinstance(ref, tuple) else ref
        ref.transpose(1, 2).backward(dout)
        mine = [layout.shard(t, me).clone().requires_grad_() for t in (q, k, v, i, f)]
        out = mlstm_attention(*mine, mesh=mesh)
        out.backward(layout.shard(dout, me))
        pairs = {"out": (out, layout.shard(ref.detach().transpose(1, 2), me))}
        pairs |= {
            f"d{n}": (m.grad, layout.shard(w.grad, me)) for n, m, w in zip("qkvif", mine, whole, strict=True)
        }
        # relative to the largest entry: the stabiliser's 1 / (max(|q n|, e^-m) + eps) makes gradients large
        results.append({n: ((a - b).abs().max() / b.abs().max()).item() for n, (a, b) in pairs.items()})
    return results


def test_mlstm_matches_the_token_by_token_recurrence(dist_pool):
    cases = [
        ScanCase(
            u=u, layout=layout, mode=mode, chunk=4 if layout == "zigzag" else 5, blocks=2, seq_len=48, seed=n
        )
        for n, (u, layout, mode) in enumerate(
            itertools.product((1, 2), ("contiguous", "zigzag"), ("all_scan", "all_gather"))
        )
    ]
    for per_rank in dist_pool(4).run(run_mlstm_cases, cases):
        for case, errors in zip(cases, per_rank, strict=True):
            assert_within(errors, 1e-9, str(case))
