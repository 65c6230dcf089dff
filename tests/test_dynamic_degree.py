"""A dynamic SP degree (``layout/grouped.py``, ``parallel/grouped.py``): whole documents per group of p
ranks, the smallest p that balances, exact against one process on every mesh, no ring traffic at p = 1."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from benchmarks.bench_placement import scaled_rows
from ds_seqpar import parse_section
from ds_seqpar.layout import GroupedPlacement, LayoutError, dynamic_placement, place_in_groups
from ds_seqpar.layout.documents import document_lengths
from tests.helpers.cases import AttentionCase
from tests.helpers.usp_cases import check_usp_cases, run_usp_cases


def _cu(lengths: list[int]) -> tuple[int, ...]:
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    return tuple(cu)


def _documents_of(plan: GroupedPlacement, lengths: list[int], seq_len: int) -> list[set[int]]:
    """The documents each SP rank holds tokens of (padding left out)."""
    doc = torch.full((seq_len,), -1)
    for d, (a, b) in enumerate(zip(_cu(lengths), _cu(lengths)[1:])):
        doc[a:b] = d
    held = [set(doc[plan.local_positions(seq_len, r)].tolist()) - {-1} for r in range(plan.world)]
    return held


@pytest.mark.parametrize(("world", "degree"), [(2, 1), (4, 1), (4, 2), (8, 2), (8, 4), (6, 3)])
def test_groups_hold_whole_documents_and_every_token_once(world, degree):
    rng = random.Random(world * 10 + degree)
    for _ in range(20):
        seq_len = world * rng.randint(8, 200)
        room, lengths = seq_len // world * degree, []
        while sum(lengths) < seq_len * 0.8:
            lengths.append(rng.randint(1, room))
        while sum(lengths) > seq_len:
            lengths.pop()
        plan = place_in_groups(lengths, seq_len, world, degree)
        if plan is None:  # no group had room for some document: the batch stays at degree P
            continue
        positions = [plan.local_positions(seq_len, r) for r in range(world)]
        assert all(p.numel() == seq_len // world for p in positions)
        assert torch.equal(torch.sort(torch.cat(positions)).values, torch.arange(seq_len))
        held = _documents_of(plan, lengths, seq_len)
        for g in range(world // degree):
            mine = set().union(*held[g * degree : (g + 1) * degree])
            others = set().union(*(h for r, h in enumerate(held) if r // degree != g))
            assert not mine & others  # a document never spans two groups
        x = torch.randn(2, seq_len, 3)
        assert torch.equal(plan.unshard([plan.shard(x, r) for r in range(world)]), x)


def test_the_smallest_degree_that_balances_is_chosen():
    assert dynamic_placement([4] * 16, 64, 4).degree == 1  # short documents: no communication
    assert dynamic_placement([24, 8, 24, 8], 64, 4).degree == 2  # each pair of ranks shares one long one
    assert dynamic_placement([50, 14], 64, 4) is None  # a document beyond half the row: the whole group
    assert dynamic_placement([64], 64, 1) is None  # one rank: nothing to choose


def test_a_bad_degree_is_refused_by_name():
    with pytest.raises(LayoutError, match="degree=3 must divide the 4 ranks"):
        place_in_groups([4, 4], 16, 4, 3)


def test_dynamic_degree_needs_the_documents_layout():
    with pytest.raises(ValueError, match="dynamic_degree=true needs a per-batch document placement"):
        parse_section({"size": 2, "dynamic_degree": True}).validate(None, 2)
    section = parse_section(
        {"size": 2, "ulysses_degree": 1, "ring": {"layout": "documents"}, "dynamic_degree": True}
    )
    assert section.validate(None, 2).dynamic_degree


def _cases(p: int) -> list[tuple[AttentionCase, int]]:
    """(case, the degree its batch runs at) on U 1 and U 2 meshes, with GQA, windows, padding, fp32, and the
    first row of every shipped length mix scaled to S."""
    s, n = 16 * p, 16
    base = AttentionCase(layout="documents", dynamic=True, seq_len=s, h=8, h_kv=8, seed=31)
    cases = [
        (replace(base, u=1, cu_seqlens=_cu([4] * (s // 4))), 1),  # short documents: p = 1
        (replace(base, u=1, cu_seqlens=_cu([5] * (s // 5 // p * p)), h_kv=2, window=3), 1),  # padding, GQA
        (replace(base, u=1, cu_seqlens=_cu([s - 2 * n + 3, n - 3])), p),  # one long document: p = P
    ]
    if p >= 4:
        pairs = [n + 8, n - 8] * (p // 2)
        cases += [
            (replace(base, u=1, cu_seqlens=_cu(pairs)), 2),  # rings of 2
            (replace(base, u=2, cu_seqlens=_cu(pairs), h_kv=4, window=7, seed=32), 2),
            (replace(base, u=2, cu_seqlens=_cu([4] * (s // 4)), dtype=torch.float32), 1),
            (replace(base, u=1, cu_seqlens=_cu(pairs), causal=False, seed=33), 2),  # encoder attention
        ]
    if p >= 8:
        quads = [3 * n, n] * (p // 4)
        cases.append((replace(base, u=1, cu_seqlens=_cu(quads), seed=34), 4))  # rings of 4
    for i, cu in enumerate(scaled_rows(s, 1).values()):  # row 0 of every shipped mix, scaled to S
        case = replace(base, u=2 if p >= 4 and i % 2 else 1, cu_seqlens=tuple(cu), seed=40 + i)
        plan = dynamic_placement(document_lengths(case.doc_ids()), s, p)
        cases.append((case, p if plan is None else plan.degree))
    return cases


@pytest.mark.parametrize("p", [2, 4, 8])
def test_every_degree_is_exact_on_every_mesh(dist_pool, p):
    cases = _cases(p)
    for case, degree in cases:
        plan = dynamic_placement(document_lengths(case.doc_ids()), case.seq_len, p)
        assert (plan.degree if plan is not None else p) == degree, case
    results = dist_pool(p).run(run_usp_cases, [case for case, _ in cases])
    check_usp_cases([case for case, _ in cases], results)
    for i, (case, degree) in enumerate(cases):
        moved = [rank[i]["fwd"].get("p2p", {}) for rank in results]
        if degree == 1:
            assert not any(moved), case  # every rank alone: nothing on the ring
        if degree < p:
            assert all("all_to_all" not in rank[i]["fwd"] for rank in results), case  # no Ulysses exchange


def test_the_docs_example_runs_as_written(capsys):
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "balance.md").read_text()
    example = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "dynamic_placement" in b]
    exec(example[0], {})
    assert capsys.readouterr().out.split() == ["1", "2", "None"]
