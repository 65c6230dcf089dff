"""DeepSeek sparse attention (DSA) under sequence parallelism (docs/dsa.md): the top-k key set of every query
under SP equals one process's bit for bit (ties included), the sparse attention over gathered keys matches a
dense fp64 reference forward and backward, and the bytes counted equal the formula of
``parallel/topk_sparse.py``. The whole-model checks are the sweep (``tests/test_model_families.py``) and the
ZeRO-3 A/B below."""

from __future__ import annotations

import pytest
import torch

from ds_seqpar.ops.masks import MaskSpec, token_mask
from ds_seqpar.ops.sparse.topk import indexer_scores, select_topk, topk_attention, topk_attention_reference

B, S, H, D, DV, HI, DI, TOPK = 2, 48, 3, 8, 6, 2, 8, 12


def _inputs(dtype: torch.dtype, seed: int, ties: bool) -> dict[str, torch.Tensor]:
    """Full-sequence inputs, the same on every rank; ``ties``: values on a coarse grid (many equal scores)."""
    g = torch.Generator().manual_seed(seed)
    t = {
        "q_i": torch.randn(B, S, HI, DI, generator=g),
        "k_i": torch.randn(B, S, DI, generator=g),
        "w": torch.randn(B, S, HI, generator=g),
        "q": torch.randn(B, S, H, D, generator=g),
        "k": torch.randn(B, S, H, D, generator=g),
        "v": torch.randn(B, S, H, DV, generator=g),
        "sinks": torch.randn(H, generator=g),
    }
    if ties:
        t = {n: (x * 2).round() / 2 for n, x in t.items()}
    return {n: x.to(dtype) for n, x in t.items()}


def _docs() -> torch.Tensor:
    doc = torch.zeros(B, S, dtype=torch.long)
    doc[0, 20:] = 1
    doc[1, 30:] = 1
    doc[1, 44:] = -1  # padding
    return doc


def _full_visible(doc: torch.Tensor | None) -> torch.Tensor:
    pos = torch.arange(S)
    if doc is None:
        return token_mask(pos, pos, MaskSpec(causal=True)).unsqueeze(0)
    return token_mask(pos.expand(B, -1), pos.expand(B, -1), MaskSpec(causal=True), doc, doc)


def test_topk_attention_matches_dense_reference():
    """fp64, single process: chunked top-k attention (sinks, rows without keys) = the dense reference."""
    t = _inputs(torch.float64, 1, ties=False)
    doc = _docs()
    visible = _full_visible(doc)
    idx = select_topk(indexer_scores(t["q_i"], t["k_i"], t["w"].float(), 0.5), visible, TOPK)
    for sinks in (None, t["sinks"]):
        leaves = [t[n].clone().requires_grad_() for n in ("q", "k", "v")]
        ref_leaves = [x.detach().clone().requires_grad_() for x in leaves]
        out = topk_attention(*leaves, idx, visible, 0.3, chunk=7, sinks=sinks)
        ref = topk_attention_reference(*ref_leaves, idx, visible, 0.3, sinks=sinks)
        grad = torch.randn_like(ref)
        (out * grad).sum().backward()
        (ref * grad).sum().backward()
        assert (out - ref).abs().max().item() <= 1e-12
        for a, b in zip(leaves, ref_leaves, strict=True):
            assert (a.grad - b.grad).abs().max().item() <= 1e-12


# -- distributed cases (one spawned pool of 4 ranks) ---------------------------------------------------


def _selection_case(section: dict, dtype: torch.dtype, docs: bool) -> bool:
    """This rank's selected sets under SP equal one process's (sorted positions, bitwise)."""
    from ds_seqpar.parallel.topk_sparse import SequenceGather, dsa_select
    from tests.helpers.meshes import mesh_for

    mesh = mesh_for(section)
    t = _inputs(dtype, 2, ties=True)
    doc = _docs() if docs else None
    seq = SequenceGather(mesh, S // mesh.sp_size, doc, torch.device("cpu"))
    mine = seq.q_pos
    got = dsa_select(seq, t["q_i"][:, mine], t["k_i"][:, mine], t["w"][:, mine].float(), 0.5, TOPK)
    full = select_topk(indexer_scores(t["q_i"], t["k_i"], t["w"].float(), 0.5), _full_visible(doc), TOPK)[
        :, mine
    ]
    return torch.equal(got.sort(-1).values, full.sort(-1).values)


def _attention_case(section: dict, sinks: bool) -> dict:
    """fp64 sparse attention over the gathered K / V: max errors of out and of the q / k / v gradients of this
    rank's rows, and the bytes counted vs the formula (all_gather, reduce_scatter)."""
    from ds_seqpar.parallel.topk_sparse import SequenceGather, dsa_select
    from tests.helpers.meshes import mesh_for

    mesh = mesh_for(section)
    p, n = mesh.sp_size, S // mesh.sp_size
    t = _inputs(torch.float64, 3, ties=False)
    doc = _docs()
    seq = SequenceGather(mesh, n, doc, torch.device("cpu"))
    mine = seq.q_pos
    before = mesh.comm_stats.snapshot()
    idx = dsa_select(seq, t["q_i"][:, mine], t["k_i"][:, mine], t["w"][:, mine].float(), 0.5, TOPK)
    q, k, v = (t[x][:, mine].clone().requires_grad_() for x in ("q", "k", "v"))
    kv = seq.gather(torch.cat([k.flatten(2), v.flatten(2)], dim=-1))  # [B, S, H*(D+DV)]
    k_all, v_all = kv.split([H * D, H * DV], dim=-1)
    s = t["sinks"] if sinks else None
    out = topk_attention(
        q, k_all.unflatten(-1, (H, D)), v_all.unflatten(-1, (H, DV)), idx, seq.visible, 0.3, sinks=s
    )
    grad = torch.randn(B, S, H, DV, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (out * grad[:, mine]).sum().backward()
    after = mesh.comm_stats.snapshot()
    full = [t[x].clone().requires_grad_() for x in ("q", "k", "v")]
    idx_full = select_topk(indexer_scores(t["q_i"], t["k_i"], t["w"].float(), 0.5), _full_visible(doc), TOPK)
    ref = topk_attention_reference(*full, idx_full, _full_visible(doc), 0.3, sinks=s)
    (ref * grad).sum().backward()
    errs = [(out - ref[:, mine]).abs().max().item()]
    errs += [(a.grad - b.grad[:, mine]).abs().max().item() for a, b in zip((q, k, v), full, strict=True)]

    def sent(kind: str) -> int:
        return after[kind].bytes - (before[kind].bytes if kind in before else 0)

    width = H * (D + DV)
    expected = {
        "all_gather": (p - 1) * B * n * (DI * 8 + width * 8),
        "reduce_scatter": (p - 1) * B * n * width * 8,
    }
    return {"err": max(errs), "bytes": {k: sent(k) for k in expected}, "expected": expected}


SECTIONS = {
    "U2xR2": {"size": 4, "ulysses_degree": 2, "ring": {"layout": "zigzag"}},
    "R4": {"size": 4, "ulysses_degree": 1, "ring": {"layout": "zigzag"}},
    "P2": {"size": 2, "ulysses_degree": 1, "ring": {"layout": "zigzag"}},  # dp 2 x SP 2
}


def _dist_cases() -> dict:
    out: dict = {}
    for name in ("U2xR2", "R4"):
        for dtype in (torch.float32, torch.float64):
            for docs in (False, True):
                out[f"select {name} {dtype} docs={docs}"] = _selection_case(SECTIONS[name], dtype, docs)
    for name in ("U2xR2", "P2"):
        for sinks in (False, True):
            out[f"attention {name} sinks={sinks}"] = _attention_case(SECTIONS[name], sinks)
    return out


def test_dsa_selection_attention_and_bytes_under_sp(dist_pool):
    """P = 4 (U2xR2 and R4, zigzag) and P = 2: identical top-k sets in fp32 and fp64 (ties, documents,
    padding); fp64 sparse attention <= 1e-10 forward and backward; bytes = the formula."""
    for rank_out in dist_pool(4).run(_dist_cases):
        for case, result in rank_out.items():
            if case.startswith("select"):
                assert result is True, case
            else:
                assert result["err"] <= 1e-10, (case, result)
                assert result["bytes"] == result["expected"], (case, result)


def _attention_only() -> dict:
    world = torch.distributed.get_world_size()
    section = {"size": world, "ulysses_degree": 1, "ring": {"layout": "zigzag"}}
    return {"select": _selection_case(section, torch.float64, True), **_attention_case(section, True)}


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 8])
def test_dsa_at_three_and_eight_ranks(dist_pool, world):
    for result in dist_pool(world).run(_attention_only):
        assert result["select"] is True
        assert result["err"] <= 1e-10, result
        assert result["bytes"] == result["expected"], result


# -- DeepSpeed ZeRO-3 A/B of a DSA model (tests/helpers/hf_ab.py) -------------------------------------


@pytest.mark.parametrize(("sp", "u"), [(4, 2), (4, 1)])
def test_deepseek_v32_zero3_matches_non_sp(dist_pool, sp, u):
    """DeepSeek-V3.2 (DSA on every layer, top-k 16 of 64 tokens) trained 3 SGD steps under ZeRO-3 at
    U2 x R2 and R4 = the plain model in one process."""
    from tests.helpers.hf_ab import deepspeed_ab

    for rep in dist_pool(4).run(deepspeed_ab, "deepseek_v32", sp, u, 3, 3, 64, 0.5):
        assert max(rep["loss_errs"]) <= 1e-5, rep
        assert rep["grad_err"] <= 1e-5, rep


@pytest.mark.parametrize(
    ("layout", "u", "lengths", "dynamic"),
    [
        ("zigzag", 2, [3, 40, 5, 9, 7], False),  # packed documents: selection and attention stay inside each
        ("documents", 2, [24, 8, 24, 8], True),  # document placement, dynamic SP degree
        ("contiguous", 1, None, False),  # 62 tokens: end padding
    ],
)
def test_deepseek_v32_packed_and_padded_equals_plain_model(dist_pool, layout, u, lengths, dynamic):
    from tests.helpers.hf_ab import sp_vs_reference
    from tests.helpers.hf_models import batches

    batch = batches(1, 1 if lengths else 2, 64 if lengths else 62)[0]
    if lengths:
        batch["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None]
    # 16 indexer heads: an index score is exactly 0 (every head's relu 0) with probability 2^-16, so no tie
    # sits at the k-th score; the reference runs each document (or the unpadded row) alone, where CPU topk
    # breaks ties differently (docs/dsa.md "Ties")
    heads = {"index_n_heads": 16}
    for rep in dist_pool(4).run(sp_vs_reference, "deepseek_v32", u, layout, batch, heads, dynamic=dynamic):
        assert rep["finite"], rep
        assert rep["loss_err"] <= 1e-5 and rep["grad_rel_err"] <= 1e-5, rep


def test_selection_equals_transformers_indexer_on_a_packed_row():
    """One process, the tiny DeepSeek-V3.2 (2 indexer heads: many exact ties): on a packed row (position_ids
    restarting per document) transformers' indexer returns exactly the top-k that ds_seqpar selects from the
    same inputs with its own visibility (causal, same document), ties included."""
    from ds_seqpar.data import doc_ids_from_positions
    from ds_seqpar.integrations.dsa_families import half_split_indexer
    from tests.helpers.hf_models import tiny_model

    model = tiny_model("deepseek_v32").eval()
    seen: list = []

    def capture(module, args, kwargs, out):
        seen.append((module, args, kwargs, out))

    hooks = [
        layer.self_attn.indexer.register_forward_hook(capture, with_kwargs=True)
        for layer in model.model.layers
    ]
    pos = torch.cat([torch.arange(n) for n in (3, 40, 5, 9, 7)])[None]
    with torch.no_grad():
        model(
            input_ids=torch.randint(0, 90, (1, 64), generator=torch.Generator().manual_seed(0)),
            position_ids=pos,
        )
    for h in hooks:
        h.remove()
    doc = doc_ids_from_positions(pos)
    k_pos = torch.arange(64)[None]
    visible = token_mask(k_pos, k_pos, MaskSpec(causal=True), doc, doc)
    for module, args, _kwargs, out in seen:
        hidden, q_resid, cos_sin = args[:3]
        q, k, w, scale = half_split_indexer(module, hidden, q_resid, cos_sin)
        ours = select_topk(indexer_scores(q, k, w, scale), visible, module.index_topk)
        assert torch.equal(ours, out.long())
