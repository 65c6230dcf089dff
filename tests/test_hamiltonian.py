"""Hamiltonian decompositions of the complete digraph (TASP's concurrent rings, docs/schedules.md)."""

from __future__ import annotations

import pytest

from ds_seqpar.comm.hamiltonian import hamiltonian_decomposition, routing_tables

VALID = [n for n in range(2, 17) if n not in (4, 6)]


@pytest.mark.parametrize("n", VALID)
def test_every_ordered_pair_is_an_arc_of_exactly_one_hamiltonian_cycle(n):
    cycles = hamiltonian_decomposition(n)
    assert len(cycles) == n - 1
    for cycle in cycles:
        assert cycle[0] == 0 and sorted(cycle) == list(range(n))  # visits every rank once
    arcs = [(c[i], c[(i + 1) % n]) for c in cycles for i in range(n)]
    assert sorted(arcs) == sorted((u, v) for u in range(n) for v in range(n) if u != v)
    out_map, in_map = routing_tables(cycles)
    for src in range(n):
        assert sorted(out_map[src][d] for d in range(n) if d != src) == list(
            range(n - 1)
        )  # one link per cycle
        for dst in range(n):
            assert in_map[dst][src] == out_map[src][dst]
    assert hamiltonian_decomposition(n) == cycles  # deterministic


@pytest.mark.parametrize(("n", "nearest"), [(4, "n=3 or n=5"), (6, "n=5 or n=7")])
def test_sizes_without_a_decomposition_name_the_nearest(n, nearest):
    with pytest.raises(ValueError, match=rf"no decomposition into Hamiltonian cycles .*valid: {nearest}"):
        hamiltonian_decomposition(n)


def test_routing_tables_refuse_a_non_decomposition():
    with pytest.raises(ValueError, match=r"arc 0 -> 1 is in cycles 0 and 1"):
        routing_tables([[0, 1, 2], [0, 1, 2]])
    with pytest.raises(ValueError, match=r"does not visit each of the 3 ranks once"):
        routing_tables([[0, 1, 1], [0, 2, 1]])
    with pytest.raises(ValueError, match=r"n >= 2"):
        hamiltonian_decomposition(1)
