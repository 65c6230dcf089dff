"""Mamba selective scans under SP (``parallel/selective_scan.py``) on gloo ranks vs the token-by-token recurrence.

Every rank builds the same global inputs and upstream gradient, runs the fp64 sequential recurrence on the
whole sequence, then the distributed path on its shard, and compares out and the gradients (fp64 <= 1e-10;
A's gradient summed over the SP ranks). Mamba v1 (``selective_scan``): one or two B/C groups, mild and
strong decays (cumulative log decays far below fp64's exp range). Mamba2 (``ssd_scan``) with one head and
U > 1 (the head split along head_dim). Bytes: one ``[B, D/U, N, 1]`` state per ring hop, and the
all-to-all carries dt·x, dt, B and C in and y out (docs/delta.md "Mamba v1").
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from ds_seqpar import input_layout
from ds_seqpar.ops.linear import linear_attention_reference
from ds_seqpar.parallel.selective_scan import selective_scan, ssd_scan
from tests.helpers.cases import ScanCase
from tests.helpers.meshes import mesh_for
from tests.helpers.references import assert_within

B, D, N, HEAD_DIM = 2, 4, 3, 4


def _v1_inputs(seq_len: int, decay: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    groups = 2 if decay == "groups" else 1
    strength = 40.0 if decay == "strong" else 0.5  # strong: dt·A down to -320 per token
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return {
        "x": randn(B, seq_len, D),
        "dt": torch.rand(B, seq_len, D, generator=g, dtype=torch.float64) * strength,
        "a": -torch.arange(1, N + 1, dtype=torch.float64).repeat(D, 1)
        * (1 + torch.rand(D, N, generator=g, dtype=torch.float64)),
        "b": randn(B, seq_len, groups, N),
        "c": randn(B, seq_len, groups, N),
        "dout": randn(B, seq_len, D),
    }


def v1_reference(x, dt, a, b, c) -> torch.Tensor:
    """h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t; y_t = C_t h_t, token by token (channel c uses group c // (D/G))."""
    group = torch.arange(x.shape[-1]) // (x.shape[-1] // b.shape[2])
    h = x.new_zeros(x.shape[0], x.shape[-1], a.shape[-1])
    ys = []
    for t in range(x.shape[1]):
        h = torch.exp(dt[:, t, :, None] * a) * h + (dt[:, t] * x[:, t])[:, :, None] * b[:, t][:, group]
        ys.append((h * c[:, t][:, group]).sum(-1))
    return torch.stack(ys, dim=1)


def _run_v1(case: ScanCase, mesh) -> dict:
    layout, me = input_layout(mesh), mesh.coords.sp_rank
    t = _v1_inputs(case.seq_len, case.decay, case.seed)
    leaves = {n: x.clone().requires_grad_() for n, x in t.items() if n != "dout"}
    ref = v1_reference(**leaves)
    ref.backward(t["dout"])
    local = {
        n: (x if n == "a" else layout.shard(x, me)).detach().clone().requires_grad_()
        for n, x in leaves.items()
    }
    with mesh.comm_stats.measure() as fwd:
        out = selective_scan(**local, mesh=mesh)
    out.backward(layout.shard(t["dout"], me))
    errors = {"out": (out - layout.shard(ref.detach(), me)).abs().max().item()}
    for name in ("x", "dt", "b", "c"):
        errors["d" + name] = (local[name].grad - layout.shard(leaves[name].grad, me)).abs().max().item()
    return {"errors": errors, "da": local["a"].grad, "ref_da": leaves["a"].grad, "fwd": fwd}


def _run_ssd(case: ScanCase, mesh) -> dict:
    """One Mamba2 head of width HEAD_DIM at U > 1: split into sub-heads along head_dim."""
    layout, me = input_layout(mesh), mesh.coords.sp_rank
    g = torch.Generator().manual_seed(case.seed)
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    t = {
        "c": randn(B, case.seq_len, 1, N),
        "b": randn(B, case.seq_len, 1, N),
        "x": randn(B, case.seq_len, 1, HEAD_DIM),
    }
    t["decay"] = -torch.rand(B, case.seq_len, 1, generator=g, dtype=torch.float64)
    dout = randn(B, case.seq_len, 1, HEAD_DIM)
    leaves = {n: x.clone().requires_grad_() for n, x in t.items()}
    ref, _ = linear_attention_reference(leaves["c"], leaves["b"], leaves["x"], leaves["decay"])
    ref.backward(dout)
    local = {n: layout.shard(x.detach(), me).clone().requires_grad_() for n, x in leaves.items()}
    out = ssd_scan(local["c"], local["b"], local["x"], local["decay"], mesh=mesh)
    out.backward(layout.shard(dout, me))
    errors = {"out": (out - layout.shard(ref.detach(), me)).abs().max().item()}
    for name in t:
        errors["d" + name] = (local[name].grad - layout.shard(leaves[name].grad, me)).abs().max().item()
    return {"errors": errors}


def run_selective_cases(cases: list[ScanCase]) -> list[dict]:
    world = dist.get_world_size()
    results = []
    for case in cases:
        mesh = mesh_for(case.section(world))
        res = _run_ssd(case, mesh) if case.decay == "ssd" else _run_v1(case, mesh)
        if "fwd" in res:
            fwd = res.pop("fwd")
            res["p2p_fwd"], res["a2a_fwd"] = fwd.bytes("p2p"), fwd.bytes("all_to_all")
        results.append(res)
    return results


def _check(cases: list[ScanCase], results: list[list[dict]], world: int) -> None:
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        for rank, res in enumerate(per_rank):
            assert_within(res["errors"], 1e-10, f"{case} rank {rank}")
        if case.decay == "ssd":
            continue
        da = sum(r["da"] for r in per_rank)
        assert (da - per_rank[0]["ref_da"]).abs().max() <= 1e-10, case
        ring, n, groups = world // case.u, case.seq_len // world, 2 if case.decay == "groups" else 1
        state = B * (D // case.u) * N * 8
        a2a = 8 * B * n * (case.u - 1) * (3 * (D // case.u) + 2 * groups * N)  # dt·x, dt, y; B and C
        for sp_rank, res in enumerate(per_rank):
            assert res["a2a_fwd"] == a2a, (case, sp_rank, res["a2a_fwd"], a2a)
            if case.layout == "contiguous":
                r = sp_rank // case.u
                assert res["p2p_fwd"] == (state if r < ring - 1 else 0), (case, sp_rank, res["p2p_fwd"])


def _cases(p: int) -> list[ScanCase]:
    us = [u for u in (1, 2, 4) if p % u == 0]
    kinds = (("mild", "contiguous"), ("groups", "zigzag"), ("strong", "contiguous"), ("strong", "zigzag"))
    cases = [
        ScanCase(u=u, decay=decay, layout=layout, blocks=2, chunk=3)
        for u, (decay, layout) in itertools.product(us, kinds)
    ]
    cases += [ScanCase(u=u, decay="ssd", chunk=3) for u in us if u > 1]
    return [replace(case, seq_len=6 * p * max(2, case.u), seed=i) for i, case in enumerate(cases)]


@pytest.mark.parametrize(
    "p", [2, 4, pytest.param(3, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)]
)
def test_selective_scan_matches_sequential_recurrence(dist_pool, p):
    cases = _cases(p)
    _check(cases, dist_pool(p).run(run_selective_cases, cases), p)


def run_refusals(sections: list[dict]) -> list[str]:
    """Inputs the scan cannot split raise on every rank before any collective (the pool stays usable)."""
    messages = []
    for section in sections:
        mesh = mesh_for(section)
        x = torch.randn(1, 8, 1, dtype=torch.float64)  # one channel
        b = torch.randn(1, 8, 1, N, dtype=torch.float64)
        try:
            selective_scan(x, x.abs(), -torch.ones(1, N, dtype=torch.float64), b, b, mesh=mesh)
        except Exception as exc:  # the message is what is checked
            messages.append(f"{type(exc).__name__}: {exc}")
        else:
            messages.append("no error")
    dist.barrier()
    return messages


def test_what_cannot_be_split_is_refused_before_communication(dist_pool):
    sections = [
        {"size": 2, "ulysses_degree": 2, "ring": {"layout": "contiguous"}},
        {"size": 2, "ulysses_degree": 1, "ring": {"layout": "stripe", "granularity": 2}},
    ]
    for messages in dist_pool(2).run(run_refusals, sections):
        assert "Mamba selective-scan layer (its channels are the heads) has H=1 heads" in messages[0]
        assert "layout='stripe' is not supported" in messages[1]
