"""Families whose attention computes its scores inline (GPT-Neo, GPT, XGLM, GPT-NeoX-Japanese, Megatron-BERT,
RemBERT, RoFormer) under ds_seqpar equal the plain model: ``integrations/inline_adapters.py`` routes their
attention layers through the attention interface with the family's own scale, window and rotary positions
(docs/integration.md "Routed attention layers").

Tiny float32 models from ``benchmarks/tiny_configs.py`` (the BERT-style ones with ``is_decoder=True``), 4 gloo
ranks: one forward/backward at U2 x R2 and R4 (the SP ranks' gradients sum to the plain gradient), and
``ds_seqpar.initialize`` with ZeRO-3 for GPT-Neo (a local window of 8 across shard borders).
"""

from __future__ import annotations

import pytest
import torch

from ds_seqpar.integrations.attention_layers import route_attention_layers, unroute_attention_layers
from ds_seqpar.integrations.hf_model import UnsupportedModelError
from ds_seqpar.integrations.inline_adapters import refuse_unroutable_layers
from tests.helpers.hf_ab import deepspeed_ab, sp_vs_reference
from tests.helpers.hf_models import batches, tiny_model

DECODER = {"is_decoder": True}

CASES = [
    ("gpt_neo", 2, "zigzag", None),  # U 2 x R 2, local layer window 8 across shard borders
    ("gpt_neo", 1, "contiguous", None),  # pure ring
    ("xglm", 1, "zigzag", None),  # q pre-scaled, sinusoidal positions + offset
    ("roformer", 2, "zigzag", DECODER),  # rotary recomputed at global token indices
    pytest.param("gpt_neox_japanese", 1, "zigzag", None, marks=pytest.mark.slow),
    pytest.param("megatron-bert", 2, "zigzag", DECODER, marks=pytest.mark.slow),
    pytest.param("rembert", 1, "zigzag", DECODER, marks=pytest.mark.slow),
    pytest.param("openai-gpt", 2, "zigzag", None, marks=pytest.mark.slow),
    pytest.param(
        "big_bird", 2, "zigzag", {**DECODER, "attention_type": "original_full"}, marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize(
    ("kind", "u", "layout", "overrides"), CASES, ids=lambda x: x if isinstance(x, str | int) else ""
)
def test_forward_backward_equals_plain_model(dist_pool, kind, u, layout, overrides):
    batch = batches(1, 2, 64)[0]
    for rep in dist_pool(4).run(sp_vs_reference, kind, u, layout, batch, overrides):
        assert rep["finite"], rep
        assert rep["loss_err"] <= 1e-5, rep
        assert rep["grad_rel_err"] <= 1e-5, rep


@pytest.mark.parametrize("u", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_gpt_neo_zero3_training_matches_plain_model(dist_pool, u):
    for rep in dist_pool(4).run(deepspeed_ab, "gpt_neo", 4, u, 3, 3, 64, 0.5):
        assert max(rep["loss_errs"]) <= 1e-5, rep
        assert rep["grad_err"] <= 1e-5, rep


@pytest.mark.parametrize("kind", ["openai-gpt", "xglm"])
def test_routed_layers_through_sdpa_equal_the_family_forward(kind):
    """One process: the routed layers calling transformers' sdpa (causal, no window) give the family's own logits."""
    model = tiny_model(kind).eval()
    ids = batches(1, 1, 24)[0]["input_ids"]
    with torch.no_grad():
        before = model(input_ids=ids).logits
        assert route_attention_layers(model, "sdpa") > 0
        try:
            after = model(input_ids=ids).logits
        finally:
            unroute_attention_layers(model)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("kind", "cause"), [("reformer", "LocalSelfAttention"), ("big_bird", "block-sparse")]
)
def test_unroutable_inline_attention_is_refused_by_name(kind, cause):
    import transformers

    from benchmarks.tiny_configs import tiny_config

    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind))
    with pytest.raises(UnsupportedModelError, match=cause):
        refuse_unroutable_layers(model)
