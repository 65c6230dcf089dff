"""Ring engine on real gloo ranks vs the single-process dense reference (out, lse, dq, dk, dv).

Each rank builds the same global q, k, v, dout (same seed), runs the reference on the whole
sequence, shards everything with the layout, runs ring attention on its shard and reports the
max abs errors of its shard. Many cases run inside one spawned group per world size.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from ds_seqpar import SeqParMesh
from ds_seqpar.comm.p2p import RingComm
from ds_seqpar.comm.schedules.ring import RingSchedule
from ds_seqpar.layout import ring_layout
from ds_seqpar.ops.attention import block_attn_backward, block_attn_forward
from ds_seqpar.ops.masks import BlockKind, MaskSpec, token_mask
from ds_seqpar.ops.precision import accumulation_dtype
from ds_seqpar.parallel.ring import OutputDelta, RingPlan, WorkCounter, build_schedule, ring_attention
from ds_seqpar.parallel.ring.plan import step_tasks, tokens
from ds_seqpar.parallel.ring.tasks import BlockTask, backward_tiles, window_tile
from tests.helpers.cases import AttentionCase
from tests.helpers.references import TOL, B, D, H, assert_within, dense_reference, grad_errors, qkv_inputs


def run_ring_cases(cases: list[AttentionCase]) -> list[dict]:
    """Run every case on this rank; return max abs errors of this rank's shard per case."""
    results = []
    meshes: dict[tuple, SeqParMesh] = {}
    for case in cases:
        key = (case.inner,)
        if key not in meshes:
            world = torch.distributed.get_world_size()
            meshes[key] = SeqParMesh.build(world, 1, case.inner)
        mesh = meshes[key]
        r = mesh.ring_size
        layout = ring_layout(case.layout, r, case.granularity)
        seq_len = case.seq_len
        spec, docs = case.spec, case.doc_ids()
        dtype = case.dtype
        q, k, v, dout = qkv_inputs(seq_len, case.h_kv, dtype, case.seed)
        ref = dense_reference(q, k, v, dout, spec, docs)
        me = mesh.coords.ring_rank
        ql, kl, vl, dl = (
            layout.shard(t, me).detach().clone().requires_grad_(t is not dout) for t in (q, k, v, dout)
        )
        plan = RingPlan(
            build_schedule(mesh, case.schedule, case.overlap),
            layout,
            spec,
            docs,
            case.kernel,
            WorkCounter(),
            backward_tile=case.tile_min,
        )
        delta = OutputDelta() if case.delta else None  # the backward then runs on rowsum(dout * out)
        with mesh.comm_stats.measure() as fwd_bytes:
            out, lse = ring_attention(ql, kl, vl, plan, delta=delta)
        if delta is not None:
            acc = accumulation_dtype(dtype)
            delta.give((dl.to(acc) * out.detach().to(acc)).sum(-1))
        with mesh.comm_stats.measure() as bwd_bytes:
            out.backward(dl)
        ref_out, ref_lse, ref_dq, ref_dk, ref_dv = (
            layout.shard(t, me, dim=1 if t.dim() == 4 else 2) for t in ref
        )
        finite = torch.isfinite(ref_lse)
        errors = grad_errors(out, (ql, kl, vl), (ref_out, ref_dq, ref_dk, ref_dv))
        errors["lse"] = (lse.double()[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
        errors["lse_inf_match"] = bool((torch.isinf(lse) == ~finite).all())
        results.append(
            {
                "errors": errors,
                "fwd": fwd_bytes.as_dict(),
                "bwd": bwd_bytes.as_dict(),
                "work": plan.work.forward_pairs,
                "n": seq_len // r,
            }
        )
    return results


def _run_and_check(pool, cases: list[AttentionCase]) -> None:
    """Run all cases in the pool's group and check every rank's errors."""
    results = pool.run(run_ring_cases, cases)
    for i, case in enumerate(cases):
        _check(case, [per_rank[i] for per_rank in results])


def _check(case: AttentionCase, per_rank: list[dict]) -> None:
    for rank, res in enumerate(per_rank):
        e = res["errors"]
        where = f"{case} rank {rank}: {e}"
        assert not e["nan"], where
        assert e["lse_inf_match"], where
        assert_within({name: e[name] for name in ("out", "lse", "dq", "dk", "dv")}, TOL[case.dtype], where)


def _sweep(world: int) -> list[AttentionCase]:
    seq_len = 8 * world if world > 1 else 12
    cases = []
    for layout, causal, h_kv, dtype in itertools.product(
        ("contiguous", "zigzag", "stripe"), (True, False), (H, H // 2, 1), (torch.float64, torch.float32)
    ):
        cases.append(
            AttentionCase(
                layout=layout,
                causal=causal,
                h_kv=h_kv,
                dtype=dtype,
                seq_len=seq_len,
                seed=len(cases),
            )
        )
    # packed documents with odd lengths (and padding at the end), causal and not, every layout
    s = 16 * world
    for layout, causal in itertools.product(("contiguous", "zigzag", "stripe"), (True, False)):
        cuts = [0, 5, 5 + 3 * world, s - 3] if world > 1 else [0, 5, 11, 13]
        cases.append(
            AttentionCase(
                layout=layout,
                causal=causal,
                h_kv=2,
                dtype=torch.float64,
                seq_len=s,
                cu_seqlens=tuple(cuts),
                seed=100 + len(cases),
            )
        )
    # sliding window and block stripes
    cases.append(
        AttentionCase(
            layout="zigzag",
            causal=True,
            window=5,
            h_kv=1,
            dtype=torch.float64,
            seq_len=s,
            seed=7,
        )
    )
    cases.append(
        AttentionCase(
            layout="stripe",
            granularity=2,
            causal=True,
            h_kv=2,
            dtype=torch.float64,
            seq_len=s,
            seed=8,
        )
    )
    # the backward's FULL pieces as tiles of 2 rows a side (16 rows per rank), documents and windows too
    for layout, causal in itertools.product(("contiguous", "zigzag", "stripe"), (True, False)):
        cases.append(
            AttentionCase(
                layout=layout,
                causal=causal,
                h_kv=2,
                dtype=torch.float64,
                seq_len=s,
                tile_min=2,
                delta=causal,
                seed=200 + len(cases),
            )
        )
    cases.append(
        AttentionCase(
            layout="zigzag",
            causal=True,
            window=7,
            h_kv=1,
            dtype=torch.float32,
            seq_len=s,
            cu_seqlens=(0, 3, s // 2 + 1, s),
            tile_min=2,
            seed=9,
        )
    )
    # the backward on rowsum(dout * out) instead of the output (OutputDelta): packed with padding, fp32
    cases.append(
        AttentionCase(
            layout="stripe",
            causal=False,
            h_kv=1,
            dtype=torch.float32,
            seq_len=s,
            cu_seqlens=(0, 5, s - 3),
            delta=True,
            seed=10,
        )
    )
    return cases


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_ring_matches_dense_reference(dist_pool, world):
    _run_and_check(dist_pool(world), _sweep(world))


def _double_ring_cases() -> list[AttentionCase]:
    cases = []
    for inner, layout, causal, dtype in itertools.product(
        (4, 2), ("contiguous", "zigzag", "stripe"), (True, False), (torch.float64, torch.float32)
    ):
        cases.append(
            AttentionCase(
                layout=layout,
                causal=causal,
                h_kv=2,
                dtype=dtype,
                seq_len=64,
                inner=inner,
                delta=causal,
                seed=len(cases),
            )
        )
    cases.append(
        AttentionCase(
            layout="zigzag",
            causal=True,
            h_kv=2,
            dtype=torch.float64,
            seq_len=64,
            inner=4,
            cu_seqlens=(0, 9, 30, 61),
            seed=50,
        )
    )
    cases.append(
        AttentionCase(
            layout="zigzag",
            causal=True,
            h_kv=2,
            dtype=torch.float64,
            seq_len=64,
            inner=2,
            overlap=False,
            seed=51,
        )
    )
    return cases


def test_double_ring_at_p8_as_2x4_and_4x2(dist_pool):
    _run_and_check(dist_pool(8), _double_ring_cases())


def _all_gather_cases() -> list[AttentionCase]:
    cases = []
    for layout, causal, h_kv in itertools.product(("contiguous", "zigzag", "stripe"), (True, False), (4, 1)):
        cases.append(
            AttentionCase(
                layout=layout,
                causal=causal,
                h_kv=h_kv,
                dtype=torch.float64,
                seq_len=32,
                schedule="all_gather",
                seed=len(cases),
            )
        )
    cases.append(
        AttentionCase(
            layout="contiguous",
            causal=True,
            h_kv=2,
            dtype=torch.float32,
            seq_len=32,
            schedule="all_gather",
            cu_seqlens=(0, 3, 17, 29),
            seed=40,
        )
    )
    return cases


def test_all_gather_schedule(dist_pool):
    _run_and_check(dist_pool(4), _all_gather_cases())


def test_bytes_per_rank_equal_the_formula(dist_pool):
    """docs/ring.md "Bytes per rank and layer" (``parallel/comm_volume.py``): fwd 2(R-1)·B·n·H_kv·D·b; bwd the
    same for K/V + 2R·B·n·H_kv·D·b_acc (dK, dV)."""
    h_kv, b = 2, 8  # fp64
    single = AttentionCase(layout="zigzag", causal=True, h_kv=h_kv, dtype=torch.float64, seq_len=64, seed=1)
    double = replace(single, inner=2)
    gather = replace(single, schedule="all_gather")
    results = dist_pool(8).run(run_ring_cases, [single, double, gather])
    r, n = 8, 8
    blk = B * n * h_kv * D
    kv = 2 * (r - 1) * blk * b
    one_bwd = kv + 2 * r * blk * b  # + dK, dV accumulators: R sends (fp64: b_acc = b)
    two_bwd = kv + 2 * (r + r // 2) * blk * b  # inner ring of 2: R inner + R_out outer accumulator sends
    for rank in range(8):
        s, d, g = results[rank]
        assert s["fwd"] == {"p2p": {"bytes": kv, "messages": r - 1}}
        # the inner ring moves dK and dV as one message each (RingComm.exchange_each)
        assert s["bwd"] == {"p2p": {"bytes": one_bwd, "messages": (r - 1) + 2 * r}}
        # double ring 4 outer x 2 inner: R-1 K/V sends, R inner (two messages each) + R_out outer accumulator sends
        assert d["fwd"] == {"p2p": {"bytes": kv, "messages": r - 1}}
        assert d["bwd"] == {"p2p": {"bytes": two_bwd, "messages": (r - 1) + 2 * r + 4}}
        # all-gather: own shard to R-1 peers; backward re-gathers and reduce-scatters dK, dV
        assert g["fwd"] == {"all_gather": {"bytes": kv, "messages": 1}}
        assert g["bwd"] == {
            "all_gather": {"bytes": kv, "messages": 1},
            "reduce_scatter": {"bytes": 2 * (r - 1) * blk * b, "messages": 1},
        }


def test_causal_balance_from_work_counter(dist_pool):
    """Zigzag and stripe: max/mean of computed score pairs <= 1.05; contiguous is ~2x for contrast."""
    cases = [
        AttentionCase(layout=layout, causal=True, h_kv=1, dtype=torch.float32, seq_len=256, seed=3)
        for layout in ("contiguous", "zigzag", "stripe")
    ]
    results = dist_pool(8).run(run_ring_cases, cases)
    ratios = {}
    for i, case in enumerate(cases):
        work = [results[r][i]["work"] for r in range(8)]
        ratios[case.layout] = max(work) / (sum(work) / len(work))
    assert ratios["zigzag"] <= 1.05
    assert ratios["stripe"] <= 1.05
    assert ratios["contiguous"] > 1.5


def bf16_errors(seq_len: int) -> dict:
    """Max abs error vs fp64 of (ring bf16 at P=world) and (single-device bf16), out and grads."""
    world = torch.distributed.get_world_size()
    mesh = SeqParMesh.build(world, 1)
    layout = ring_layout("zigzag", world)
    spec = MaskSpec(causal=True)
    q, k, v, dout = qkv_inputs(seq_len, 2, torch.float64, seed=11)
    ref = dense_reference(q, k, v, dout, spec, None)
    me = mesh.coords.ring_rank
    qb, kb, vb, db = (t.to(torch.bfloat16) for t in (q, k, v, dout))
    # single device, bf16 in and out (the kernel accumulates in fp32, rounds once at the end)
    pos = torch.arange(seq_len)
    mask = token_mask(pos, pos, spec)
    o1, l1 = block_attn_forward(qb, kb, vb, mask=mask)
    g1 = block_attn_backward(db, qb, kb, vb, o1, l1, mask=mask)
    single = [o1.to(torch.bfloat16), *(g.to(torch.bfloat16) for g in g1)]
    # ring
    ql, kl, vl, dl = (
        layout.shard(t, me).detach().clone().requires_grad_(t is not db) for t in (qb, kb, vb, db)
    )
    out, _ = ring_attention(ql, kl, vl, RingPlan(build_schedule(mesh), layout, spec))
    out.backward(dl)
    ring = [out, ql.grad, kl.grad, vl.grad]
    names = ("out", "dq", "dk", "dv")
    refs = (ref[0], ref[2], ref[3], ref[4])
    return {
        name: (
            (x.double() - layout.shard(rf, me)).abs().max().item(),
            (layout.shard(s.double(), me) - layout.shard(rf, me)).abs().max().item(),
        )
        for name, x, s, rf in zip(names, ring, single, refs, strict=True)
    }


def test_bf16_error_does_not_grow_with_p(dist_pool):
    per_rank = dist_pool(8).run(bf16_errors, 128)
    for name in ("out", "dq", "dk", "dv"):
        ring_err = max(r[name][0] for r in per_rank)
        single_err = max(r[name][1] for r in per_rank)
        assert ring_err <= 2 * single_err, (name, ring_err, single_err)


def _offline_plan(world: int, layout: str = "zigzag", **kw) -> RingPlan:
    """A plan whose ring has no process group: valid only for errors raised before any transfer."""
    return RingPlan(RingSchedule(RingComm(None, list(range(world)), 0)), ring_layout(layout, world), **kw)


@pytest.mark.parametrize(
    ("shapes", "plan_kw", "message"),
    [
        (
            ((2, 8, 4), (2, 8, 4, 8), (2, 8, 4, 8)),
            {},
            r"q \[B, n, H, D\] and k, v \[B, n, H_kv, D\]; got q \(2, 8, 4\)",
        ),
        (((2, 8, 4, 8), (2, 6, 4, 8), (2, 6, 4, 8)), {}, r"k \(2, 6, 4, 8\) must match q \(2, 8, 4, 8\)"),
        (
            ((2, 8, 6, 8), (2, 8, 4, 8), (2, 8, 4, 8)),
            {},
            r"query heads H=6 must be a multiple of key/value heads H_kv=4",
        ),
        (
            ((1, 3, 2, 8), (1, 3, 2, 8), (1, 3, 2, 8)),
            {},
            r"sequence length 6 cannot be split by layout='zigzag' over 2 ranks",
        ),
        (
            ((1, 4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8)),
            {"doc_ids": torch.zeros(6, dtype=torch.long)},
            r"doc_ids has 6 tokens but the ring holds S = 4 x 2 = 8",
        ),
    ],
)
def test_bad_inputs_fail_before_any_transfer(shapes, plan_kw, message):
    q, k, v = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        ring_attention(q, k, v, _offline_plan(2, **plan_kw))


def test_plan_and_schedule_errors():
    with pytest.raises(ValueError, match=r"layout over 4 ranks does not match the ring of 2 ranks"):
        RingPlan(RingSchedule(RingComm(None, [0, 1], 0)), ring_layout("zigzag", 4))
    with pytest.raises(ValueError, match=r"ring schedule 'tree' is unknown; valid: p2p, all_gather"):
        build_schedule(None, "tree")


@pytest.mark.slow
@pytest.mark.parametrize("world", [5, 6, 7])
def test_ring_odd_and_composite_world_sizes(dist_pool, world):
    """Slow sweep (scripts/test.sh --slow): the full layout x mask x GQA sweep on 5, 6 and 7 ranks."""
    _run_and_check(dist_pool(world), _sweep(world))


def _long_window_cases() -> list[AttentionCase]:
    """Segments longer than 4 window tiles: the window tiling (``tasks._window_tasks``) builds the calls."""
    base = AttentionCase(h_kv=2, seq_len=2560)
    cases = [
        replace(base, layout=layout, causal=causal, window=window, dtype=dtype, seed=200 + i)
        for i, (layout, causal, window, dtype) in enumerate(
            [
                ("zigzag", True, 37, torch.float64),
                ("contiguous", True, 128, torch.float64),
                ("zigzag", False, 100, torch.float64),
                ("contiguous", False, 9, torch.float64),
                ("zigzag", True, 64, torch.float32),
            ]
        )
    ]
    return cases


def test_long_windows_are_tiled_and_exact(dist_pool):
    _run_and_check(dist_pool(2), _long_window_cases())


@pytest.mark.parametrize(("layout", "causal"), [("zigzag", True), ("contiguous", True), ("zigzag", False)])
def test_window_tiling_at_a_million_tokens_builds_only_tile_masks(layout, causal):
    """S = 2^20 over 4 ranks, window 4096: the calls cover exactly the visible pairs, and no mask is
    larger than one tile (a mask of a whole 131072 x 131072 segment pair would be 16 GiB)."""
    world, seq_len, w = 4, 1 << 20, 4096
    tile = window_tile(w)
    for me in range(world):
        plan = RingPlan(
            RingSchedule(RingComm(None, list(range(world)), me)),
            ring_layout(layout, world),
            MaskSpec(causal=causal, window=w),
        )
        q_pos, _ = tokens(plan, seq_len, me, torch.device("cpu"))
        for owner in range(world):
            k_pos, _ = tokens(plan, seq_len, owner, torch.device("cpu"))
            tasks = step_tasks(plan, seq_len, owner, q_pos, None)
            masks = {id(t.mask): t.mask for t in tasks if t.mask is not None}
            assert all(m.shape[-1] <= tile and m.shape[-2] <= tile for m in masks.values())
            assert sum(m.numel() for m in masks.values()) <= 8 * tile * tile  # shared by offset, not S
            got = sum(_task_pairs(t) for t in tasks)
            assert got == _visible_pairs(q_pos, k_pos, w, causal), (me, owner)


def _task_pairs(task) -> int:
    if task.mask is not None:
        return int(task.mask.sum())
    n = task.q_rows.stop - task.q_rows.start
    return n * (n + 1) // 2 if task.kind is BlockKind.CAUSAL else task.pairs


def _visible_pairs(q_pos: torch.Tensor, k_pos: torch.Tensor, w: int, causal: bool) -> int:
    """Visible (query, key) pairs of a window, counted per query by binary search on the sorted keys."""
    keys, _ = torch.sort(k_pos)
    lo = q_pos - (w - 1)
    hi = q_pos if causal else q_pos + (w - 1)
    return int((torch.searchsorted(keys, hi, right=True) - torch.searchsorted(keys, lo)).sum())


def zigzag_block_counts() -> tuple[int, int]:
    mesh = SeqParMesh.build(2, 1)
    work = WorkCounter()
    q = torch.randn(1, 8, 2, 4, dtype=torch.float64)
    ring_attention(q, q, q, RingPlan(build_schedule(mesh), ring_layout("zigzag", 2), work=work))
    return work.blocks, work.skipped_blocks


def test_work_counter_counts_segment_blocks(dist_pool):
    """Zigzag, 2 ranks: 4 segment pairs per step; the own step skips 1 (upper half), the other step 2."""
    assert dist_pool(2).run(zigzag_block_counts) == [(5, 3), (5, 3)]


def test_backward_cuts_full_rectangles_at_segments_and_into_tiles():
    """The ring backward runs a FULL rectangle as one call per segment pair, and a large pair as up to
    4 x 4 tiles of at least ``min_rows`` rows a side; a square CAUSAL block the same way on both axes
    (causal tiles on the diagonal, full ones below, none above). Masked and small single tasks are
    left as they are; the visible pairs are unchanged."""
    segments = [(0, 8), (8, 16)]
    joined = BlockTask(slice(0, 16), slice(0, 8), BlockKind.FULL, None, segment_pairs=2)
    causal = BlockTask(slice(0, 16), slice(16, 32), BlockKind.CAUSAL, None, segment_pairs=3)
    small = BlockTask(slice(2, 6), slice(0, 8), BlockKind.FULL, None)
    masked = BlockTask(slice(0, 16), slice(0, 16), BlockKind.PARTIAL, torch.ones(1, 16, 16, dtype=torch.bool))
    got = backward_tiles([joined, causal, small, masked], segments, segments)
    assert [(t.q_rows, t.k_rows, t.kind) for t in got[:5]] == [
        (slice(0, 8), slice(0, 8), BlockKind.FULL),
        (slice(8, 16), slice(0, 8), BlockKind.FULL),
        (slice(0, 8), slice(16, 24), BlockKind.CAUSAL),  # keys keep their offset
        (slice(8, 16), slice(16, 24), BlockKind.FULL),
        (slice(8, 16), slice(24, 32), BlockKind.CAUSAL),
    ]
    assert got[5] is small and got[6] is masked and len(got) == 7
    assert sum(t.pairs for t in got[:2]) == joined.pairs

    tiled = backward_tiles(
        [joined], segments, segments, min_rows=2
    )  # 8-row segments: 4 x 4 tiles of 2 rows each
    assert len(tiled) == 32 and {t.q_rows.stop - t.q_rows.start for t in tiled} == {2}
    assert sum(t.pairs for t in tiled) == joined.pairs
    assert (
        len(backward_tiles([joined], segments, segments, min_rows=3)) == 8
    )  # 8 // 3 = 2 tiles a side per pair
    causal_tiles = backward_tiles(
        [causal], segments, segments, min_rows=2
    )  # 8 x 8 tiles of 2: 8 diagonal, 28 below
    assert [t.kind for t in causal_tiles].count(BlockKind.CAUSAL) == 8 and len(causal_tiles) == 36
    assert sum(t.pairs for t in causal_tiles if t.kind is BlockKind.FULL) + 8 * 3 == 16 * 17 // 2
    across = BlockTask(slice(2, 6), slice(0, 16), BlockKind.FULL, None)  # one task over two key segments
    assert [t.k_rows for t in backward_tiles([across], segments, segments)] == [slice(0, 8), slice(8, 16)]
