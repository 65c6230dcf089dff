"""Bidirectional encoders under SP (``SeqParMaskedLM``): masked-LM loss and gradients equal the plain model.

ModernBERT (RoPE, symmetric local windows on 2 of 3 layers) and BERT (learned absolute positions), 4 gloo
ranks, float32: without DeepSpeed (the sum of the SP ranks' gradients equals the plain gradient) over
layouts, U and padding; with ``ds_seqpar.initialize`` and ZeRO-3 for 5 SGD steps on packed documents.
"""

from __future__ import annotations

import pytest
import torch

from ds_seqpar import SeqParCausalLM, SeqParMaskedLM, shard_batch
from ds_seqpar.integrations.hf_model import UnsupportedModelError, objective_of
from ds_seqpar.tasks.masking import MaskedAnswers, MaskedLMDataset, mask_tokens
from tests.helpers.hf_ab import deepspeed_ab, sp_mesh, sp_vs_reference
from tests.helpers.hf_models import MASK_ID, VOCAB, masked_batches, tiny_encoder, tiny_model

PACKED = [21, 30, 13]  # three documents in a row of 64

CASES = [
    ("modernbert", 2, "zigzag", 64, None),  # U 2 x R 2
    ("modernbert", 1, "contiguous", 64, PACKED),  # ring of 4, documents
    ("modernbert", 4, "zigzag", 61, None),  # Ulysses 4; 3 tokens of end padding
    ("modernbert", 1, "stripe", 61, None),  # ring of 4; end padding seen by no real token
    ("bert", 2, "zigzag", 61, None),
    ("bert", 1, "zigzag", 64, PACKED),
]


@pytest.mark.parametrize(("kind", "u", "layout", "seq_len", "lengths"), CASES)
def test_masked_lm_forward_backward_equals_plain_model(dist_pool, kind, u, layout, seq_len, lengths):
    batch = masked_batches(1, 2, seq_len, seed=3, lengths=lengths)[0]
    for rep in dist_pool(4).run(sp_vs_reference, kind, u, layout, batch):
        assert rep["finite"], rep
        assert rep["loss_err"] <= 1e-5, rep
        assert rep["grad_rel_err"] <= 1e-5, rep


def test_padding_inside_rows_is_masked_out_of_the_attention(dist_pool):
    batch = masked_batches(1, 2, 64, seed=4)[0]
    batch["attention_mask"] = torch.ones(2, 64, dtype=torch.long)
    batch["attention_mask"][0, 40:] = 0  # row 0: 24 padding tokens, also seen by nobody
    for rep in dist_pool(4).run(sp_vs_reference, "modernbert", 2, "zigzag", batch):
        assert rep["loss_err"] <= 1e-5 and rep["grad_rel_err"] <= 1e-5, rep


@pytest.mark.parametrize(("kind", "sp", "u"), [("modernbert", 4, 2), ("bert", 4, 1), ("modernbert", 2, 2)])
def test_zero3_training_on_packed_documents_matches_plain_model(dist_pool, kind, sp, u):
    """ds_seqpar.initialize picks SeqParMaskedLM for a *ForMaskedLM; 5 ZeRO-3 SGD steps; dp = 4 / sp."""
    dp = 4 // sp
    data = masked_batches(5 * dp, 1, 64, seed=5, lengths=PACKED)
    for rep in dist_pool(4).run(deepspeed_ab, kind, sp, u, 3, 5, 64, 0.5, data=data):
        assert max(rep["loss_errs"]) <= 1e-5, rep
        assert rep["grad_err"] <= 1e-5, rep


def masked_shard_case() -> dict:
    mesh = sp_mesh(1, "contiguous")
    ids = torch.arange(10)[None] + 5
    labels = torch.full_like(ids, -100)
    labels[0, 3] = 8
    return shard_batch({"input_ids": ids, "labels": labels}, mesh, objective="masked")


def test_masked_shard_keeps_labels_in_place_and_hides_the_end_padding(dist_pool):
    shards = dist_pool(4).run(masked_shard_case)  # 10 tokens padded to 12, contiguous: 3 per rank
    labels = torch.cat([s["labels"] for s in shards], dim=1)
    assert labels[0, 3] == 8 and int((labels != -100).sum()) == 1  # not shifted
    assert "shift_labels" not in shards[0]
    assert shards[0]["doc_ids"].tolist() == [[0] * 10 + [-1, -1]]


def causal_wrapper_on_encoder_error() -> str:
    with pytest.raises(UnsupportedModelError) as err:
        SeqParCausalLM(tiny_encoder("bert"), sp_mesh(1))
    return str(err.value)


def roberta_error() -> str:
    import transformers

    cfg = transformers.RobertaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=80, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    lm = SeqParMaskedLM(transformers.RobertaForMaskedLM(cfg), sp_mesh(1))  # accepted: a position rule
    ids = torch.arange(5, 21)[None]
    packed = {
        "input_ids": ids,
        "labels": ids,
        "position_ids": torch.cat([torch.arange(6), torch.arange(10)])[None],
    }
    with pytest.raises(UnsupportedModelError) as err:
        lm(**shard_batch(packed, lm.mesh, objective="masked"))
    return str(err.value)


def test_an_encoder_in_the_causal_wrapper_and_roberta_packed_rows_are_refused_by_name(dist_pool):
    pool = dist_pool(4)
    message = pool.run(causal_wrapper_on_encoder_error)[0]
    assert "next-token" in message and "SeqParMaskedLM" in message, message
    message = pool.run(roberta_error)[0]  # RoBERTa's positions come from the ids: no numbering of packed rows
    assert "RobertaForMaskedLM" in message and "padding_idx" in message and "packed documents" in message, (
        message
    )


def test_objective_follows_the_model_class():
    assert objective_of(tiny_encoder("modernbert")) == "masked"
    assert objective_of(tiny_encoder("bert")) == "masked"
    assert objective_of(tiny_model("llama")) == "causal"


def test_mask_tokens_follows_the_80_10_10_rule_and_is_seeded():
    ids = torch.randint(5, VOCAB, (4, 4096), generator=torch.Generator().manual_seed(0))
    ids[:, :8] = 1  # special tokens are never chosen

    def draw(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return mask_tokens(ids, mask_token_id=MASK_ID, vocab_size=VOCAB, special_ids=[1], generator=g)

    corrupted, labels = draw(7)
    again = draw(7)
    assert torch.equal(corrupted, again[0]) and torch.equal(labels, again[1])
    chosen = labels != -100
    assert not chosen[:, :8].any()
    assert torch.equal(labels[chosen], ids[chosen])  # a label is the original id
    assert torch.equal(corrupted[~chosen], ids[~chosen])  # untouched elsewhere
    rate = chosen.float().mean().item()
    assert 0.14 < rate < 0.16, rate
    masked = (corrupted[chosen] == MASK_ID).float().mean().item()
    kept = (corrupted[chosen] == ids[chosen]).float().mean().item()
    assert 0.77 < masked < 0.83 and 0.08 < kept < 0.13, (masked, kept)  # kept includes random hits


def test_every_row_gets_a_target_and_the_dataset_masks_by_index():
    short = torch.tensor([[9, 10]])
    for seed in range(20):
        _, labels = mask_tokens(
            short, mask_token_id=MASK_ID, vocab_size=VOCAB, generator=torch.Generator().manual_seed(seed)
        )
        assert (labels != -100).sum() >= 1
    base = [{"input_ids": torch.arange(5, 69)} for _ in range(3)]
    data = MaskedLMDataset(base, mask_token_id=MASK_ID, vocab_size=VOCAB, seed=2)
    assert torch.equal(data[1]["labels"], data[1]["labels"]) and not torch.equal(
        data[0]["labels"], data[1]["labels"]
    )
    with pytest.raises(ValueError, match="probability"):
        mask_tokens(short, mask_token_id=MASK_ID, vocab_size=VOCAB, probability=0.0)


def test_masked_answers_hide_exactly_the_labelled_tokens():
    labels = torch.full((12,), -100)
    labels[[5, 9]] = 7
    sample = MaskedAnswers([{"input_ids": torch.arange(20, 32), "labels": labels}], mask_token_id=MASK_ID)[0]
    assert sample["input_ids"][[5, 9]].tolist() == [MASK_ID, MASK_ID]
    assert torch.equal(sample["input_ids"][labels == -100], torch.arange(20, 32)[labels == -100])
    assert torch.equal(sample["labels"], labels)
