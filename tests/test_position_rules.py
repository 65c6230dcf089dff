"""Position rules (ds_seqpar/integrations/positions.py): RoBERTa-style decoders number their tokens from the
token ids (padding_idx + 1 + non-padding tokens before; padding tokens padding_idx); under SP the rule runs
on the whole row, so every shard gets the plain model's position ids, padding inside the row included.
The probe names what it cannot honour (the first diverging module; attention computed inline)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from benchmarks.tiny_configs import build_tiny_model
from ds_seqpar import SeqParCausalLM, SeqParMaskedLM, shard_batch
from ds_seqpar.integrations import positions
from ds_seqpar.integrations.hf_model import UnsupportedModelError, check_token_locality, decoder_of
from tests.helpers.hf_ab import deepspeed_ab, rel_err, sp_mesh, sp_vs_reference
from tests.helpers.hf_models import batches, masked_batches, reference_loss, tiny_model

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


def masked_roberta_case() -> dict:
    """RobertaForMaskedLM (bidirectional) under SeqParMaskedLM, U 2 x R 2, 61 tokens (3 of end padding)."""
    import transformers

    cfg = transformers.RobertaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512, pad_token_id=PAD, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.RobertaForMaskedLM(cfg).float()
    ref.set_attn_implementation("sdpa")
    model, batch = copy.deepcopy(ref), masked_batches(1, 2, 61, seed=5)[0]
    ref_loss = reference_loss(ref, batch)
    ref_loss.backward()
    mesh = sp_mesh(2)
    loss = SeqParMaskedLM(model, mesh)(**shard_batch(batch, mesh, objective="masked"))
    loss.backward()
    worst = 0.0
    for p, p_ref in zip(model.parameters(), ref.parameters(), strict=True):
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad, group=mesh.group("sp"))
        worst = max(worst, 0.0 if p_ref.grad is None else rel_err(grad, p_ref.grad, 1e-4))
    return {"loss_err": abs(loss.item() - ref_loss.item()) / ref_loss.item(), "grad_rel_err": worst}


def padded_and_packed_cases() -> list:
    """U 2 x R 2 and R 4 on right- and left-padded rows, the masked-LM encoder; a packed row is refused by name."""
    out = [
        sp_vs_reference("roberta", u, "zigzag", padded_batch(left))
        for u, left in ((2, False), (2, True), (1, True))
    ]
    out.append(masked_roberta_case())
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
