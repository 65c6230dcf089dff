"""Recurrent layers decoding from the sharded prefill (docs/inference_recurrent.md): the state ``ds_seqpar.prefill``
keeps equals the single-process HF cache's, and generation equals ``model.generate``.

Tiny float32 Qwen3-Next / Qwen3.5 (gated DeltaNet + softmax attention), 4 and 2 gloo ranks. The kept state of
every GDN layer (conv rows, recurrent state) is compared with the HF model's own cache after the prompt
(``use_cache=True``) over Ulysses x ring and a ring of 4 (contiguous, zigzag), with end padding (prompts that are not a
multiple of the layout's) and prompts shorter than the conv width; generation of Qwen3.5 (the second class)
through ``tests/test_generation.generation_case``. Packed prompts are refused by name.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ds_seqpar
from ds_seqpar import SeqParCausalLM
from ds_seqpar.integrations.delta_state import DeltaState
from ds_seqpar.integrations.hf_model import UnsupportedModelError
from tests.helpers.hf_ab import sp_mesh
from tests.helpers.hf_models import VOCAB, tiny_model
from tests.test_generation import GREEDY, NEW_TOKENS, SAMPLED, TOL, generation_case


def state_case(kind: str, u: int, layout: str, prompt: int) -> dict:
    """Largest errors of the kept conv rows, recurrent states and prefill logits against HF's cache."""
    ref = tiny_model(kind, max_position_embeddings=512)
    ref.eval()
    model = copy.deepcopy(ref)
    ids = torch.randint(3, VOCAB, (2, prompt), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out = ref(ids, use_cache=True)
    hf = out.past_key_values
    sp = SeqParCausalLM(model, sp_mesh(u, layout))
    sp.eval()
    got = ds_seqpar.prefill(sp, ids)
    states = got.cache.states
    errors = {"conv": 0.0, "recurrent": 0.0}
    for layer, state in states.items():
        assert isinstance(state, DeltaState)
        width = state.conv.shape[-1]
        errors["conv"] = max(
            errors["conv"], (state.conv - hf.get_conv_state(layer)[..., -width:]).abs().max().item()
        )
        errors["recurrent"] = max(
            errors["recurrent"], (state.recurrent - hf.get_recurrent_state(layer)).abs().max().item()
        )
    errors["logits"] = (got.logits - out.logits[:, -1].float()).abs().max().item()
    kinds = ref.config.layer_types
    return errors | {
        "layers": sorted(states),
        "linear": [i for i, t in enumerate(kinds) if t == "linear_attention"],
    }


STATE_CASES = [
    ("qwen3_next", 2, "zigzag", 45),  # U 2 x R 2, end padding in the last piece
    ("qwen3_next", 1, "contiguous", 43),  # ring of 4
    ("qwen3_next", 1, "zigzag", 2),  # fewer prompt tokens than the conv width; 3 ranks hold only padding
    ("qwen3_5", 2, "zigzag", 5),
]


def test_kept_state_equals_hf_cache(dist_pool):
    for case in STATE_CASES:
        for rank, res in enumerate(dist_pool(4).run(state_case, *case)):
            where = f"{case} rank {rank}: {res}"
            assert res["layers"] == res["linear"], where
            assert max(res["conv"], res["recurrent"], res["logits"]) <= TOL, where


def test_qwen3_5_generate_equals_hf(dist_pool):
    for rank, res in enumerate(dist_pool(4).run(generation_case, "qwen3_5", 1, "contiguous", 37, SAMPLED)):
        where = f"qwen3_5 rank {rank}: {res}"
        assert res["steps"] == (NEW_TOKENS, NEW_TOKENS), where
        assert res["prefill"] <= TOL and res["decode"] <= TOL, where
        assert res["same_tokens"] and res["ranks_agree"], where


def test_short_prompt_generate_equals_hf(dist_pool):
    for rank, res in enumerate(dist_pool(4).run(generation_case, "qwen3_next", 2, "zigzag", 3, GREEDY)):
        where = f"qwen3_next (3 prompt tokens) rank {rank}: {res}"
        assert res["prefill"] <= TOL and res["decode"] <= TOL and res["same_tokens"], where


def packed_refused() -> str:
    sp = SeqParCausalLM(tiny_model("qwen3_next"), sp_mesh(1, "contiguous"))
    ids = torch.randint(3, VOCAB, (1, 12))
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with pytest.raises(UnsupportedModelError, match="carries its state across every document") as err:
        ds_seqpar.prefill(sp, ids, position_ids=positions)
    return str(err.value)


def test_packed_prompt_refused_by_name(dist_pool):
    for message in dist_pool(2).run(packed_refused):
        assert "Qwen3NextGatedDeltaNet" in message and "position_ids=None" in message


def test_undecodable_recurrent_layer_refused_by_name():
    from ds_seqpar.integrations.recurrent_state import refuse_undecodable_layers

    refuse_undecodable_layers(tiny_model("qwen3_next"))  # decodes: nothing raised
    with pytest.raises(UnsupportedModelError, match="KimiLinearDeltaAttention") as err:
        refuse_undecodable_layers(tiny_model("kimi_linear"))
    assert "Qwen3NextGatedDeltaNet" in str(err.value) and "generate with the plain model" in str(err.value)
