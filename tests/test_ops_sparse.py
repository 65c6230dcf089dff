"""Vertical-slash pattern, sparse block kernel and balance metrics, single process (ops/sparse/)."""

from __future__ import annotations

import itertools

import pytest
import torch

from ds_seqpar import SeqParConfigError, SequenceParallelConfig
from ds_seqpar.layout import BlockLayout, doc_ids_from_cu_seqlens, ring_layout
from ds_seqpar.ops.masks import MaskSpec
from ds_seqpar.ops.sparse import (
    SparsePattern,
    VerticalSlashBudget,
    block_row_work,
    block_work,
    diagonals_to_blocks,
    estimate_pattern,
    imbalance_ratio,
    sparse_attn_forward,
)
from ds_seqpar.parallel.activation import sparse_layer_active
from ds_seqpar.parallel.sparse_ring import balance_blocks, balance_heads, block_owner
from tests.helpers.sparse import sharded_sparse, small_budget, sparse_qkv, sparse_reference

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
CAUSAL = MaskSpec()


LAYOUTS = [
    ring_layout("stripe", 4, 8),
    ring_layout("zigzag", 4),
    ring_layout("contiguous", 2),
    ring_layout("stripe", 3, 1),  # token stripes: not block aligned -> exact token-masked path
    ring_layout("contiguous", 1),
]


@pytest.mark.parametrize(
    ("layout", "dtype", "h_kv"), list(itertools.product(LAYOUTS, (torch.float64, torch.float32), (4, 1)))
)
def test_kernel_matches_reference(layout, dtype, h_kv):
    s = 96 if layout.world == 3 else 128
    q, k, v, dout = sparse_qkv(2, s, 4, h_kv, 8, dtype)
    pos = torch.arange(s)
    pattern = estimate_pattern(q, k, pos, pos, s, small_budget(8))
    got = sharded_sparse(q, k, v, dout, pattern, layout)
    ref = sparse_reference(q, k, v, dout, pattern)
    for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got.tensors(), ref, strict=True):
        assert (g - r).abs().max().item() <= TOL[dtype], (name, layout)


@pytest.mark.parametrize("layout", LAYOUTS[:3])
def test_kernel_with_window_and_packed_documents(layout):
    s = 128
    q, k, v, dout = sparse_qkv(2, s, 4, 2, 8, torch.float64, seed=3)
    pos = torch.arange(s)
    pattern = estimate_pattern(q, k, pos, pos, s, small_budget(8))
    docs = torch.stack(
        [doc_ids_from_cu_seqlens([0, 17, 70, 120], s), doc_ids_from_cu_seqlens([0, 64, 128], s)]
    )
    spec = MaskSpec(window=40)
    got = sharded_sparse(q, k, v, dout, pattern, layout, spec, docs)
    ref = sparse_reference(q, k, v, dout, pattern, spec, docs)
    for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got.tensors(), ref, strict=True):
        finite = torch.isfinite(r)
        assert torch.equal(torch.isfinite(g), finite), name
        assert (g[finite] - r[finite]).abs().max().item() <= 1e-10, name


def test_pattern_broadcast_over_rows_and_pairs_match_block_work():
    s, g = 256, 16
    q, k, v, dout = sparse_qkv(1, s, 4, 4, 8, torch.float64, seed=5)
    pos = torch.arange(s)
    pattern = estimate_pattern(q, k, pos, pos, s, small_budget(g))
    layout = ring_layout("stripe", 4, g)
    pairs = sharded_sparse(q, k, v, dout, pattern, layout).pairs
    work = block_work(pattern, block_owner(layout, s, g), 4)
    assert pairs == int(work.sum())
    q2, k2, v2, dout2 = (torch.cat([t, t]) for t in (q, k, v, dout))  # B=2 rows sharing a B=1 pattern
    got = sharded_sparse(q2, k2, v2, dout2, pattern, layout)
    ref = sparse_reference(q2, k2, v2, dout2, pattern)
    assert (got[0] - ref[0]).abs().max() <= 1e-10


def test_visible_matches_definition():
    s, g = 40, 8
    q, k, _, _ = sparse_qkv(1, s, 2, 2, 4, torch.float64)
    pos = torch.arange(s)
    pattern = estimate_pattern(q, k, pos, pos, s, small_budget(g))
    vis = pattern.visible(pos, pos)
    for h, i, j in itertools.product(range(2), range(s), range(s)):
        expected = j <= i and (bool(pattern.slash[0, h, i // g - j // g]) or bool(pattern.vertical[0, h, j]))
        assert bool(vis[0, h, i, j]) == expected


def test_diagonals_to_blocks_is_the_set_of_crossed_blocks():
    s, g = 64, 8
    offsets = torch.zeros(1, 1, s, dtype=torch.bool)
    offsets[0, 0, [3, 8, 17, 40, 63]] = True
    got = diagonals_to_blocks(offsets, g)[0, 0]
    for d in range(s // g):
        crossed = any(
            bool(offsets[0, 0, i - j]) for i in range(d * g, d * g + g) for j in range(0, g) if 0 <= i - j < s
        )
        assert bool(got[d]) == (crossed or d == 0), d


def test_estimate_forces_sinks_and_local_diagonals_and_respects_budgets():
    s, g = 128, 8
    q, k, _, _ = sparse_qkv(1, s, 2, 1, 8, torch.float64, seed=9)
    pos = torch.arange(s)
    budget = VerticalSlashBudget(10, 6, g, last_q=16, sink_tokens=3, local_diagonals=12)
    pattern = estimate_pattern(q, k, pos, pos, s, budget)
    assert pattern.vertical.sum(-1).eq(10).all()
    assert pattern.vertical[..., :3].all()
    assert pattern.slash[..., :2].all()  # diagonals 0..11 cross block diagonals 0 and 1
    assert budget.count(0.5, s) == 64 and budget.count(1000, s) == s
    assert 0.0 < pattern.token_density() < 1.0


def test_imbalance_ratio_orders_layouts():
    s, g = 512, 16
    q, k, _, _ = sparse_qkv(1, s, 4, 4, 8, torch.float64, seed=11)
    pos = torch.arange(s)
    pattern = estimate_pattern(q, k, pos, pos, s, small_budget(g))
    heads = [[0, 1, 2, 3]]
    rho = {
        kind: imbalance_ratio(block_work(pattern, block_owner(layout, s, g), 4), heads)
        for kind, layout in (
            ("contiguous", ring_layout("contiguous", 4)),
            ("stripe", ring_layout("stripe", 4, g)),
        )
    }
    assert rho["stripe"] < rho["contiguous"]
    assert rho["stripe"] >= 1.0
    assert imbalance_ratio(torch.ones(2, 3, 3), [[0], [1]]) == pytest.approx(1.0)
    assert block_owner(ring_layout("stripe", 4, 1), s, g) is None  # token stripes split blocks


def test_balance_heads_keeps_gqa_groups_and_equal_counts():
    work = torch.tensor([9.0, 8.0, 1.0, 1.0, 5.0, 5.0, 2.0, 1.0])  # 4 KV groups of 2 query heads
    order = balance_heads(work, num_kv_heads=4, degree=2)
    assert sorted(order) == list(range(8))
    assert all(order[i] // 2 == order[i + 1] // 2 for i in range(0, 8, 2))  # groups stay whole
    loads = [float(work[order[:4]].sum()), float(work[order[4:]].sum())]
    identity = [float(work[:4].sum()), float(work[4:].sum())]
    assert max(loads) <= max(identity)
    assert balance_heads(work, num_kv_heads=4, degree=1) is None
    assert balance_heads(work, num_kv_heads=2, degree=4) is None  # H_kv % U != 0: heads stay


def test_layer_selection_and_warmup():
    cfg = SequenceParallelConfig(
        size=2, attention="sparse_ring", sparse={"layers": [1, 3], "dense_warmup_steps": 5}
    )
    assert not sparse_layer_active(cfg.sparse, 1, step=4)
    assert sparse_layer_active(cfg.sparse, 1, step=5)
    assert not sparse_layer_active(cfg.sparse, 2, step=9)
    assert not sparse_layer_active(cfg.sparse, None, step=9)
    ring = SequenceParallelConfig(size=2, ulysses_degree=1, attention="sparse_ring").validate().ring
    assert (ring.layout, ring.granularity) == ("stripe", 128)


def _pattern(s: int = 32, g: int = 8) -> SparsePattern:
    return SparsePattern(
        torch.zeros(1, 2, s, dtype=torch.bool), torch.ones(1, 2, s // g, dtype=torch.bool), g
    )


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: SparsePattern(torch.zeros(1, 2, 32, dtype=torch.bool), torch.zeros(1, 2, 4, dtype=torch.bool), 8),
         r"slash\[..., 0\] must be True"),
        (lambda: SparsePattern(torch.zeros(1, 2, 32, dtype=torch.bool), torch.ones(1, 2, 5, dtype=torch.bool), 8),
         "5 block diagonals but S=32"),
        (lambda: SparsePattern(torch.zeros(1, 2, 32), torch.ones(1, 2, 4, dtype=torch.bool), 8), "must be bool"),
        (lambda: sparse_attn_forward(*sparse_qkv(1, 32, 2, 2, 4, torch.float64)[:3], torch.arange(32), torch.arange(32),
                                     _pattern(), scale=0.5, spec=MaskSpec(causal=False)), "is causal"),
        (lambda: sparse_attn_forward(*sparse_qkv(1, 32, 4, 2, 4, torch.float64)[:3], torch.arange(32), torch.arange(32),
                                     _pattern(), scale=0.5), "covers B=1, H=2"),
        (lambda: sparse_attn_forward(*sparse_qkv(1, 32, 2, 2, 4, torch.float64)[:3], torch.arange(32) + 8,
                                     torch.arange(32), _pattern(), scale=0.5), "positions reach 39"),
        (lambda: sparse_attn_forward(*sparse_qkv(1, 32, 2, 2, 4, torch.float64)[:3], torch.arange(16), torch.arange(32),
                                     _pattern(), scale=0.5), "1-D global positions"),
    ],
)  # fmt: skip
def test_sparse_errors_name_the_problem(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"size": 2, "attention": "usp", "sparse": {"vertical": 8}}, "sparse is set but attention='usp'"),
        (
            {"size": 2, "attention": "sparse_ring", "ring": {"layout": "zigzag"}},
            "conflicts with sparse.balancing",
        ),
        (
            {"size": 2, "attention": "sparse_ring", "ring": {"layout": "stripe", "granularity": 8}},
            "granularity=8",
        ),
        (
            {"size": 2, "attention": "sparse_ring", "sparse": {"vertical": 1.5}},
            r"vertical=1.5 is not a fraction",
        ),
        ({"size": 2, "attention": "sparse_ring", "sparse": {"slash": -3}}, "slash=-3 must be >= 0"),
        ({"size": 2, "attention": "sparse_ring", "sparse": {"layers": [0, -1]}}, "negative layer index"),
        ({"size": 2, "attention": "sparse_ring", "sparse": {"balancing": "zigzag"}}, "balancing"),
        ({"size": 2, "attention": "sparse_ring", "sparse": {"block": 64}}, "block"),
    ],
)
def test_sparse_config_errors(section, match):
    from ds_seqpar.config import parse_section

    with pytest.raises(SeqParConfigError, match=match):
        parse_section(section)


def test_sparse_config_accepts_balancing_none_with_any_layout():
    cfg = SequenceParallelConfig(
        size=4,
        attention="sparse_ring",
        ring={"layout": "zigzag"},
        sparse={"balancing": "none", "block_size": 32},
    )
    ring = cfg.validate({"num_attention_heads": 4}).ring
    assert (ring.layout, ring.granularity) == ("zigzag", 1)


def test_block_row_work_sums_to_block_work_and_balance_blocks_evens_load():
    s, g = 512, 16
    q, k, _, _ = sparse_qkv(1, s, 4, 4, 8, torch.float64, seed=13)
    pos = torch.arange(s)
    pattern = estimate_pattern(q, k, pos, pos, s, small_budget(g))
    rows = block_row_work(pattern)
    stripe = block_owner(ring_layout("stripe", 4, g), s, g)
    assert float(rows.sum()) == pytest.approx(float(block_work(pattern, stripe, 4).sum()))
    owner = balance_blocks(rows, stripe, 4, reward=0.0)
    assert torch.bincount(owner, minlength=4).tolist() == [8, 8, 8, 8]  # equal counts
    loads = torch.zeros(4, dtype=torch.float64).index_add_(0, owner, rows)
    assert float(loads.max() - loads.min()) <= float(rows.max())  # LPT: within one block of even
    # a strong home bonus keeps already even blocks home
    assert torch.equal(balance_blocks(torch.ones(32), stripe, 4, reward=10.0), stripe)
    layout = BlockLayout(tuple(tuple((owner == r).nonzero().squeeze(1).tolist()) for r in range(4)), g)
    assert torch.equal(block_owner(layout, s, g), owner)
    with pytest.raises(ValueError, match="exactly once"):
        BlockLayout(((0, 1), (1, 2)), g)
