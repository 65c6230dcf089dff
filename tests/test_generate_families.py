"""HF causal-LM families under ``ds_seqpar.generate`` vs HF's own ``model.generate``: exact, or refused by name.

Default suite: the family refusals of ``integrations/decode_rules.py`` raise by name in one process (no
collective), and a layer's repeated attention calls in one forward get cache entries of their own. Slow suite:
``benchmarks/generate_sweep.py`` on 4 gloo ranks over representative types (every mechanism the generic path
decodes, and each kind of refusal), and over every type the training sweep finds exact.
"""

from __future__ import annotations

import copy

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
    "qwen3_next": "exact",  # gated DeltaNet hybrid: recurrent state decoded (RECURRENT_DECODERS)
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


def dory_case(mode: str) -> dict | str:
    """Dory with 1 input, 1 recurrent (run twice) and 1 output layer (the tiny sweep's config does not generate
    in HF): every loop keeps its own cache entries (``per_loop``); ``last_loop`` is refused by name."""
    import transformers

    import ds_seqpar
    from benchmarks import generate_sweep as sweep
    from benchmarks.tiny_configs import _model_config, tiny_config

    cfg = _model_config(tiny_config("dory"), transformers.DoryForCausalLM)
    cfg.num_hidden_layers, cfg.n_input_layers, cfg.n_recurrent_layers, cfg.n_output_layers = 3, 1, 1, 1
    cfg.layer_types = ["full_attention"] * 3
    cfg.recurrent_kv_cache_mode = mode
    torch.manual_seed(0)
    ref = transformers.DoryForCausalLM(cfg).float().eval()
    ref.set_attn_implementation("sdpa")
    model = copy.deepcopy(ref)
    ids = sweep._prompt(ref)
    seqs, logits = sweep._hf_generate(ref, ids)
    try:
        out = ds_seqpar.generate(
            model, ids, mesh=sweep._mesh(), max_new_tokens=sweep.NEW_TOKENS, pad_token_id=0
        )
    except UnsupportedModelError as exc:
        return str(exc)
    return sweep._compare(out, seqs, logits)


@pytest.mark.slow
def test_dory_loops_decode_from_one_cache_entry_per_loop(dist_pool):
    for res in dist_pool(4).run(dory_case, "per_loop"):
        assert res["status"] == "exact", res
    for res in dist_pool(4).run(dory_case, "last_loop"):
        assert "DoryAttention" in res and "last_loop" in res, res
