"""HF causal-LM families under ``ds_seqpar.generate`` vs HF's own ``model.generate``: exact, or refused by name.

Default suite: the family refusals of ``integrations/decode_rules.py`` raise by name in one process (no
collective), and a layer's repeated attention calls in one forward get cache entries of their own. Slow suite:
``benchmarks/generate_sweep.py`` on 4 gloo ranks over representative types (every mechanism the generic path
decodes, and each kind of refusal), and over every type the training sweep finds exact.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.generate_sweep import exact_training_types, generate_many
from benchmarks.tiny_configs import build_tiny_model
from ds_seqpar import UnsupportedModelError
from ds_seqpar.integrations.context import SeqParContext
from ds_seqpar.integrations.decode_rules import UNDECODABLE_LAYERS, refuse_undecodable_family


def test_moshi_refused_by_name_before_any_collective():
    with pytest.raises(UnsupportedModelError) as info:
        refuse_undecodable_family(build_tiny_model("moshi"))
    message = str(info.value)
    assert "MoshiForCausalLM" in message and "MoshiAttention" in message, message
    assert "sliding_window" in message and "generate with the plain model" in message, message
    refuse_undecodable_family(build_tiny_model("llama"))  # a family without an entry passes
    assert set(UNDECODABLE_LAYERS) == {"MoshiAttention", "DoryAttention"}


def test_dory_refused_only_when_its_loops_share_the_last_loop_cache():
    model = build_tiny_model("dory")
    refuse_undecodable_family(model)  # per_loop (the default): one cache entry per loop, decoded exactly
    model.config.recurrent_kv_cache_mode = "last_loop"
    with pytest.raises(UnsupportedModelError, match=r"DoryAttention.*last_loop.*per_loop"):
        refuse_undecodable_family(model)


def test_repeated_attention_calls_get_cache_entries_of_their_own():
    layer0, layer1 = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    ctx = SeqParContext(mesh=None, layer_of={id(layer0): 0, id(layer1): 1})
    # differential attention: two calls per layer; HRM: the stack once per cycle
    slots = [ctx.cache_slot(m) for m in (layer0, layer0, layer1, layer1, layer0)]
    assert slots == [0, (0, 1), 1, (1, 1), (0, 2)]
    assert (
        SeqParContext(mesh=None, layer_of={id(layer0): 0}).cache_slot(layer0) == 0
    )  # a new forward restarts


EXPECTED = {
    "llama": "exact",
    "mistral": "exact",  # sliding window 8 < prompt
    "gemma2": "exact",  # soft-caps, alternating windows
    "gemma3n_text": "exact",  # AltUp, KV shared across layers
    "gpt_oss": "exact",  # sinks, MoE
    "gpt2": "exact",  # learned absolute positions
    "opt": "exact",  # positions offset by 2, decoder nested one level down
    "deepseek_v3": "exact",  # MLA
    "diffllama": "exact",  # two attention calls per layer: one cache entry per call
    "hrm_text": "exact",  # the layer stack run once per reasoning cycle: one cache entry per call
    "moshi": "refused",  # HF's cache keeps a sliding window its forward does not apply
    "roberta": "refused",  # positions derived from the token ids
    "bloom": "refused",  # ALiBi computed in the layer
    "mamba": "refused",  # a recurrent layer without a decoder
}


@pytest.mark.slow
def test_generate_sweep_representative_types(dist_pool):
    rows = dist_pool(4).run(generate_many, list(EXPECTED), timeout=900)[0]
    got = {r["type"]: r["status"] for r in rows}
    assert got == EXPECTED, [
        (r["type"], r["status"], r["detail"]) for r in rows if r["status"] != EXPECTED[r["type"]]
    ]


@pytest.mark.slow
def test_generate_sweep_every_exact_training_type(dist_pool):
    rows = dist_pool(4).run(generate_many, exact_training_types(), timeout=3600)[0]
    bad = [r for r in rows if r["status"] in ("mismatch", "error")]
    assert not bad, bad
    assert sum(r["status"] == "exact" for r in rows) >= 110, [(r["type"], r["status"]) for r in rows]
