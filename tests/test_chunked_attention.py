"""Chunked attention (Llama 4's ``attention_chunk_size``) on every attention path, against one process.

A query sees only the keys of its own chunk of ``chunk`` tokens, counted from the row's first real token
(docs/kernels.md "Masks from global positions"). Cases run ``ds_seqpar.attention(..., chunk=c)`` at
P = 2, 3, 4 and 8 over Ulysses, the ring (zigzag, stripe, contiguous, all-gather), USP, packed documents
with leading padding, a document placement and the dynamic degree, with windows, softcap and sinks,
and compare out, dq, dk, dv with the dense fp64 reference (``tests/test_softcap_sinks.run_cases``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ds_seqpar.ops.masks import chunk_doc_ids
from tests.helpers.cases import AttentionCase
from tests.helpers.references import assert_within
from tests.test_softcap_sinks import TOL, run_cases


def _cases(p: int) -> list[AttentionCase]:
    s = 16 * p
    base = AttentionCase(seq_len=s, chunk=7, h=4, h_kv=2)
    ring = replace(base, u=1, attention="ring")
    cases = [
        ring,  # zigzag: chunks cross the ranks' segments
        replace(ring, layout="stripe", chunk=5, window=3),
        replace(ring, layout="contiguous", schedule="all_gather", chunk=s // 2),
        replace(ring, cu_seqlens=(0, 5, s // 2 + 3, s - 2), left_pad=3, chunk=4),  # documents + left padding
        replace(ring, layout="documents", cu_seqlens=(0, 3, s // 2 + 1, s - 5), chunk=6, softcap=1.5),
        replace(base, u=p, h=8, sinks=True),  # Ulysses
        replace(base, u=p, h=8, h_kv=8, chunks=1, chunk=1),  # a chunk of one token: each query sees itself
        replace(ring, dtype=torch.float32, chunk=9),
    ]
    if p % 2 == 0:
        cases += [
            replace(base, u=2, h=8, chunk=3, cu_seqlens=(0, 7, s - 1), left_pad=2),  # USP
            replace(
                base, u=p // 2, h=8, layout="documents", dynamic=True, cu_seqlens=tuple(range(0, s + 1, 8))
            ),
        ]
    return cases


@pytest.mark.parametrize("p", [2, 3, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_chunked_attention_matches_reference(dist_pool, p):
    cases = _cases(p)
    results = dist_pool(p).run(run_cases, cases)
    for i, case in enumerate(cases):
        for rank, per_case in enumerate(results):
            assert_within(per_case[i], TOL[case.dtype], (case, rank))


def test_chunk_doc_ids_split_documents_at_chunk_borders():
    ids = torch.tensor([[-1, -1, 0, 0, 0, 0, 0, 1, 1, -1], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    got = chunk_doc_ids(ids, 3, 10, torch.device("cpu"))
    # row 0: two leading pads, so chunks start at index 2: [2, 3, 4] [5, 6 | 7] [8 | 9 pad]
    chunk_of = torch.tensor([[-1, -1, 0, 0, 0, 1, 1, 1, 2, -1], [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]])
    same = (got[:, :, None] == got[:, None, :]) & (got[:, :, None] >= 0)
    want = (
        (ids[:, :, None] == ids[:, None, :])
        & (chunk_of[:, :, None] == chunk_of[:, None, :])
        & (ids[:, :, None] >= 0)
    )
    assert torch.equal(same, want)
    assert (got[0, [0, 1, 9]] < 0).all()
    assert torch.equal(chunk_doc_ids(None, 4, 10, torch.device("cpu")), torch.arange(10) // 4)
