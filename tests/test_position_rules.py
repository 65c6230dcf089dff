"""Position rules (ds_seqpar/integrations/positions.py): RoBERTa-style decoders number their tokens from the
token ids (padding_idx + 1 + non-padding tokens before; padding tokens padding_idx); under SP the rule runs
on the whole row, so every shard gets the plain model's position ids, padding inside the row included.
The probe names what it cannot honour (the first diverging module; attention computed inline)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.tiny_configs import build_tiny_model
from ds_seqpar import SeqParCausalLM, shard_batch
from ds_seqpar.integrations import positions
from ds_seqpar.integrations.hf_model import UnsupportedModelError, check_token_locality, decoder_of
from tests.helpers.hf_ab import deepspeed_ab, sp_mesh, sp_vs_reference
from tests.helpers.hf_models import batches, tiny_model

PAD = 1  # the tiny RoBERTa's pad token (= padding_idx)


def padded_batch(left: bool) -> dict:
    """Two rows of 64: random ids with pad tokens inside; row 1 padded by 9 pad tokens (left or right).
    The first real token after left padding has no label: HF's shifted loss would count its prediction
    from the last padding token, which ds_seqpar's padding queries never make (data.py)."""
    ids = batches(1, 2, 64, seed=3)[0]["input_ids"]
    ids[:, 5] = PAD  # a pad token the attention sees (as the sweep's random ids have)
    mask = torch.ones_like(ids)
    cut = slice(0, 9) if left else slice(55, 64)
    ids[1, cut], mask[1, cut] = PAD, 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 9 if left else 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_rule_is_the_models_own_position_ids():
    model = tiny_model("roberta")
    found = positions.position_rule_of(decoder_of(model))
    assert found is not None and found[0].name == "padding_offset"
    ids = padded_batch(left=True)["input_ids"]
    emb = model.roberta.embeddings
    assert torch.equal(found[1](ids), emb.create_position_ids_from_input_ids(ids, emb.padding_idx))
    assert int(found[1](ids)[1, 0]) == PAD and int(found[1](ids)[1, 9]) == PAD + 1
    assert positions.position_rule_of(decoder_of(tiny_model("llama"))) is None
    check_token_locality(model, decoder_of(model))  # the probe passes with the rule


def test_probe_names_the_first_diverging_module(monkeypatch):
    model = tiny_model("roberta")
    monkeypatch.setattr(positions, "POSITION_RULES", [])
    with pytest.raises(
        UnsupportedModelError, match=r"embeddings\.position_embeddings \(Embedding\) is the first"
    ):
        check_token_locality(model, decoder_of(model))
    gpt = build_tiny_model("openai-gpt")
    with pytest.raises(UnsupportedModelError, match="called transformers' attention interface"):
        check_token_locality(gpt, decoder_of(gpt))


def padded_and_packed_cases() -> list:
    """U 2 x R 2 and R 4 on right- and left-padded rows; a packed row is refused by name."""
    out = [
        sp_vs_reference("roberta", u, "zigzag", padded_batch(left))
        for u, left in ((2, False), (2, True), (1, True))
    ]
    lm = SeqParCausalLM(tiny_model("roberta"), sp_mesh(2))
    packed = {
        "input_ids": torch.arange(3, 67)[None],
        "position_ids": torch.cat([torch.arange(30), torch.arange(34)])[None],
    }
    try:
        lm(**shard_batch(packed, lm.mesh))
        out.append("no error")
    except UnsupportedModelError as exc:
        out.append(str(exc))
    return out


def test_padded_rows_are_exact_and_packed_rows_refused(dist_pool):
    for rank_out in dist_pool(4).run(padded_and_packed_cases):
        *reps, packed = rank_out
        for rep in reps:
            assert rep["loss_err"] <= 1e-5 and rep["grad_rel_err"] <= 1e-5, rep
        assert "packed documents" in packed, packed


@pytest.mark.parametrize(("sp", "u"), [(4, 2), (4, 1)])
def test_roberta_decoder_under_zero3_matches_non_sp(dist_pool, sp, u):
    """RobertaForCausalLM (is_decoder) under ZeRO-3, U 2 x R 2 and R 4: 3 SGD steps equal the plain model."""
    for rep in dist_pool(4).run(deepspeed_ab, "roberta", sp, u, 3, 3, 64, 0.5):
        assert max(rep["loss_errs"]) <= 1e-5, rep
        assert rep["grad_err"] <= 1e-5, rep
