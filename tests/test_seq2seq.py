"""An encoder-decoder (Whisper) under SP: the decoder's cross-attention over sharded encoder states.

4 gloo ranks (a ring of 4), float32, tiny Whisper (2 + 2 layers, 64 encoder frames, long side = the
encoder states): ``SeqParSeq2SeqLM`` gives the plain model's loss and every gradient (encoder included)
for both cross-attention schedules, with and without the shared-K/V recompute; 5 ZeRO-3 steps through
``ds_seqpar.initialize`` match; the recompute keeps fewer bytes for backward than per-layer K/V copies.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import ds_seqpar
from ds_seqpar import SeqParSeq2SeqLM, shard_batch, shard_encoder_states
from ds_seqpar.integrations.hf_model import UnsupportedModelError
from ds_seqpar.memory.trace import LiveBytes
from tests.helpers.hf_ab import deepspeed_ab, rel_err, sp_mesh
from tests.helpers.hf_models import VOCAB, speech_batches, tiny_model, tiny_whisper


def _grad_errors(model: torch.nn.Module, ref: torch.nn.Module, group) -> float:
    worst = 0.0
    for p, p_ref in zip(model.parameters(), ref.parameters()):
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad, group=group)  # SP ranks hold partial gradients of one sample group
        if p_ref.grad is None:  # frozen (Whisper's sinusoidal encoder positions): untouched on both sides
            worst = max(worst, grad.abs().max().item())
            continue
        worst = max(worst, rel_err(grad, p_ref.grad, 1e-4))
    return worst


def whisper_vs_plain(
    schedule: str, recompute: bool, layout: str, tokens: int, frames: int, u: int = 1
) -> dict:
    """One forward/backward of a batch of 2 from ``input_features`` (the encoder runs on every rank)."""
    mesh = sp_mesh(u, layout)
    ref = tiny_whisper(frames=frames)
    model = copy.deepcopy(ref)
    batch = speech_batches(1, 2, tokens, frames, seed=3)[0]
    ids = batch["input_ids"]
    logits = ref(input_features=batch["input_features"], decoder_input_ids=ids).logits
    ref_loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    ref_loss.backward()
    sp = SeqParSeq2SeqLM(model, mesh, cross_schedule=schedule, recompute_cross_kv=recompute)
    shard = shard_batch({"input_ids": ids}, mesh)
    evaluated = sp.evaluate(**shard, input_features=batch["input_features"])  # the same encoder inputs
    loss = sp(**shard, input_features=batch["input_features"])
    loss.backward()
    return {
        "loss_err": abs(loss.item() - ref_loss.item()) / ref_loss.item(),
        "eval_err": abs(evaluated["loss"].item() - ref_loss.item()) / ref_loss.item(),
        "eval_count": evaluated["count"].item(),
        "grad_err": _grad_errors(model, ref, mesh.group("sp")),
    }


CASES = [
    # (schedule, recompute, layout, decoder tokens, encoder frames, U): ring of 4 / 4 // U
    ("rotate_q", True, "zigzag", 24, 64, 1),  # S_q < S_kv: what auto picks
    ("rotate_q", False, "zigzag", 24, 64, 1),
    ("rotate_kv", True, "contiguous", 24, 64, 1),
    ("rotate_kv", False, "zigzag", 64, 64, 1),
    ("auto", True, "zigzag", 37, 62, 1),  # 62 frames: 2 padding positions masked out of the last shard
    ("rotate_q", True, "zigzag", 24, 62, 2),  # U 2 x R 2: Ulysses over heads, then the ring
    ("rotate_kv", False, "stripe", 32, 64, 4),  # U 4: Ulysses only
]


@pytest.mark.parametrize(("schedule", "recompute", "layout", "tokens", "frames", "u"), CASES)
def test_whisper_decoder_under_sp_equals_the_plain_model(
    dist_pool, schedule, recompute, layout, tokens, frames, u
):
    for rep in dist_pool(4).run(whisper_vs_plain, schedule, recompute, layout, tokens, frames, u):
        assert rep["loss_err"] <= 1e-5 and rep["eval_err"] <= 1e-5, rep
        assert rep["eval_count"] == 2 * (tokens - 1), rep
        assert rep["grad_err"] <= 1e-5, rep


def sharded_states_with_padding() -> dict:
    """``encoder_hidden_states`` given as shards with a key mask: the last 10 of 64 states are padding,
    which must equal the plain model run on the first 54 states only (batch of 1)."""
    mesh = sp_mesh(1, "zigzag")
    ref = tiny_whisper()
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, VOCAB, (1, 20), generator=g)
    states = torch.randn(1, 64, 64, generator=g, requires_grad=True)
    logits = ref(encoder_outputs=(states[:, :54],), decoder_input_ids=ids).logits
    ref_loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    ref_loss.backward()
    mask = torch.ones(1, 64, dtype=torch.long)
    mask[:, 54:] = 0
    leaf = states.detach().clone().requires_grad_()
    shard, shard_mask = shard_encoder_states(leaf, mesh, mask)
    sp = SeqParSeq2SeqLM(model, mesh)
    loss = sp(
        **shard_batch({"input_ids": ids}, mesh),
        encoder_hidden_states=shard,
        encoder_attention_mask=shard_mask,
    )
    loss.backward()
    grad, ref_states_grad = leaf.grad, states.grad
    dist.all_reduce(grad)
    return {
        "loss_err": abs(loss.item() - ref_loss.item()) / ref_loss.item(),
        "grad_err": _grad_errors(model, ref, mesh.group("sp")),
        "states_grad_err": rel_err(grad, ref_states_grad),
        "padding_grad": grad[:, 54:].abs().max().item(),
    }


def test_sharded_encoder_states_with_a_key_mask_equal_the_unpadded_model(dist_pool):
    for rep in dist_pool(4).run(sharded_states_with_padding):
        assert rep["loss_err"] <= 1e-5 and rep["grad_err"] <= 1e-5, rep
        assert rep["states_grad_err"] <= 1e-5 and rep["padding_grad"] == 0.0, rep


def test_zero3_training_matches_the_plain_model(dist_pool):
    """ds_seqpar.initialize wraps an encoder-decoder in SeqParSeq2SeqLM; 5 ZeRO-3 SGD steps, sp 4 = U 2 x R 2."""
    data = speech_batches(5, 1, 24, seed=5)
    for rep in dist_pool(4).run(deepspeed_ab, "whisper", 4, 2, 3, 5, 24, 0.5, data=data):
        assert max(rep["loss_errs"]) <= 1e-5, rep
        assert rep["grad_err"] <= 1e-5, rep


def kept_bytes(recompute: bool, layers: int) -> dict:
    """Bytes alive after the forward (what autograd keeps for backward) with and without the recompute."""
    mesh = sp_mesh(1, "zigzag")
    model = tiny_whisper()
    model.config.decoder_layers = layers
    model = type(model)(model.config).float()
    sp = SeqParSeq2SeqLM(model, mesh, recompute_cross_kv=recompute)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(3, VOCAB, (1, 16), generator=g)
    frames = 4096  # the long side: 1024 states per rank
    states = torch.randn(1, frames, 64, generator=g)
    shard, _ = shard_encoder_states(states, mesh)
    shard.requires_grad_()
    batch = shard_batch({"input_ids": ids}, mesh)
    with LiveBytes() as live:
        loss = sp(**batch, encoder_hidden_states=shard)
        kept = live.current
    loss.backward()
    return {"kept": kept, "kv_bytes_per_layer": 2 * shard.numel() * shard.element_size()}


def test_recomputing_cross_kv_keeps_no_per_layer_copies(dist_pool):
    """Without the recompute every layer keeps its K and V of the encoder shard (2·m·E floats per layer, and
    more); with it the kept bytes do not grow by a K/V pair per cross-attention layer."""
    pool = dist_pool(4)
    kept = {(r, n): pool.run(kept_bytes, r, n)[0] for r in (False, True) for n in (2, 4)}
    kv = kept[(False, 2)]["kv_bytes_per_layer"]
    per_layer_plain = (kept[(False, 4)]["kept"] - kept[(False, 2)]["kept"]) / 2
    per_layer_recompute = (kept[(True, 4)]["kept"] - kept[(True, 2)]["kept"]) / 2
    assert per_layer_plain >= kv, kept  # each layer's own K/V copies
    assert per_layer_recompute < 0.1 * kv, kept  # the shard is kept once, not per layer


def bad_inputs() -> list[str]:
    mesh = sp_mesh(1)
    sp = SeqParSeq2SeqLM(tiny_whisper(), mesh)
    batch = shard_batch({"input_ids": torch.randint(3, VOCAB, (1, 8))}, mesh)
    errors = []
    for extra in (
        {},
        {"input_features": torch.zeros(1, 8, 128), "encoder_hidden_states": torch.zeros(1, 16, 64)},
    ):
        with pytest.raises(ValueError) as err:
            sp(**batch, **extra)
        errors.append(str(err.value))
    with pytest.raises(UnsupportedModelError) as err:
        SeqParSeq2SeqLM(tiny_model("llama"), mesh)
    errors.append(str(err.value))
    with pytest.raises(ValueError) as err:
        SeqParSeq2SeqLM(tiny_whisper(), mesh, cross_schedule="ring")
    errors.append(str(err.value))
    return errors


def test_bad_inputs_are_refused_by_name(dist_pool):
    neither, both, decoder_only, schedule = dist_pool(4).run(bad_inputs)[0]
    assert "exactly one of input_features" in neither and "exactly one of input_features" in both
    assert "LlamaForCausalLM is not an encoder-decoder" in decoder_only
    assert "cross_schedule='ring'; valid: auto, rotate_q, rotate_kv" in schedule


def test_the_module_is_exported():
    assert ds_seqpar.SeqParSeq2SeqLM is SeqParSeq2SeqLM
