"""Property-based tests: random USP configurations against the single-process fp64 reference.

Hypothesis draws P, the Ulysses degree U (R = P / U), head counts (GQA, uneven splits, replication),
the ring layout, the sequence length, causal or not, a sliding window and packed documents with
trailing padding; every drawn case runs on a gloo group of P ranks (``run_usp_cases``, the same
case runner as ``test_usp.py``) and out, dq, dk, dv must match the dense reference to 1e-10.

Default suite: a small fixed sample (``derandomize``). Slow suite (``scripts/test.sh --slow``):
``SLOW_EXAMPLES`` cases per P for P in {2, 4, 8}, 240 in all.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.cases import AttentionCase
from tests.helpers.usp_cases import check_usp_cases, run_usp_cases

DEFAULT_EXAMPLES, SLOW_EXAMPLES = 8, 80


@st.composite
def usp_cases(draw: st.DrawFn, p: int) -> AttentionCase:
    h_kv = draw(st.sampled_from([1, 2, 4]))
    h = h_kv * draw(st.sampled_from([1, 2, 3]))
    u = draw(st.sampled_from([d for d in range(1, p + 1) if p % d == 0 and d <= h]))
    seq_len = 2 * p * draw(st.integers(1, 4))  # a multiple every layout can split
    case = AttentionCase(
        u=u,
        layout=draw(st.sampled_from(["contiguous", "zigzag", "stripe"])),
        causal=draw(st.booleans()),
        dtype=torch.float64,
        seq_len=seq_len,
        h=h,
        h_kv=h_kv,
        seed=draw(st.integers(0, 2**16)),
    )
    if draw(st.booleans()):
        case = replace(case, window=draw(st.integers(1, seq_len)))
    if draw(st.booleans()):
        cuts = draw(st.lists(st.integers(1, seq_len - 1), max_size=3, unique=True)) if seq_len > 1 else []
        end = draw(st.integers(max(1, seq_len - 3), seq_len))  # up to 3 padding tokens at the end
        case = replace(case, cu_seqlens=(0, *sorted(c for c in cuts if c < end), end))
    return case


def _assert_exact(pool, case: AttentionCase) -> None:
    check_usp_cases([case], pool.run(run_usp_cases, [case]))


def _property(p: int, examples: int):
    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(case=usp_cases(p))
    def check(dist_pool, case: AttentionCase) -> None:
        _assert_exact(dist_pool(p), case)

    return check


test_random_usp_cases_p2 = _property(2, DEFAULT_EXAMPLES)
test_random_usp_cases_p4 = _property(4, DEFAULT_EXAMPLES)
test_random_usp_cases_p2_slow = pytest.mark.slow(_property(2, SLOW_EXAMPLES))
test_random_usp_cases_p4_slow = pytest.mark.slow(_property(4, SLOW_EXAMPLES))
test_random_usp_cases_p8_slow = pytest.mark.slow(_property(8, SLOW_EXAMPLES))
