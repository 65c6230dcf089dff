"""Bidirectional image blocks (Gemma 3's image tokens): ``ds_seqpar.attention(blocks=...)`` on every dense path.

Each case shards random fp64 q, k, v over P gloo ranks and compares this rank's out, dq, dk, dv with a dense
single-process reference whose mask is written out from HF's rule (docs/kernels.md "Image blocks"):
``(k <= q OR blocks[q] == blocks[k] >= 0) AND q - k < w AND same document, not padding``.
Blocks straddle shard boundaries (contiguous, zigzag, stripe), sit inside packed documents with padding, and
are longer than the window. Refusals run in the same pool (one spawn per P).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist

import ds_seqpar
from ds_seqpar.comm.schedules import RingSchedule
from ds_seqpar.layout import ContiguousLayout
from ds_seqpar.ops.attention import Alibi
from ds_seqpar.ops.attention.reference import dense_attention_reference
from ds_seqpar.ops.image_blocks import block_reach, check_blocks
from ds_seqpar.ops.masks import BlockKind, MaskSpec, classify_block, token_mask
from ds_seqpar.parallel.ring import RingPlan
from ds_seqpar.parallel.ring import tasks as ring_tasks
from tests.helpers.cases import AttentionCase
from tests.helpers.meshes import mesh_for
from tests.helpers.references import assert_within

TOL = 1e-10
D = 8


def _ids(runs: tuple[tuple[int, int], ...], seq_len: int) -> torch.Tensor:
    ids = torch.full((seq_len,), -1, dtype=torch.int64)
    for i, (a, b) in enumerate(runs):
        ids[a:b] = 10 + 3 * i  # ids need not be dense or ordered
    return ids


@dataclass(frozen=True)
class BlockCase:
    """An ``AttentionCase`` with image blocks: ``runs`` [start, end) per block (the same on every batch row),
    ``row_runs`` the second row's when the blocks differ per row (``[B, S]``)."""

    case: AttentionCase
    runs: tuple[tuple[int, int], ...]
    row_runs: tuple[tuple[int, int], ...] | None = None
    tile: int | None = None  # IMAGE_BLOCK_TILE for this case: long pairs cut into tiles
    row_cu: tuple[int, ...] | None = None  # the second row's documents ([B, S] doc_ids)

    def blocks(self) -> torch.Tensor:
        s = self.case.seq_len
        if self.row_runs is None:
            return _ids(self.runs, s)
        return torch.stack([_ids(self.runs, s), _ids(self.row_runs, s)])

    def docs(self) -> torch.Tensor | None:
        first = self.case.doc_ids()
        if self.row_cu is None:
            return first
        return torch.stack([first, replace(self.case, cu_seqlens=self.row_cu).doc_ids()])


def reference_mask(blocks: torch.Tensor, spec: MaskSpec, docs: torch.Tensor | None) -> torch.Tensor:
    """HF's mask written out: ``[S, S]`` / ``[B, S, S]`` bool."""
    s = blocks.shape[-1]
    q, k = torch.arange(s)[:, None], torch.arange(s)[None, :]
    same = (blocks[..., :, None] == blocks[..., None, :]) & (blocks[..., :, None] >= 0)
    mask = (k <= q) | same if spec.causal else torch.ones(s, s, dtype=torch.bool)
    if spec.window is not None:
        mask = mask & ((q - k < spec.window) if spec.causal else ((q - k).abs() < spec.window))
    if docs is not None:
        q_doc, k_doc = docs[..., :, None], docs[..., None, :]
        mask = mask & (q_doc == k_doc) & (q_doc >= 0) & (k_doc >= 0)
    return mask


def run_block_cases(cases: list[BlockCase]) -> list[dict[str, float]]:
    """Per case, the max abs error of out, dq, dk, dv of this rank's shard."""
    world, results, default_tile = dist.get_world_size(), [], ring_tasks.IMAGE_BLOCK_TILE
    for i, bc in enumerate(cases):
        case = bc.case
        mesh = mesh_for(case.section(world))
        docs, blocks = bc.docs(), bc.blocks()
        layout = ds_seqpar.input_layout(mesh, docs)
        g = torch.Generator().manual_seed(i)
        q, k, v, dout = (
            torch.randn(case.batch, case.seq_len, n, D, generator=g, dtype=torch.float64)
            for n in (case.h, case.h_kv, case.h_kv, case.h)
        )
        sinks = torch.randn(case.h, generator=g, dtype=torch.float64) if case.sinks else None
        slopes = 2.0 ** -torch.arange(1.0, case.h + 1, dtype=torch.float64) if case.alibi else None
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        pos = torch.arange(case.seq_len)
        ref, _ = dense_attention_reference(
            *leaves, reference_mask(blocks, case.spec, docs), softcap=case.softcap, sinks=sinks,
            alibi=None if slopes is None else Alibi(slopes, pos, pos),
        )  # fmt: skip
        ref.backward(dout)
        me = mesh.coords.sp_rank
        local = [layout.shard(t, me).detach().clone().requires_grad_() for t in (q, k, v)]
        ring_tasks.IMAGE_BLOCK_TILE = bc.tile or default_tile
        out = ds_seqpar.attention(
            *local, mesh=mesh, causal=case.causal, window=case.window, doc_ids=docs, softcap=case.softcap,
            sinks=sinks, alibi_slopes=slopes, blocks=blocks,
        )  # fmt: skip
        out.backward(layout.shard(dout, me))
        ring_tasks.IMAGE_BLOCK_TILE = default_tile
        got = [out, *(t.grad for t in local)]
        want = [ref, *(t.grad for t in leaves)]
        results.append({
            name: (a - layout.shard(b.detach(), me)).abs().max().item()
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True)
        })  # fmt: skip
    return results


def _cases(p: int) -> list[BlockCase]:
    s = 16 * p
    ring = AttentionCase(seq_len=s, u=1, h=4, h_kv=2, attention="ring")
    cu = (0, 5, s // 2 + 3, s - 2)  # three documents, two padding tokens
    straddle = ((3, 3 + s // 4 + 2), (s // 2 - 2, s // 2 + 5), (s - 6, s - 3))  # across shard boundaries
    in_docs = ((1, 4), (7, s // 2 + 1), (s // 2 + 4, s - 3))  # inside the documents of cu
    other_row = ((0, 6), (s // 4, s // 2 + 3), (s - 4, s - 1))
    dyn = replace(ring, attention="usp", u=p // 2, h=8, layout="documents", dynamic=True)  # dynamic_degree
    cases = [
        BlockCase(replace(ring, attention="usp", u=p, h=2 * p), straddle),  # Ulysses (pipelined), GQA
        BlockCase(ring, straddle),  # ring p2p, zigzag
        BlockCase(replace(ring, layout="contiguous", window=7), straddle),  # the window cuts the blocks
        BlockCase(replace(ring, layout="stripe", window=5), straddle, other_row),  # [B, S] blocks
        BlockCase(replace(ring, cu_seqlens=cu), in_docs),  # packed documents with padding
        BlockCase(replace(ring, cu_seqlens=cu, window=6, layout="contiguous"), in_docs, ((0, 5), (9, 14))),
        BlockCase(replace(ring, softcap=1.5, sinks=True, h_kv=1), straddle),  # softcap (torch kernel), sinks
        BlockCase(replace(ring, alibi=True, schedule="all_gather"), straddle),
        BlockCase(replace(ring, layout="documents", cu_seqlens=cu), in_docs),  # a document placement
        BlockCase(replace(ring, causal=False, window=9), straddle),  # ignored: the plain non-causal mask
        BlockCase(
            replace(ring, layout="contiguous", cu_seqlens=cu),
            in_docs,
            ((0, 5), (9, 14), (s // 2 + 4, s - 3)),
            tile=3,
        ),  # tiles
        BlockCase(replace(ring, layout="stripe", window=5), straddle, tile=2),
        BlockCase(  # [B, S] documents and blocks, tiled
            replace(ring, layout="contiguous", cu_seqlens=cu),
            in_docs,
            ((2, 8), (s // 2 + 8, s - 2)),
            3,
            (0, 9, s),
        ),
        BlockCase(  # dynamic_degree: every rank alone (p = 1)
            replace(dyn, cu_seqlens=tuple(range(0, s + 1, 4))), tuple((i, i + 3) for i in range(1, s, 8))
        ),
    ]
    if p == 4:
        usp = replace(ring, attention="usp", u=2, h=8)  # U2 x R2
        cases += [
            BlockCase(usp, straddle),
            BlockCase(replace(usp, layout="stripe", window=7, cu_seqlens=cu), in_docs, ((0, 5),)),
            BlockCase(replace(ring, inner=2), straddle),  # the double ring
            BlockCase(replace(ring, schedule="startrail", team_size=2, h_kv=4), straddle),  # team rows
            BlockCase(  # dynamic_degree: two groups of p = 2 ranks, a document cut across a group's ranks
                replace(dyn, cu_seqlens=(0, 24, 32, 56, 64), window=6), ((2, 20), (25, 30), (40, 55))
            ),
        ]
    return cases


def refusals(_: object = None) -> list[str]:
    """The messages of every refused call (before any collective: a refusal on one rank only would hang)."""
    world, s = dist.get_world_size(), 8 * dist.get_world_size()
    base = AttentionCase(seq_len=s, u=1, h=2, h_kv=2, attention="ring", layout="contiguous")
    q = torch.randn(1, s // world, 2, D, dtype=torch.float64)
    docs = torch.tensor([0] * (s // 2) + [1] * (s // 2 - 2) + [-1, -1])
    bad = [
        (base, torch.zeros(s + 1, dtype=torch.int64), None, None),  # shape
        (base, torch.zeros(s), None, None),  # float dtype
        (base, _ids(((0, 2), (3, 4)), s).masked_fill(torch.arange(s) == 3, 10), None, None),  # split run
        (base, _ids(((s // 2 - 1, s // 2 + 1),), s), docs, None),  # crosses a document border
        (base, _ids(((s - 3, s),), s), docs, None),  # covers padding
        (base, _ids(((0, 2),), s), None, 4),  # chunk
        (replace(base, sparse="stripe", attention="sparse_ring"), _ids(((0, 2),), s), None, None),
    ]
    messages = []
    for case, blocks, doc_ids, chunk in bad:
        mesh = mesh_for(case.section(world))
        try:
            ds_seqpar.attention(q, q, q, mesh=mesh, doc_ids=doc_ids, blocks=blocks, chunk=chunk)
        except ValueError as err:
            messages.append(str(err))
        else:
            messages.append("not refused")
    return messages


@pytest.mark.parametrize("p", [2, 4])
def test_image_blocks_match_reference_on_every_path(dist_pool, p):
    cases = _cases(p)
    pool = dist_pool(p)
    results = pool.run(run_block_cases, cases)
    for i, bc in enumerate(cases):
        for rank, per_rank in enumerate(results):
            assert_within(per_rank[i], TOL, f"{bc} rank {rank}")
    if p == 2:
        messages = pool.run(refusals)[0]
        expected = ("has shape (", "has dtype torch.float32", "split into 2 runs", "crosses a document border",
                    "covers padding", "chunk=4", "sparse_ring")  # fmt: skip
        for got, want in zip(messages, expected, strict=True):
            assert want in got and "blocks" in got, (want, got)


def test_mask_rule_and_classification():
    """``token_mask`` with query ends is HF's rule; a diagonal block with an image block is PARTIAL, not
    CAUSAL, and keys all after the queries are not EMPTY when a block reaches them."""
    s = 24
    blocks = _ids(((2, 9), (11, 12), (15, 22)), s)
    pos, ends = torch.arange(s), torch.arange(s) + block_reach(blocks)
    for spec in (MaskSpec(), MaskSpec(window=4), MaskSpec(window=1)):
        assert torch.equal(token_mask(pos, pos, spec, q_end=ends), reference_mask(blocks, spec, None))
    assert classify_block(pos[:8], pos[:8], q_end=ends[:8])[0] is BlockKind.PARTIAL
    assert classify_block(pos[:8], pos[:8])[0] is BlockKind.CAUSAL
    kind, mask = classify_block(pos[4:8], pos[8:12], q_end=ends[4:8])
    assert kind is BlockKind.PARTIAL and int(mask.sum()) == 4  # queries 4..7 see key 8
    assert classify_block(pos[12:15], pos[12:15], q_end=ends[12:15])[0] is BlockKind.CAUSAL  # text only
    assert block_reach(blocks)[2:9].tolist() == [6, 5, 4, 3, 2, 1, 0]
    with pytest.raises(ValueError, match="batch rows but q has B = 3"):
        check_blocks(torch.stack([blocks, blocks]), s, 3)


def test_plan_refuses_reach_without_causal():
    schedule = RingSchedule.__new__(RingSchedule)
    with pytest.raises(ValueError, match="image blocks"):
        RingPlan(
            schedule, ContiguousLayout(1), MaskSpec(causal=False), reach=torch.zeros(4, dtype=torch.int64)
        )


def test_hf_attention_passes_blocks_and_refuses_them_where_not_honoured(monkeypatch):
    from types import SimpleNamespace

    from ds_seqpar.integrations import hf_attention
    from ds_seqpar.integrations.context import CONTEXT_KEY, SeqParContext
    from ds_seqpar.integrations.hf_model import UnsupportedModelError

    seen: dict = {}

    def fake(q, k, v, **kw):
        seen.update(kw)
        return q

    monkeypatch.setattr(hf_attention, "attention", fake)
    blocks = _ids(((1, 5),), 16)
    ctx = SeqParContext(mesh=None, blocks=blocks)
    layer = torch.nn.Module()
    layer.layer_idx = 0
    q = torch.randn(1, 2, 8, 4)

    def call():
        return hf_attention.seqpar_attention_forward(layer, q, q, q, None, **{CONTEXT_KEY: ctx})

    call()
    assert seen["blocks"] is blocks and seen["causal"] is True
    for field_name, value, where in (
        ("approximate", fake, "an approximate prefill"),
        ("cross_active", {id(layer)}, "cross-attention"),
        ("cache", SimpleNamespace(decoding=True), "a decoding step"),
    ):
        before = getattr(ctx, field_name)
        setattr(ctx, field_name, value)
        with pytest.raises(UnsupportedModelError, match=f"image blocks .* not honoured in {where}"):
            call()
        setattr(ctx, field_name, before)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("docs", [False, True])
def test_tiles_cover_exactly_the_visible_pairs(monkeypatch, window, docs):
    """``block_tasks`` of a long pair with image blocks: tiles (FULL / CAUSAL / trimmed PARTIAL) cover every
    visible pair once and nothing else; no mask is larger than a tile."""
    monkeypatch.setattr(ring_tasks, "IMAGE_BLOCK_TILE", 4)
    s, spec = 48, MaskSpec(window=window)
    blocks = torch.stack([_ids(((3, 9), (20, 31)), s), _ids(((0, 2), (13, 17)), s)])
    doc = torch.tensor([0] * 18 + [1] * 27 + [-1] * 3) if docs else None
    pos = torch.arange(s)
    ends = pos + block_reach(blocks)
    tasks = ring_tasks.block_tasks(spec, [(0, s)], [(0, s)], pos, pos, doc, doc, q_end=ends)
    cover = torch.zeros(2, s, s, dtype=torch.int64)
    for t in tasks:
        rows, cols = t.q_rows.stop - t.q_rows.start, t.k_rows.stop - t.k_rows.start
        part = {BlockKind.FULL: torch.ones(rows, cols), BlockKind.CAUSAL: torch.ones(rows, cols).tril()}
        cover[:, t.q_rows, t.k_rows] += part.get(t.kind, t.mask).long()
    assert torch.equal(cover, reference_mask(blocks, spec, doc).long())
    assert all(t.mask is None or max(t.mask.shape[-2:]) <= 4 for t in tasks)  # no mask of the whole pair
    assert window is not None or any(t.kind is BlockKind.CAUSAL for t in tasks)


@pytest.mark.slow  # P = 2 and 4 run in the default suite; a pool of 3 costs ~10 s more
def test_image_blocks_match_reference_at_an_odd_degree(dist_pool):
    cases = _cases(3)
    results = dist_pool(3).run(run_block_cases, cases)
    for i, bc in enumerate(cases):
        for rank, per_rank in enumerate(results):
            assert_within(per_rank[i], TOL, f"{bc} rank {rank}")


def test_an_id_may_come_back_in_another_document():
    """HF's packed mask separates documents, so one id per document is one block each; twice in one document
    (or across a border) is refused."""
    s = 20
    doc = torch.tensor([0] * 8 + [1] * 10 + [-1] * 2)
    blocks = _ids(((2, 5),), s)
    blocks[10:14] = 10  # the id of the first document's block, again in the second
    check_blocks(blocks, s, 1, doc)
    assert torch.equal(block_reach(blocks), block_reach(_ids(((2, 5), (10, 14)), s)))
    blocks[16] = 10
    with pytest.raises(ValueError, match=r"id 10 of batch row 0 is split into 2 runs \(document 1\)"):
        check_blocks(blocks, s, 1, doc)
