"""APB / Star prefill of tiny HF models (``integrations/apb_prefill.py``): with a passing budget that keeps every
token it equals the single-process model; the cache holds this rank's block only; refusals by name."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from ds_seqpar import SeqParCausalLM
from ds_seqpar.integrations.apb_prefill import apb_prefill_logits, apb_rows, apb_spec
from ds_seqpar.parallel.apb import ApbSpec
from tests.helpers.hf_models import VOCAB, tiny_model
from tests.helpers.meshes import mesh_for

S = 32


class StubCache:
    """What ``ApbAttention`` stores: ``store(layer, key [B, H_kv, n, D], value, positions [n])``."""

    def __init__(self) -> None:
        self.layers: dict[int, tuple] = {}

    def store(self, layer, key, value, positions):
        self.layers[layer] = (key.clone(), value.clone(), positions.clone())


def prefill_case(kind: str, inference: dict) -> dict:
    """APB / Star last-position logits vs the plain model's on the whole prompt; what the cache holds."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = tiny_model(kind).eval()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = reference(input_ids=ids, use_cache=False).logits[:, -1]
    mesh = mesh_for({"size": world, "ulysses_degree": 1, "inference": inference}, model.config)
    cache = StubCache()
    got = apb_prefill_logits(SeqParCausalLM(model, mesh), ids, apb_spec(mesh), cache)
    n = S // world
    key, _, positions = cache.layers[0]
    return {
        "err": (got - want).abs().max().item(),
        "finite": bool(torch.isfinite(got).all()),
        "layers": sorted(cache.layers),
        "cache_ok": key.shape[2] == n and torch.equal(positions, torch.arange(rank * n, (rank + 1) * n)),
    }


FULL = [
    ("llama", {"prefill": "apb", "anchor_len": 3, "query_len": 2, "passing_len": S}),
    ("qwen3", {"prefill": "apb", "anchor_len": 0, "query_len": 4, "passing_len": S}),  # H=8, H_kv=2
    ("mistral", {"prefill": "apb", "anchor_len": 5, "query_len": 1, "passing_len": S}),  # sliding window 12
    ("gemma2", {"prefill": "apb", "anchor_len": 2, "query_len": 3, "passing_len": S}),  # softcap, window
    ("gpt_oss", {"prefill": "apb", "anchor_len": 4, "query_len": 2, "passing_len": S}),  # sinks, window
]


@pytest.mark.parametrize(("kind", "inference"), FULL)
def test_full_budget_prefill_equals_the_model(dist_pool, kind, inference):
    for rank, rep in enumerate(dist_pool(4).run(prefill_case, kind, inference)):
        assert rep["err"] <= 1e-5 and rep["cache_ok"], (rank, rep)
        assert rep["layers"] == [0, 1], rep


@pytest.mark.parametrize(
    "inference", [{"prefill": "star", "anchor_len": 4}, {"prefill": "apb", "passing_len": 2}]
)
def test_approximate_prefill_caches_the_block_and_differs(dist_pool, inference):
    inference = {"anchor_len": 4, "query_len": 2, **inference}
    reps = dist_pool(4).run(prefill_case, "llama", inference)
    assert all(r["cache_ok"] and r["finite"] for r in reps), reps
    assert reps[0]["err"] > 1e-4, reps  # the approximation is applied (random weights: far from exact)


def test_rows_prepend_anchor_and_query():
    ids = torch.arange(16).view(1, 16)
    rows, pos = apb_rows(ids, 2, 4, ApbSpec(2, 3, 1))
    assert rows.tolist() == [[0, 1, 13, 14, 15, 8, 9, 10, 11]]
    assert pos.tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="length 15 is not a multiple of 4"):
        apb_rows(ids[:, :15], 0, 4, ApbSpec(2, 3, 1))
    with pytest.raises(ValueError, match="anchor_len=5"):
        apb_rows(ids, 0, 4, ApbSpec(5, 3, 1))
