"""Hamiltonian decompositions of the complete directed graph on n ranks (TASP's concurrent rings).

Inside an all-to-all domain (an NVSwitch node) a ring uses one outgoing link per rank. TASP
(docs/schedules.md) runs n − 1 rings at once, one per directed Hamiltonian cycle of a
decomposition of the complete digraph K*_n: every ordered pair (u, v), u ≠ v, is an arc of exactly
one cycle, so one step of all n − 1 rings is one all-to-all in which every link carries one message.

Such a decomposition exists for every n ≥ 2 except 4 and 6 (Tillson, 1980). Here:

* n = 2: the one cycle 0 → 1 → 0;
* n odd: a 1-rotational construction. Take the group Z_m, m = n − 1 (even), and the extra vertex
  ∞ = m. The sequence x = 0, 1, m − 1, 2, m − 2, ... (Gordon's sequencing of Z_m) has consecutive
  differences 1, −2, 3, −4, ..., which are all nonzero elements of Z_m once each. The base cycle
  ∞ → x_0 → ... → x_{m−1} → ∞ therefore uses one arc of every difference class, and its m
  translates x + g (g ∈ Z_m, ∞ fixed) cover every finite arc once and every arc to or from ∞ once;
* n even (≥ 8): a seeded randomized search (cycles one after another, Warnsdorff's rule with
  restarts), deterministic for a given n and cached; it takes well under a second up to n = 16 and
  a few seconds at n = 20 on the reference CPU.

Cycles are lists of ranks starting at rank 0; ``routing_tables`` gives, per ordered pair, the cycle
whose arc it is (TASP's ``out_map`` / ``in_map``).
"""

from __future__ import annotations

import functools
import random

NO_DECOMPOSITION = (4, 6)
SEARCH_SEED = 0
SEARCH_PATHS_PER_CYCLE = 200
SEARCH_ATTEMPTS = 100_000


def has_decomposition(n: int) -> bool:
    """Whether the complete digraph on ``n`` ranks decomposes into Hamiltonian cycles (n >= 2, n not 4 or 6)."""
    return isinstance(n, int) and n >= 2 and n not in NO_DECOMPOSITION


def hamiltonian_decomposition(n: int) -> list[list[int]]:
    """``n − 1`` directed Hamiltonian cycles on ranks ``0..n−1`` that use every ordered pair once.

    Raises ``ValueError`` for n < 2 and for n ∈ {4, 6}, naming the nearest sizes that have one.
    """
    if not isinstance(n, int) or n < 2:
        raise ValueError(f"a Hamiltonian decomposition needs n >= 2 ranks; got n={n!r}")
    if not has_decomposition(n):
        raise ValueError(
            f"the complete directed graph on n={n} ranks has no decomposition into Hamiltonian cycles "
            f"(Tillson's theorem: every n >= 2 except 4 and 6); valid: n={n - 1} or n={n + 1} ranks per domain"
        )
    return [list(cycle) for cycle in _decomposition(n)]


@functools.cache
def cycle_successors(n: int) -> tuple[tuple[int, ...], ...]:
    """``succ[c][x]``: the rank after x in Hamiltonian cycle c of the decomposition on n ranks."""
    out = []
    for cycle in hamiltonian_decomposition(n):
        succ = [0] * n
        for pos, x in enumerate(cycle):
            succ[x] = cycle[(pos + 1) % n]
        out.append(tuple(succ))
    return tuple(out)


@functools.cache
def _decomposition(n: int) -> tuple[tuple[int, ...], ...]:
    if n == 2:
        return ((0, 1),)
    if n % 2 == 1:
        return _one_rotational(n)
    return _search(n)


def _one_rotational(n: int) -> tuple[tuple[int, ...], ...]:
    """Odd n: translates of one base cycle through ∞ = n − 1 under Z_{n−1} (module docstring)."""
    m = n - 1
    base = [0]
    for j in range(1, m):
        base.append((j + 1) // 2 if j % 2 == 1 else (m - j // 2) % m)
    cycles = []
    for g in range(m):
        finite = [(x + g) % m for x in base]
        cycle = [m, *finite]
        start = cycle.index(0)
        cycles.append(tuple(cycle[start:] + cycle[:start]))
    return tuple(cycles)


def _search(n: int) -> tuple[tuple[int, ...], ...]:
    """Even n ≥ 8: Hamiltonian cycles found one after another in the arcs left, restarted when stuck."""
    rng = random.Random(SEARCH_SEED * 1_000_003 + n)
    for _ in range(SEARCH_ATTEMPTS):
        free = [set(range(n)) - {u} for u in range(n)]
        cycles: list[tuple[int, ...]] = []
        for _ in range(n - 1):
            cycle = _find_cycle(n, free, rng)
            if cycle is None:
                break
            for i, u in enumerate(cycle):
                free[u].discard(cycle[(i + 1) % n])
            cycles.append(cycle)
        if len(cycles) == n - 1:
            return tuple(cycles)
    raise RuntimeError(f"no Hamiltonian decomposition found for n={n} in {SEARCH_ATTEMPTS} attempts")


def _find_cycle(n: int, free: list[set[int]], rng: random.Random) -> tuple[int, ...] | None:
    """A Hamiltonian cycle from rank 0 in the arcs ``free`` (randomized Warnsdorff walks), or None."""
    for _ in range(SEARCH_PATHS_PER_CYCLE):
        path, seen = [0], {0}
        while len(path) < n:
            options = [v for v in free[path[-1]] if v not in seen]
            if not options:
                break
            rng.shuffle(options)
            options.sort(key=lambda v: sum(1 for w in free[v] if w not in seen))
            nxt = options[0] if rng.random() < 0.8 else rng.choice(options)
            path.append(nxt)
            seen.add(nxt)
        if len(path) == n and 0 in free[path[-1]]:
            return tuple(path)
    return None


def routing_tables(cycles: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """``(out_map, in_map)``: ``out_map[src][dst]`` = the cycle in which dst follows src, ``in_map[dst][src]``
    the same seen from the receiver; -1 on the diagonal. Raises ``ValueError`` if a pair is missing or
    repeated (``cycles`` is not a decomposition)."""
    n = len(cycles) + 1
    out_map = [[-1] * n for _ in range(n)]
    for index, cycle in enumerate(cycles):
        if sorted(cycle) != list(range(n)):
            raise ValueError(f"cycle {index} = {cycle} does not visit each of the {n} ranks once")
        for i, src in enumerate(cycle):
            dst = cycle[(i + 1) % n]
            if out_map[src][dst] != -1:
                raise ValueError(f"arc {src} -> {dst} is in cycles {out_map[src][dst]} and {index}")
            out_map[src][dst] = index
    missing = [(s, d) for s in range(n) for d in range(n) if s != d and out_map[s][d] == -1]
    if missing:
        raise ValueError(f"arcs {missing[:4]} are in no cycle")
    in_map = [[out_map[src][dst] for src in range(n)] for dst in range(n)]
    return out_map, in_map
