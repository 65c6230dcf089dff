"""APB / Star Attention (``parallel/apb.py``) on gloo ranks vs the single-process reference (``ops/apb.py``),
and with a budget that keeps every token vs exact attention (``ds_seqpar.attention``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import ds_seqpar
from ds_seqpar.ops.apb import apb_reference, passing_scores, select_passing
from ds_seqpar.parallel.apb import ApbSpec, apb_attention, apb_layer_bytes
from tests.helpers.meshes import mesh_for

B, D = 2, 8


@dataclass(frozen=True)
class ApbCase:
    seq_len: int
    spec: tuple[int, int, int]  # (anchor_len, query_len, passing_len)
    h: int = 4
    h_kv: int = 2
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    dtype: torch.dtype = torch.float64
    seed: int = 0


def _inputs(case: ApbCase):
    g = torch.Generator().manual_seed(case.seed)
    s, l_q = case.seq_len, case.spec[1]
    shapes = [(s, case.h), (s, case.h_kv), (s, case.h_kv), (l_q, case.h), (l_q, case.h_kv), (l_q, case.h_kv)]
    q, k, v, qq, kq, vq = (torch.randn(B, n, h, D, generator=g, dtype=torch.float64) for n, h in shapes)
    sinks = torch.randn(case.h, generator=g, dtype=torch.float64) if case.sinks else None
    return q, k, v, (qq, kq, vq), sinks


def run_apb_cases(cases: list[ApbCase]) -> list[dict]:
    """Each case on this rank: APB of the anchor + local rows; errors vs the reference, bytes sent."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = mesh_for({"size": world, "ulysses_degree": 1, "ring": {"layout": "contiguous"}})
    results = []
    for case in cases:
        q, k, v, query, sinks = _inputs(case)
        spec, (l_a, _, _) = ApbSpec(*case.spec), case.spec
        ref, ref_anchor = apb_reference(q, k, v, query, world, case.spec, softcap=case.softcap,
                                        window=case.window, sinks=sinks)  # fmt: skip
        n = case.seq_len // world
        rows = slice(rank * n, (rank + 1) * n)
        local = [torch.cat([t[:, :l_a], qt, t[:, rows]], 1).to(case.dtype) for t, qt in zip((q, k, v), query)]
        with mesh.comm_stats.measure() as region:
            out = apb_attention(*local, mesh=mesh, spec=spec, window=case.window, softcap=case.softcap,
                                sinks=None if sinks is None else sinks.to(case.dtype))  # fmt: skip
        n_a = spec.anchor_rows
        errors = {
            "out": (out[:, n_a:].double() - ref[:, rows]).abs().max().item(),
            "anchor": (out[:, :n_a].double() - ref_anchor).abs().max().item(),
        }
        expected = apb_layer_bytes(
            spec, world, B, n, case.h_kv, D, D, torch.empty((), dtype=case.dtype).element_size()
        )
        results.append({"errors": errors, "bytes": region.bytes("all_gather"), "expected": expected})
    return results


def run_full_budget_vs_exact(seq_len: int, dtype: torch.dtype) -> float:
    """APB with l_p = n (every token passed) vs ``ds_seqpar.attention`` on the same contiguous shards."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = mesh_for({"size": world, "ulysses_degree": 1, "ring": {"layout": "contiguous"}})
    n = seq_len // world
    case = ApbCase(seq_len, (3, 2, n), dtype=dtype, seed=7)
    q, k, v, query, _ = _inputs(case)
    rows = slice(rank * n, (rank + 1) * n)
    exact = ds_seqpar.attention(q[:, rows].to(dtype), k[:, rows].to(dtype), v[:, rows].to(dtype), mesh=mesh)
    local = [torch.cat([t[:, :3], qt, t[:, rows]], 1).to(dtype) for t, qt in zip((q, k, v), query)]
    out = apb_attention(*local, mesh=mesh, spec=ApbSpec(*case.spec))
    return (out[:, 5:].double() - exact.double()).abs().max().item()


CASES = [
    ApbCase(32, (3, 2, 2), seed=1),
    ApbCase(32, (0, 1, 3), h=4, h_kv=4, seed=2),  # no anchor prefix (MHA)
    ApbCase(32, (4, 0, 0), seed=3),  # Star Attention: no collective
    ApbCase(32, (2, 3, 5), window=6, seed=4),  # window over anchor, passing and own block
    ApbCase(32, (3, 2, 4), softcap=2.0, sinks=True, seed=5),
    ApbCase(32, (6, 2, 8), seed=6),  # rank 0 pads (n - l_a < l_p at P = 4)
    ApbCase(32, (8, 1, 3), seed=9),  # P = 4: rank 0's block is all anchor, it passes nothing
    ApbCase(32, (3, 2, 3), dtype=torch.float32, seed=8),
]


@pytest.mark.parametrize("p", [2, 4])
def test_apb_matches_reference(dist_pool, p):
    results = dist_pool(p).run(run_apb_cases, CASES)
    for i, case in enumerate(CASES):
        tol = 1e-10 if case.dtype == torch.float64 else 1e-5
        for rank, per_rank in enumerate(results):
            got = per_rank[i]
            assert max(got["errors"].values()) <= tol, f"{case} rank {rank}: {got['errors']}"
            assert got["bytes"] == got["expected"], (
                f"{case} rank {rank}: bytes {got['bytes']} != {got['expected']}"
            )


@pytest.mark.parametrize("p", [2, 4])
def test_full_budget_equals_exact_attention(dist_pool, p):
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        errors = dist_pool(p).run(run_full_budget_vs_exact, 32, dtype)
        assert max(errors) <= tol, (dtype, errors)


def test_selection_prefers_high_scores_in_position_order():
    scores = torch.tensor([[[0.1, 0.9, 0.5, 0.9, 0.2]]])
    assert select_passing(scores, 3).tolist() == [[[1, 2, 3]]]
    q = torch.zeros(1, 1, 2, 4)
    k = torch.randn(1, 5, 1, 4)
    flat = passing_scores(q, k, 0.5)  # equal logits: uniform, summed over 1 row x 2 heads
    assert torch.allclose(flat, torch.full((1, 1, 5), 2 / 5))


def test_refusals_name_the_value():
    q = torch.zeros(1, 6, 2, 4)
    with pytest.raises(ValueError, match="query_len=0"):
        apb_attention(q, q, q, mesh=None, spec=ApbSpec(2, 0, 3))
    with pytest.raises(ValueError, match="anchor_len 5"):
        apb_attention(q, q, q, mesh=None, spec=ApbSpec(5, 0, 0))
    with pytest.raises(ValueError, match="window=0"):
        apb_attention(q, q, q, mesh=None, spec=ApbSpec(1, 1, 1), window=0)


@pytest.mark.parametrize(
    ("inference", "match"),
    [
        (
            {"prefill": "exact", "anchor_len": 3},
            r"inference\.anchor_len=3 is set but .*prefill='exact' ignores it",
        ),
        ({"prefill": "star", "passing_len": 3}, r"inference\.passing_len=3 with prefill='star'"),
        ({"prefill": "apb", "query_len": 0}, r"inference\.query_len=0 with prefill='apb'"),
        ({"prefill": "apb", "compression": "retaining_heads"}, r"compression='retaining_heads' is not valid"),
        ({"prefill": "ring"}, r"inference\.prefill='ring' is not valid; valid: exact, apb, star"),
    ],
)
def test_inference_section_refuses_by_name(inference, match):
    from ds_seqpar.errors import SeqParConfigError

    with pytest.raises(SeqParConfigError, match=match):
        ds_seqpar.parse_section({"size": 2, "inference": inference}, 2)


def test_inference_section_reaches_the_settings():
    section = ds_seqpar.parse_section({"size": 2, "ulysses_degree": 1, "inference": {"prefill": "star"}}, 2)
    settings = section.validate(None, 2)
    assert (settings.inference.prefill, settings.inference.passing) == ("star", 0)
    assert ds_seqpar.parse_section({"size": 2}, 2).inference.prefill == "exact"
