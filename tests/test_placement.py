"""Document placement (``layout/placement.py``): every token once, equal tokens per rank, balanced work,
the shipped mixes within 1.05, zigzag for one document, errors before any collective."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ds_seqpar import parse_section
from ds_seqpar.layout import LayoutError, doc_ids_from_cu_seqlens, document_lengths, ring_layout
from ds_seqpar.layout.placement import Placement, layout_work, place_documents, token_work
from tests.helpers.cases import AttentionCase
from tests.helpers.usp_cases import check_usp_cases, run_usp_cases

MIXES = Path(__file__).resolve().parent.parent / "benchmarks" / "lengths"


def _random_row(rng: random.Random, seq_len: int) -> list[int]:
    docs: list[int] = []
    while True:
        length = int(rng.lognormvariate(5, 1.5)) + 1
        if sum(docs) + length > seq_len:
            return docs or [seq_len]
        docs.append(length)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("window", [None, 48])
def test_every_token_once_equal_shares_and_the_planned_work(world, window):
    rng = random.Random(world)
    for _ in range(20):
        seq_len = world * rng.randint(16, 400)
        docs = _random_row(rng, seq_len)
        plan = place_documents(docs, seq_len, world, window=window)
        positions = [plan.local_positions(seq_len, r) for r in range(world)]
        assert all(p.numel() == seq_len // world for p in positions)
        assert torch.equal(torch.sort(torch.cat(positions)).values, torch.arange(seq_len))
        assert all(torch.equal(p, torch.sort(p).values) for p in positions)
        assert layout_work(plan, docs, seq_len, window) == pytest.approx(list(plan.work))
        x = torch.randn(1, seq_len, 2)
        assert torch.equal(plan.unshard([plan.shard(x, r) for r in range(world)]), x)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_random_rows_are_balanced_within_the_tolerance(world):
    rng = random.Random(7)
    for _ in range(30):
        seq_len = world * rng.randint(512, 4096)
        plan = place_documents(_random_row(rng, seq_len), seq_len, world)
        assert plan.balance <= 1.05, plan.work


@pytest.mark.parametrize("name", ["longtail_128k", "cpt_1m", "uniform_32k"])
@pytest.mark.parametrize("world", [4, 8])
def test_shipped_mixes_are_balanced_where_zigzag_over_the_row_is_not(name, world):
    mix = json.loads((MIXES / f"{name}.json").read_text())
    seq_len, worst_zigzag = mix["seq_len"], 1.0
    for docs in mix["rows"][:4]:
        assert place_documents(docs, seq_len, world).balance <= 1.05
        zigzag = layout_work(ring_layout("zigzag", world), docs, seq_len)
        worst_zigzag = max(worst_zigzag, max(zigzag) * world / sum(zigzag))
    assert worst_zigzag > 1.2  # what the placement is for


@pytest.mark.parametrize(("world", "seq_len"), [(2, 16), (4, 64), (4, 72), (8, 4096)])
def test_one_document_is_cut_as_zigzag_cuts_a_row(world, seq_len):
    plan, zigzag = place_documents([seq_len], seq_len, world), ring_layout("zigzag", world)
    for r in range(world):
        assert torch.equal(
            plan.local_positions(seq_len, r), torch.sort(zigzag.local_positions(seq_len, r)).values
        )


def test_token_work_counts_visible_keys():
    assert token_work([3, 2], 6).tolist() == [1, 2, 3, 1, 2, 0]
    assert token_work([5], 5, window=2).tolist() == [1, 2, 2, 2, 2]


@pytest.mark.parametrize(
    ("lengths", "seq_len", "world", "match"),
    [
        ([10, 10], 16, 2, "more than the row's 16"),
        ([4, 0], 16, 2, "must all be >= 1"),
        ([4], 15, 2, "pad it to 16"),
        ([4], 16, 0, "must be >= 1"),
    ],
)
def test_bad_rows_are_refused_by_name(lengths, seq_len, world, match):
    with pytest.raises(LayoutError, match=match):
        place_documents(lengths, seq_len, world)


def test_a_placement_of_another_length_is_refused():
    plan = place_documents([6, 10], 16, 2)
    with pytest.raises(LayoutError, match="does not match this document placement of 16 tokens"):
        plan.local_positions(32, 0)
    with pytest.raises(LayoutError, match="exactly once"):
        Placement((((0, 4),), ((2, 8),)), 8)


def test_document_lengths_from_ids():
    docs = doc_ids_from_cu_seqlens([0, 3, 7, 12], 16)
    assert document_lengths(docs) == [3, 4, 5]  # the trailing padding is left out
    assert document_lengths(torch.stack([docs, docs])) == [3, 4, 5]
    with pytest.raises(LayoutError, match="different document boundaries"):
        document_lengths(torch.stack([docs, doc_ids_from_cu_seqlens([0, 4, 16], 16)]))


@pytest.mark.parametrize(
    ("ring", "attention", "match"),
    [
        ({"layout": "documents", "schedule": "attention2d", "grid": [3, 1]}, "usp", "regroups into teams"),
        ({"layout": "documents", "schedule": "tasp"}, "usp", "valid: ring.schedule 'p2p', 'all_gather'"),
        ({"layout": "documents"}, "sparse_ring", "does not follow"),
    ],
)
def test_schedules_that_regroup_ranks_refuse_the_placement(ring, attention, match):
    with pytest.raises(ValueError, match=match):
        parse_section({"size": 3, "attention": attention, "ulysses_degree": 1, "ring": ring}).validate(
            None, 3
        )


def _mix(seq_len: int, seed: int) -> tuple[int, ...]:
    """cu_seqlens of a random long-tail row of ``seq_len`` tokens, with odd lengths and some padding."""
    rng, cu = random.Random(seed), [0]
    while True:
        length = int(rng.lognormvariate(1.5, 1.2)) + 1
        if cu[-1] + length > seq_len - 3:
            return tuple(cu) if len(cu) > 1 else (0, seq_len - 3)
        cu.append(cu[-1] + length)


def _placed(p: int) -> list[AttentionCase]:
    """The documents layout on every U x R mesh of P ranks, with windows, GQA, a double ring, fp32."""
    s = 16 * p
    base = AttentionCase(layout="documents", seq_len=s, h=8, h_kv=8, cu_seqlens=_mix(s, p))
    cases = [
        replace(base, u=u, seed=u, cu_seqlens=_mix(s, p + u)) for u in range(1, p + 1) if p % u == 0 and u < 8
    ]
    cases += [
        replace(base, u=1, h_kv=2, window=5, seed=11),  # GQA and a sliding window
        replace(base, u=1, dtype=torch.float32, seed=12),
        replace(base, u=1, schedule="all_gather", seed=13),
        replace(base, u=1, cu_seqlens=(0, s), seed=14),  # one document: the placement is zigzag
        replace(base, u=1, cu_seqlens=(0, s // 2 + 1, s), causal=False, seed=15),  # encoder attention
    ]
    if p >= 4:
        cases.append(replace(base, u=1, inner=2, seed=16))  # a double ring
    return cases


def _short(p: int) -> list[AttentionCase]:
    """Rows of short documents (each fits one rank): placed whole, so the ring sends nothing."""
    s = 16 * p
    base = AttentionCase(layout="documents", seq_len=s, h=8, h_kv=8, seed=21)
    cases = [
        replace(base, u=1, cu_seqlens=tuple(range(0, s + 1, 4))),  # equal documents, no padding
        replace(
            base, u=1, cu_seqlens=tuple(range(0, 15 * p + 1, 5)), h_kv=2, window=3
        ),  # padding, GQA, window
    ]
    if p >= 4:
        cases.append(replace(base, u=2, cu_seqlens=tuple(range(0, 30 * (p // 2) + 1, 6))))  # U 2 x R p/2
    return cases


@pytest.mark.parametrize("p", [2, 4, 8])
def test_the_placement_is_exact_on_every_mesh(dist_pool, p):
    cases = _placed(p) + _short(p)
    results = dist_pool(p).run(run_usp_cases, cases)
    check_usp_cases(cases, results)
    for i in range(len(cases) - len(_short(p)), len(cases)):  # documents kept whole: no ring exchange
        assert all("p2p" not in rank[i]["fwd"] and "p2p" not in rank[i]["bwd"] for rank in results), cases[i]


def test_short_documents_are_placed_whole():
    plan = place_documents([4, 3, 4, 3, 3, 4, 3, 4], 32, 4)
    assert plan.whole and not plan.needs_exchange and plan.balance <= 1.02
    assert place_documents([40], 40, 4).needs_exchange  # a document longer than a rank's share is cut


def test_the_docs_example_runs_as_written(capsys):
    import re

    doc = (Path(__file__).resolve().parent.parent / "docs" / "balance.md").read_text()
    exec(re.search(r"```python\n(.*?)```", doc, re.S).group(1), {})
    printed = capsys.readouterr().out
    assert "placement max/mean 1.0" in printed and "rank 0 holds" in printed


def test_the_placement_balances_every_ring_step_where_zigzag_does_not():
    from benchmarks.bench_placement import scaled_rows, step_critical_path
    from ds_seqpar.layout import document_lengths

    seq_len, world = 2048, 4
    cu = scaled_rows(seq_len, 1)["longtail_128k row 0"]
    docs = doc_ids_from_cu_seqlens(cu, seq_len)
    placed = place_documents(document_lengths(docs), seq_len, world)
    assert step_critical_path(placed, docs, seq_len, world) < 1.05
    assert step_critical_path(ring_layout("zigzag", world), docs, seq_len, world) > 1.5
    one = doc_ids_from_cu_seqlens([0, seq_len], seq_len)
    assert step_critical_path(ring_layout("zigzag", world), one, seq_len, world) == pytest.approx(
        1.0, abs=0.01
    )
