"""``ds_seqpar.prefill`` in the modes ``"apb"`` / ``"star"`` (``integrations/apb_prefill.py``) on tiny HF models: with
a passing budget that keeps every token it equals the plain model (logits and cache); the approximation
is applied otherwise; what it cannot honour is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import ds_seqpar
from ds_seqpar.integrations.apb_prefill import apb_rows
from ds_seqpar.parallel.apb import ApbSpec
from tests.helpers.hf_models import VOCAB, tiny_model
from tests.helpers.meshes import mesh_for

S = 30  # padded to 32 on 4 ranks: blocks of 8, the last one with 2 padding tokens


def prefill_case(kind: str, inference: dict, u: int = 1, mode: str | None = None) -> dict:
    """APB / Star last-position logits vs the plain model's; the cache vs the plain model's K/V."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = tiny_model(kind).eval()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = reference(input_ids=ids, use_cache=True)
    section = {"size": world, "ulysses_degree": u, "ring": {"layout": "contiguous"}, "inference": inference}
    mesh = mesh_for(section, model.config)
    got = ds_seqpar.prefill(model, ids, mesh=mesh, mode=mode)
    n = 32 // world
    keep = torch.arange(rank * n, min((rank + 1) * n, S))
    shard = got.cache.layers[0]
    ref_keys = ref.past_key_values.layers[0].keys  # a windowed layer's HF cache keeps its window only
    cache_err = 0.0
    if ref_keys.shape[2] == S:
        cache_err = (shard.keys[:, :, : shard.length] - ref_keys[:, :, keep]).abs().max().item()
    return {
        "err": (got.logits - ref.logits[:, -1]).abs().max().item(),
        "cache_err": cache_err,
        "positions_ok": list(shard.positions) == keep.tolist(),
        "finite": bool(torch.isfinite(got.logits).all()),
        "layers": sorted(got.cache.layers),
    }


FULL = [
    ("llama", {"prefill": "apb", "anchor_len": 3, "query_len": 2, "passing_len": S}, 1),
    ("qwen3", {"prefill": "apb", "anchor_len": 0, "query_len": 4, "passing_len": S}, 2),  # H=8, H_kv=2, U=2
    ("mistral", {"prefill": "apb", "anchor_len": 5, "query_len": 1, "passing_len": S}, 1),  # window 12
    ("gemma2", {"prefill": "apb", "anchor_len": 2, "query_len": 3, "passing_len": S}, 1),  # softcaps, windows
    ("gpt_oss", {"prefill": "apb", "anchor_len": 4, "query_len": 2, "passing_len": S}, 1),  # sinks, windows
]


@pytest.mark.parametrize(("kind", "inference", "u"), FULL)
def test_full_budget_prefill_equals_the_model(dist_pool, kind, inference, u):
    for rank, rep in enumerate(dist_pool(4).run(prefill_case, kind, inference, u)):
        assert rep["err"] <= 1e-5 and rep["cache_err"] <= 1e-5 and rep["positions_ok"], (rank, rep)
        assert rep["layers"] == [0, 1], rep


@pytest.mark.parametrize(
    ("inference", "mode"),
    [({"prefill": "star"}, None), ({"prefill": "apb", "passing_len": 2}, None), ({"prefill": "apb"}, "star")],
)
def test_approximate_prefill_is_applied_and_caches_the_block(dist_pool, inference, mode):
    inference = {"anchor_len": 4, "query_len": 2, **inference}
    reps = dist_pool(4).run(prefill_case, "llama", inference, 1, mode)
    assert all(r["positions_ok"] and r["finite"] and r["cache_err"] <= 1e-5 for r in reps[:1]), reps
    assert all(r["positions_ok"] and r["finite"] for r in reps), reps
    assert reps[0]["err"] > 1e-4, reps  # random weights: the approximation is far from exact


def refused_layout() -> str:
    model = tiny_model("llama").eval()
    mesh = mesh_for({"size": dist.get_world_size(), "ulysses_degree": 1, "ring": {"layout": "zigzag"}})
    try:
        ds_seqpar.prefill(model, torch.zeros(1, 8, dtype=torch.long), mesh=mesh, mode="apb")
    except ds_seqpar.UnsupportedModelError as err:
        return str(err)
    return "no error"


def test_non_contiguous_layout_is_refused_by_name(dist_pool):
    for msg in dist_pool(4).run(refused_layout):
        assert "ring.layout='contiguous'" in msg, msg


def test_rows_prepend_anchor_and_query():
    prompt = torch.arange(16).view(1, 16)
    rows, pos = apb_rows(prompt, prompt[:, 8:12], torch.arange(8, 12).view(1, 4), ApbSpec(2, 3, 1))
    assert rows.tolist() == [[0, 1, 13, 14, 15, 8, 9, 10, 11]]
    assert pos.tolist() == [[0, 1, 2, 3, 4, 8, 9, 10, 11]]
    with pytest.raises(ValueError, match="anchor_len=5"):
        apb_rows(prompt, prompt[:, :4], torch.arange(4).view(1, 4), ApbSpec(5, 3, 1))


def generate_case() -> dict:
    """Greedy generation after a full-budget APB prefill (the section's default mode) vs HF's generate."""
    world = dist.get_world_size()
    model = tiny_model("llama").eval()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (1, S), generator=torch.Generator().manual_seed(5))
    want = reference.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    inference = {"prefill": "apb", "anchor_len": 3, "query_len": 2, "passing_len": S}
    section = {"size": world, "ulysses_degree": 1, "ring": {"layout": "contiguous"}, "inference": inference}
    mesh = mesh_for(section, model.config)
    got = ds_seqpar.generate(model, ids, mesh=mesh, max_new_tokens=6, do_sample=False, pad_token_id=0)
    return {"same": torch.equal(got.sequences, want)}


def test_generation_from_a_full_budget_apb_cache_equals_hf(dist_pool):
    assert all(r["same"] for r in dist_pool(4).run(generate_case))
