"""SeqParMesh on real gloo ranks: every group's members and every rank's coordinates."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ds_seqpar import SeqParConfigError, SeqParMesh, parse_section, plan_mesh
from ds_seqpar.mesh import GROUP_KINDS

# (world, sp, ulysses, ring_inner or None): dp = world / sp, R = sp / U, R_outer = R / R_inner
FACTORISATIONS = {
    1: [(1, 1, 1, None)],
    2: [(2, 2, 1, None), (2, 2, 2, None), (2, 1, 1, None)],
    4: [(4, 4, 1, None), (4, 4, 2, None), (4, 4, 4, None), (4, 2, 1, None), (4, 2, 2, None), (4, 4, 1, 2)],
    8: [(8, 8, 2, 2), (8, 8, 1, 4), (8, 4, 2, None), (8, 8, 1, 2), (8, 2, 1, None), (8, 8, 8, None)],
}


def expected_groups(world: int, sp: int, u: int, ri: int | None, rank: int) -> dict[str, list[int]]:
    """Members written out directly from the rank formula rank = dp*SP + (outer*Ri + inner)*U + uly."""
    r = sp // u
    ri = ri or r
    ro = r // ri
    dp, rem = divmod(rank, sp)
    ring, uly = divmod(rem, u)
    outer, inner = divmod(ring, ri)
    base = dp * sp
    return {
        "sp": list(range(base, base + sp)),
        "ulysses": [base + ring * u + x for x in range(u)],
        "ring": [base + q * u + uly for q in range(r)],
        "ring_inner": [base + (outer * ri + i) * u + uly for i in range(ri)],
        "ring_outer": [base + (o * ri + inner) * u + uly for o in range(ro)],
        "dp": [d * sp + rem for d in range(world // sp)],
        "sp_dp": list(range(world)),
    }


def build_and_describe(sp: int, u: int, ri: int | None) -> dict:
    """Build a mesh, then report coordinates, member lists and what the live groups really contain."""
    mesh = SeqParMesh.build(sp, u, ri)
    live = {kind: dist.get_process_group_ranks(mesh.group(kind)) for kind in GROUP_KINDS}
    # a real collective on every group: the sum of global ranks must equal the sum of the members
    sums = {}
    for kind in GROUP_KINDS:
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=mesh.group(kind))
        sums[kind] = t.item()
    mpu = mesh.mpu()
    return {
        "coords": mesh.coords,
        "members": mesh.members,
        "live": live,
        "sums": sums,
        "mpu": (
            mpu.get_sequence_parallel_world_size(),
            mpu.get_sequence_parallel_rank(),
            mpu.get_sequence_data_parallel_world_size(),
            mpu.get_sequence_data_parallel_rank(),
            dist.get_process_group_ranks(mpu.get_sequence_data_parallel_group()),
            dist.get_process_group_ranks(mpu.get_model_parallel_group()),
            # ZeRO-3 would partition over get_data_parallel_group() and skip the SP ranks
            hasattr(mpu, "get_data_parallel_group"),
        ),
        "describe": mesh.describe(),
    }


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_mesh_groups_and_coordinates_on_real_ranks(dist_pool, world):
    pool = dist_pool(world)
    for w, sp, u, ri in FACTORISATIONS[world]:
        out = pool.run(build_and_describe, sp, u, ri)
        r_inner = ri or sp // u
        for rank, rep in enumerate(out):
            exp = expected_groups(w, sp, u, ri, rank)
            case = f"world={w} sp={sp} U={u} R_inner={r_inner} rank={rank}"
            assert rep["members"] == exp, case
            assert rep["live"] == exp, case
            assert rep["sums"] == {k: float(sum(v)) for k, v in exp.items()}, case
            c = rep["coords"]
            assert c.rank == rank
            assert (c.dp_rank, c.sp_rank) == divmod(rank, sp), case
            assert (c.ring_rank, c.ulysses_rank) == divmod(c.sp_rank, u), case
            assert (c.ring_outer_rank, c.ring_inner_rank) == divmod(c.ring_rank, r_inner), case
            assert rep["mpu"] == (sp, rank % sp, w, rank, exp["sp_dp"], exp["sp"], False), case
            assert rep["describe"].startswith(f"rank {rank}: dp {rank // sp}/{w // sp}"), case


def test_plan_example_world8_written_out():
    """world 8 = dp 1 x (R_outer 2 x R_inner 2 x U 2): the table from docs/architecture.md."""
    plan = plan_mesh(8, 8, 2, 2)
    assert plan.groups("ulysses") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan.groups("ring") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert plan.groups("ring_inner") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert plan.groups("ring_outer") == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert plan.groups("dp") == [[r] for r in range(8)]
    c = plan.coords(6)
    assert (c.ulysses_rank, c.ring_rank, c.ring_outer_rank, c.ring_inner_rank) == (0, 3, 1, 1)


def test_every_rank_is_in_exactly_one_group_of_each_kind():
    for world, cases in FACTORISATIONS.items():
        for w, sp, u, ri in cases:
            plan = plan_mesh(w, sp, u, ri)
            for kind in GROUP_KINDS:
                flat = sorted(r for g in plan.groups(kind) for r in g)
                assert flat == list(range(world)), (kind, w, sp, u, ri)


def test_plan_rejects_bad_sizes_with_valid_values():
    with pytest.raises(
        SeqParConfigError, match=r"size=3 does not divide the world size 8 .*; valid: 1, 2, 4, 8"
    ):
        plan_mesh(8, 3)
    with pytest.raises(SeqParConfigError, match=r"ulysses_degree=3 does not divide size=4; valid: 1, 2, 4"):
        plan_mesh(8, 4, 3)
    with pytest.raises(
        SeqParConfigError, match=r"inner_size=3 does not divide the ring degree R=4 .*; valid: null, 1, 2, 4"
    ):
        plan_mesh(8, 8, 2, 3)


def test_build_without_process_group_says_what_to_call():
    with pytest.raises(RuntimeError, match="init_distributed"):
        SeqParMesh.build(1)


def test_from_config_checks_world_before_any_collective():
    cfg = parse_section({"size": 3, "ulysses_degree": 1})
    with pytest.raises(SeqParConfigError, match=r"size=3 does not divide the world size 4"):
        cfg.validate(None, world_size=4)
