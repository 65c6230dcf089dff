"""Delta-rule layers (GDN, KDA) and the conv1d halo under SP on gloo ranks vs the single-process recurrence.

Every rank builds the same global inputs and upstream gradient, runs the token-by-token reference
(``ops/delta.delta_rule_reference``, a plain causal conv for the halo) on the whole sequence, then
the distributed path on its shard, and compares outputs and every gradient (fp64 <= 1e-10). Bytes:
one state per ring hop and direction (All-Scan), the (M, N) of every other piece (all-gather), and
K - 1 rows per run whose halo another rank holds.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_seqpar import input_layout
from ds_seqpar.comm.halo import halo_plan
from ds_seqpar.comm.scan import gathered_elements
from ds_seqpar.ops.conv import causal_conv1d
from ds_seqpar.ops.delta import delta_rule_reference
from ds_seqpar.parallel.delta_scan import delta_rule_attention, sharded_causal_conv1d
from tests.helpers.cases import ScanCase
from tests.helpers.meshes import mesh_for
from tests.helpers.references import assert_within

B, H, DK, DV = 2, 4, 3, 4


def _inputs(seq_len: int, decay: str, seed: int) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    t = {
        "q": torch.randn(B, seq_len, H, DK, generator=g, dtype=f64),
        "k": F.normalize(torch.randn(B, seq_len, H, DK, generator=g, dtype=f64), dim=-1),
        "v": torch.randn(B, seq_len, H, DV, generator=g, dtype=f64),
        "beta": torch.rand(B, seq_len, H, generator=g, dtype=f64),
        "init": torch.randn(B, H, DK, DV, generator=g, dtype=f64),
        "dout": torch.randn(B, seq_len, H, DV, generator=g, dtype=f64),
    }
    shape = {"gdn": (B, seq_len, H), "kda": (B, seq_len, H, DK)}.get(decay)
    t["decay"] = None if shape is None else -torch.rand(*shape, generator=g, dtype=f64) * 0.4
    return t


def run_delta_cases(cases: list[ScanCase]) -> list[dict]:
    world = dist.get_world_size()
    results = []
    for case in cases:
        mesh = mesh_for(case.section(world))
        layout = input_layout(mesh)
        t = _inputs(case.seq_len, case.decay, case.seed)
        leaves = {n: x.clone().requires_grad_() for n, x in t.items() if n != "dout" and x is not None}
        ref, _ = delta_rule_reference(
            leaves["q"],
            leaves["k"],
            leaves["v"],
            leaves["beta"],
            leaves.get("decay"),
            leaves["init"],
            scale=0.6,
        )
        ref.backward(t["dout"])
        me = mesh.coords.sp_rank
        local = {
            n: layout.shard(x.detach(), me).clone().requires_grad_() for n, x in leaves.items() if n != "init"
        }
        init = t["init"].clone().requires_grad_()
        with mesh.comm_stats.measure() as fwd:
            out = delta_rule_attention(
                local["q"], local["k"], local["v"], local["beta"], mesh=mesh, log_decay=local.get("decay"),
                initial_state=init, scale=0.6,
            )  # fmt: skip
        with mesh.comm_stats.measure() as bwd:
            out.backward(layout.shard(t["dout"], me))
        errors = {"out": (out - layout.shard(ref.detach(), me)).abs().max().item()}
        for name, x in local.items():
            errors["d" + name] = (x.grad - layout.shard(leaves[name].grad, me)).abs().max().item()
        results.append(
            {
                "errors": errors,
                "init": init.grad,
                "ref_init": leaves["init"].grad,
                "p2p_fwd": fwd.bytes("p2p"),
                "p2p_bwd": bwd.bytes("p2p"),
                "gather_fwd": fwd.bytes("all_gather"),
                "gather_bwd": bwd.bytes("all_gather"),
            }
        )
    return results


def _check(cases: list[ScanCase], results: list[list[dict]], world: int) -> None:
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        for rank, res in enumerate(per_rank):
            assert_within(res["errors"], 1e-10, f"{case} rank {rank}")
        init = sum(r["init"] for r in per_rank)  # replicated initial state: the group's gradients sum
        assert (init - per_rank[0]["ref_init"]).abs().max() <= 1e-10, case
        h_u = H // case.u
        state = B * h_u * DK * DV * 8
        ring = world // case.u
        for sp_rank, res in enumerate(per_rank):
            r = sp_rank // case.u
            if case.mode == "all_scan" and case.layout == "contiguous":
                assert res["p2p_fwd"] == (state if r < ring - 1 else 0), (case, sp_rank, res["p2p_fwd"])
                assert res["p2p_bwd"] == (state if r > 0 else 0), (case, sp_rank, res["p2p_bwd"])
            elif case.mode == "all_scan":  # zigzag: up the ranks, turn on rank R-1, back down
                hops = 2 if 0 < r < ring - 1 else (1 if ring > 1 else 0)
                assert res["p2p_fwd"] == state * hops and res["p2p_bwd"] == state * hops, (case, sp_rank)
            else:  # every piece's (M, N) from the R - 1 others: forward and backward alike
                pieces = case.segments
                per_piece = B * h_u * gathered_elements("matrix", DK, DV) * 8
                assert res["gather_fwd"] == pieces * per_piece * (ring - 1), (case, res["gather_fwd"])
                assert res["gather_bwd"] == pieces * per_piece * (ring - 1), (case, res["gather_bwd"])


def _cases(p: int) -> list[ScanCase]:
    cases = [
        ScanCase(decay=decay, layout=layout, mode=mode, blocks=blocks, chunk=3)
        for decay, layout, (mode, blocks) in itertools.product(
            ("gdn", "kda"),
            ("contiguous", "zigzag"),
            (("all_scan", 1), ("all_scan", 2), ("all_scan", DV), ("all_gather", 1)),
        )
    ]
    cases.append(ScanCase(decay="none", blocks=2, chunk=5))
    for u in (u for u in (2, 4) if p % u == 0 and p > u):
        cases.append(ScanCase(u=u, decay="kda", blocks=2))
        cases.append(ScanCase(u=u, decay="gdn", layout="contiguous", mode="all_gather"))
    return [
        replace(case, seq_len=4 * p * max(2, case.u) + (2 * p if case.layout == "zigzag" else p), seed=i)
        for i, case in enumerate(cases)
    ]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_delta_scan_matches_sequential_recurrence(dist_pool, p):
    cases = _cases(p)
    _check(cases, dist_pool(p).run(run_delta_cases, cases), p)


# -- the conv1d halo -----------------------------------------------------------------------------


def run_conv_cases(cases: list[ScanCase]) -> list[dict]:
    world = dist.get_world_size()
    results = []
    for case in cases:
        mesh = mesh_for(case.section(world))
        layout = input_layout(mesh)
        g = torch.Generator().manual_seed(case.seed)
        c, kernel, s = 5, case.kernel, case.seq_len
        x = torch.randn(B, s, c, generator=g, dtype=torch.float64, requires_grad=True)
        w = torch.randn(c, kernel, generator=g, dtype=torch.float64, requires_grad=True)
        bias = torch.randn(c, generator=g, dtype=torch.float64, requires_grad=True)
        dy = torch.randn(B, s, c, generator=g, dtype=torch.float64)
        ref = causal_conv1d(x, w, bias)
        ref.backward(dy)
        me = mesh.coords.sp_rank
        xl = layout.shard(x.detach(), me).clone().requires_grad_()
        wl, bl = w.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
        conv = (wl, bl)
        if case.module:  # the model's own nn.Conv1d, as the HF adapters pass it
            conv = torch.nn.Conv1d(c, c, kernel, groups=c, padding=kernel - 1, dtype=torch.float64)
            conv.weight, conv.bias = (
                torch.nn.Parameter(wl.detach().unsqueeze(1)),
                torch.nn.Parameter(bl.detach()),
            )
        with mesh.comm_stats.measure() as fwd:
            y = sharded_causal_conv1d(xl, conv, mesh=mesh)
        with mesh.comm_stats.measure() as bwd:
            y.backward(layout.shard(dy, me))
        if case.module:
            wl.grad, bl.grad = conv.weight.grad.squeeze(1), conv.bias.grad
        results.append(
            {
                "out": (y - layout.shard(ref.detach(), me)).abs().max().item(),
                "dx": (xl.grad - layout.shard(x.grad, me)).abs().max().item(),
                "dw": wl.grad,
                "db": bl.grad,
                "ref_dw": w.grad,
                "ref_db": bias.grad,
                "p2p_fwd": fwd.bytes("p2p"),
                "p2p_bwd": bwd.bytes("p2p"),
                "positions": [layout.local_positions(s, r) for r in range(world)],
            }
        )
    return results


def test_conv_halo_matches_one_process(dist_pool):
    p = 4
    base = ScanCase(seq_len=8 * p)
    cases = [
        replace(base, layout="contiguous"),
        base,
        replace(base, u=2, kernel=3),
        replace(base, layout="stripe"),  # the halo spans three other ranks
        replace(base, layout="contiguous", kernel=1),  # no halo at all
        replace(base, module=True),
    ]
    cases = [replace(case, seed=i) for i, case in enumerate(cases)]
    results = dist_pool(p).run(run_conv_cases, cases)
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        assert all(r["out"] <= 1e-12 and r["dx"] <= 1e-12 for r in per_rank), (case, per_rank)
        for name in ("dw", "db"):  # replicated weights: the group's gradients sum to the reference
            total = sum(r[name] for r in per_rank)
            assert (total - per_rank[0]["ref_" + name]).abs().max() <= 1e-10, case
        width = case.kernel - 1
        for me, res in enumerate(per_rank):  # bytes: the rows other ranks need from this one, each way
            plan = halo_plan(res["positions"], me, width)
            sent = sum(len(rows) for rows in plan.sends.values()) * B * 5 * 8
            assert res["p2p_fwd"] == sent, (case, me, res["p2p_fwd"], sent)
            got = sum(len(v) for v in plan.receives(me).values()) * B * 5 * 8
            assert res["p2p_bwd"] == got, (case, me)


def test_halo_plan_contiguous_and_zigzag():
    contiguous = [torch.arange(4 * r, 4 * r + 4) for r in range(3)]
    plan = halo_plan(contiguous, 1, 2)
    assert plan.runs == ((0, 4),) and plan.sources == ((0, 2), (0, 3)) and plan.sends == {2: (2, 3)}
    assert halo_plan(contiguous, 0, 2).sources == (None, None)
    # zigzag over 2 ranks, chunks of 2: rank 0 holds [0, 1, 6, 7], rank 1 [2, 3, 4, 5]
    zigzag = [torch.tensor([0, 1, 6, 7]), torch.tensor([2, 3, 4, 5])]
    plan = halo_plan(zigzag, 0, 3)
    assert plan.runs == ((0, 2), (2, 4))
    assert plan.sources == (None, None, None, (1, 1), (1, 2), (1, 3))
    assert plan.sends == {1: (0, 1)}
    with pytest.raises(ValueError, match="halo width must be >= 0"):
        halo_plan(zigzag, 0, -1)


def run_delta_error_cases(cases: list[dict]) -> list[str]:
    """Bad inputs raise on every rank before any collective (the pool stays usable afterwards)."""
    world = dist.get_world_size()
    messages = []
    for case in cases:
        mesh = mesh_for(
            ScanCase(layout=case["layout"], granularity=2 if case["layout"] == "stripe" else 1).section(world)
        )
        q = torch.randn(1, 8, H, DK, dtype=torch.float64)
        try:
            delta_rule_attention(
                q,
                q,
                torch.randn(1, 8, H, DV, dtype=torch.float64),
                case["beta"],
                mesh=mesh,
                log_decay=case["decay"],
            )
        except ValueError as exc:
            messages.append(str(exc))
        else:
            messages.append("no error")
    dist.barrier()
    return messages


def test_bad_delta_inputs_fail_before_communication(dist_pool):
    beta = torch.rand(1, 8, H, dtype=torch.float64)
    cases = [
        dict(layout="stripe", beta=beta, decay=None),
        dict(layout="contiguous", beta=beta[..., :2], decay=None),
        dict(layout="contiguous", beta=beta, decay=torch.zeros(1, 8, H, DK + 1, dtype=torch.float64)),
        dict(layout="contiguous", beta=beta, decay=torch.ones(1, 8, H, dtype=torch.float64)),
    ]
    messages = dist_pool(2).run(run_delta_error_cases, cases)
    for got in messages:
        assert "layout='stripe' is not supported" in got[0]
        assert "beta shape (1, 8, 2) must be [B, n, H] = (1, 8, 4)" in got[1]
        assert "log_decay shape (1, 8, 4, 4) must be [B, n, H]" in got[2]
        assert "log_decay must be finite and <= 0" in got[3]
