"""The memory model (``ds_seqpar.memory_estimate``) against live-tensor traces of real steps, and its rules."""

from __future__ import annotations

import pytest
import torch

from ds_seqpar import (
    SeqParConfigError,
    decode_cache_bytes,
    largest_seq_len,
    memory_estimate,
    prefill_memory_estimate,
)
from ds_seqpar.memory.trace import LiveBytes

SAVINGS = {"activation_checkpointing": True, "offload": True, "tiled_mlp": True, "tiled_norms": True}
LLAMA = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 133,
}  # fmt: skip
BIG = {**LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
       "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}  # fmt: skip


def test_categories_and_what_each_saving_changes():
    plain = memory_estimate(BIG, 1 << 17, {"size": 8, "ulysses_degree": 8})
    ckpt = memory_estimate(
        BIG, 1 << 17, {"size": 8, "ulysses_degree": 8, "memory": {"activation_checkpointing": True}}
    )
    off = memory_estimate(BIG, 1 << 17, {"size": 8, "ulysses_degree": 8, "memory": SAVINGS})
    assert plain.device_peak == sum(plain.device.values()) and plain.host_bytes == 0
    assert ckpt.activation_peak < plain.activation_peak / 8  # 32 layers kept -> their inputs and one layer
    h = (1 << 17) // 8 * 4096 * 4
    assert ckpt.device["checkpoints (layer inputs)"] == 32 * h
    assert off.device["checkpoints (layer inputs)"] == h and off.host["checkpoints (layer inputs)"] == 31 * h
    assert off.device_peak < ckpt.device_peak
    assert {"parameters (ZeRO shard)", "optimizer states", "gradients"} <= off.resting
    assert off.step_bytes() == off.device_peak - sum(off.device[k] for k in off.resting)
    assert "device peak per rank" in off.table()


def test_activations_scale_with_one_over_p():
    """Activations per rank shrink ~1/P (ring buffers add a little at R > 1); parameters shard over ZeRO."""
    one = memory_estimate(BIG, 1 << 18, {"size": 1, "memory": SAVINGS})
    four = memory_estimate(BIG, 1 << 18, {"size": 4, "ulysses_degree": 4, "memory": SAVINGS})
    assert 3.3 <= one.activation_peak / four.activation_peak <= 4.0  # the MLP tile does not shrink
    assert one.device["parameters (ZeRO shard)"] == 4 * four.device["parameters (ZeRO shard)"]


def test_largest_seq_len_is_the_boundary_of_the_budget():
    cfg = {"size": 4, "ulysses_degree": 2, "memory": SAVINGS}
    budget = 48 * 2**20
    s = largest_seq_len(LLAMA, cfg, budget, multiple=512, zero_stage=0)
    assert s > 0 and s % 512 == 0
    assert memory_estimate(LLAMA, s, cfg, zero_stage=0).device_peak <= budget
    assert memory_estimate(LLAMA, s + 512, cfg, zero_stage=0).device_peak > budget
    assert largest_seq_len(LLAMA, cfg, 1, multiple=512) == 0


def test_bad_section_is_refused_by_name():
    with pytest.raises(SeqParConfigError, match=r"memory\.checkpointing"):
        memory_estimate(LLAMA, 4096, {"size": 1, "memory": {"checkpointing": True}})
    with pytest.raises(SeqParConfigError, match=r"ulysses_degree=3 does not divide size=4"):
        memory_estimate(LLAMA, 4096, {"size": 4, "ulysses_degree": 3})
    no_mlp = {k: v for k, v in LLAMA.items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match=r"the model config has no intermediate_size"):
        memory_estimate(no_mlp, 4096, {"size": 1})
    with pytest.raises(ValueError, match=r"zero_stage=4 must be 0-3"):
        memory_estimate(LLAMA, 4096, {"size": 1}, zero_stage=4)


# ------------------------------------------------------------------------------ against traced steps


def traced_step_vs_model(seq_lens: list[int], memory: dict) -> list[tuple[int, float, float]]:
    """(S, traced peak MiB, predicted MiB) of one training step of the tiny Llama per S on this group."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_seqpar import SeqParCausalLM, SeqParMesh, shard_batch
    from ds_seqpar.settings import auto_ulysses_degree

    world = dist.get_world_size()
    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained("assets/tiny-llama")
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    u = auto_ulysses_degree(world, cfg.num_attention_heads, cfg.num_key_value_heads)
    mesh = SeqParMesh.from_config({"size": world, "ulysses_degree": u, "memory": memory})
    sp = SeqParCausalLM(model, mesh).train()
    opt = torch.optim.AdamW(sp.parameters(), lr=1e-4)
    rows = []
    for seq_len in seq_lens:
        ids = torch.randint(4, cfg.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))
        for traced in (False, True):  # the first step creates the optimizer states
            mode = LiveBytes()
            with mode if traced else torch.enable_grad():
                loss = sp(**shard_batch({"input_ids": ids}, mesh))
                loss.backward()
                for p in sp.parameters():
                    if p.grad is not None and world > 1:
                        dist.all_reduce(p.grad)
                opt.step()
                opt.zero_grad(set_to_none=True)
        est = memory_estimate(cfg, seq_len, mesh.settings, zero_stage=0)
        rows.append((seq_len, mode.peak / 2**20, est.step_bytes() / 2**20))
    return rows


@pytest.mark.parametrize(
    ("world", "seq_lens"),
    [
        (1, [2048, 4096, 8192]),
        pytest.param(4, [4096, 8192, 16384], marks=pytest.mark.slow),
    ],  # 4 ranks: slow suite
)
def test_model_predicts_the_traced_peak_within_15_percent(dist_pool, world, seq_lens):
    """P = 1 and P = 4 (U 2 x R 2: ring buffers, the output in two layouts), all savings and none."""
    for memory in ({}, SAVINGS):
        for rank_rows in dist_pool(world).run(traced_step_vs_model, seq_lens, memory):
            for seq_len, traced, predicted in rank_rows:
                assert abs(predicted - traced) <= 0.15 * traced, (memory, seq_len, traced, predicted)


def test_docs_memory_snippets_run_as_written(capsys):
    """Every ```python block of docs/memory.md runs as written (from the repository root)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "memory.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 3
    for block in blocks:
        exec(compile(block, "docs/memory.md", "exec"), {})
    out = capsys.readouterr().out
    assert "device peak per rank" in out and "peak" in out and "backward:" in out


# ------------------------------------------------------------------------------ inference (prefill, decoding)


def test_prefill_estimate_counts_the_cache_and_refuses_by_name():
    """The cache is L · n_r · (2 · B · H_kv · D · b + 8); padding is dropped; reserve adds slots; decoding adds
    ceil(T / P) tokens' K/V on the busiest rank; weights are the only resting category."""
    section = {"size": 4, "ulysses_degree": 2}
    est = prefill_memory_estimate(BIG, 1 << 17, section, bytes_per_element=2, reserve=100)
    slot = 2 * 8 * 128 * 2 + 8  # K and V of one token (8 K/V heads of 128, bf16) and its index
    assert est.device["KV cache (prefill: this rank's tokens)"] == 32 * (1 << 15) * slot
    assert est.device["KV cache (reserved slots for decoded tokens)"] == 32 * 100 * slot
    assert est.resting == {"weights"} and est.step_bytes() == est.device_peak - est.device["weights"]
    assert est.phase in ("RoPE", "attention", "MLP", "logits")
    padded = prefill_memory_estimate(LLAMA, 1000, section)  # zigzag over R = 2: S padded to 1024
    assert padded.device["KV cache (prefill: this rank's tokens)"] == 2 * 250 * (2 * 2 * 16 * 4 + 8)
    assert decode_cache_bytes(BIG, 9, 4, bytes_per_element=2) == 3 * 2 * 32 * 8 * 128 * 2
    hybrid = {**LLAMA, "layer_types": ["linear_attention", "full_attention"]}
    with pytest.raises(ValueError, match=r"1 recurrent layers \(linear_attention\).*pass state_bytes="):
        prefill_memory_estimate(hybrid, 4096, {"size": 1})
    both = prefill_memory_estimate(hybrid, 4096, {"size": 1}, state_bytes=1000)
    assert both.device["recurrent states (replicated)"] == 1000
    assert both.device["KV cache (prefill: this rank's tokens)"] == 4096 * (2 * 2 * 16 * 4 + 8)  # 1 layer
    with pytest.raises(ValueError, match=r"reserve=-1 must be an integer >= 0"):
        prefill_memory_estimate(LLAMA, 4096, {"size": 1}, reserve=-1)
    with pytest.raises(ValueError, match=r"bytes_per_element=3 must be 2"):
        prefill_memory_estimate(LLAMA, 4096, {"size": 1}, bytes_per_element=3)
    with pytest.raises(ValueError, match=r"decode_cache_bytes: sp_size=0 must be an integer >= 1"):
        decode_cache_bytes(LLAMA, 8, 0)


def traced_prefill_vs_model(seq_lens: list[int]) -> list[tuple[int, float, float, float, int, int]]:
    """Per S: (S, single-process HF prefill peak, this rank's ds_seqpar.prefill peak, predicted; MiB), then the
    K/V bytes 7 decoded tokens added on this rank and ``decode_cache_bytes`` for the busiest rank."""
    import torch.distributed as dist

    import ds_seqpar
    from benchmarks.prefill_memory import tiny_llama, traced
    from ds_seqpar import SeqParCausalLM, SeqParMesh
    from ds_seqpar.settings import auto_ulysses_degree

    world = dist.get_world_size()
    plain = tiny_llama()
    cfg = plain.config
    u = auto_ulysses_degree(world, cfg.num_attention_heads, cfg.num_key_value_heads)
    sp = SeqParCausalLM(tiny_llama(), SeqParMesh.from_config({"size": world, "ulysses_degree": u}))
    rows = []
    for s in seq_lens:
        ids = torch.randint(4, cfg.vocab_size, (1, s), generator=torch.Generator().manual_seed(s))
        single = traced(lambda ids=ids: plain(input_ids=ids, use_cache=True, logits_to_keep=1))
        mine = traced(lambda ids=ids: ds_seqpar.prefill(sp, ids))
        est = prefill_memory_estimate(cfg, s, sp.mesh.settings)
        prompt = ds_seqpar.prefill(sp, ids).cache.bytes()
        out = ds_seqpar.generate(sp, ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        rows.append((s, single / 2**20, mine / 2**20, est.step_bytes() / 2**20,
                     out.cache.bytes() - prompt, decode_cache_bytes(cfg, 7, world)))  # fmt: skip
    return rows


@pytest.mark.parametrize(
    ("world", "seq_lens"),
    [(2, [4096, 8192]), pytest.param(4, [8192, 16384], marks=pytest.mark.slow)],
)
def test_prefill_peak_is_predicted_and_within_the_bound(dist_pool, world, seq_lens):
    """Each rank's prefill peak is within 15 % of the model and <= 1.1 x (single-process prefill / P) (the
    weights, alike on both sides, excluded); decoding's K/V on the busiest rank is exactly the model's."""
    results = dist_pool(world).run(traced_prefill_vs_model, seq_lens)
    for rank_rows in results:
        for s, single, mine, predicted, _, _ in rank_rows:
            assert abs(predicted - mine) <= 0.15 * mine, (world, s, mine, predicted)
            assert mine <= 1.1 * single / world, (world, s, mine, single)
    for i in range(len(seq_lens)):
        assert max(rows[i][4] for rows in results) == results[0][i][5]
