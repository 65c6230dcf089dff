"""Per-rank peak memory of the sharded prefill (``ds_seqpar.prefill``) vs a single-process prefill, the memory
model's prediction (``ds_seqpar.prefill_memory_estimate``) and the bound 1.1 x (single / P) + weights.

Run with PyTorch's launcher (one process per rank)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.prefill_memory [--quick]

The tiny Llama of ``assets/tiny-llama`` (random init, fp32, sdpa; the model the memory model's counts were read
off), one prompt of S tokens. Per S, the peak of the bytes created inside each call (``LiveBytes``: the
weights exist before the call and are excluded; they are added back in the ``+ weights`` columns):

* ``single``: the plain HF model on one process, ``model(input_ids, use_cache=True, logits_to_keep=1)``
  (its ``DynamicCache`` holds every layer's K/V; logits of the last position only), run on rank 0;
* ``ds_seqpar P``: ``ds_seqpar.prefill`` on the first SP group of a mesh of size P = 1, 2, 4 (the world is
  dp x P; the other groups wait), the largest rank's peak;
* ``predicted``: ``prefill_memory_estimate(...).step_bytes()`` for that mesh.

Then one decoding run (``ds_seqpar.generate``, greedy, T new tokens) at the largest P: the K/V entries the
decoded tokens added on each rank (``cache.bytes()`` after minus the prompt's) against ``decode_cache_bytes``.

Prints markdown on rank 0 and saves ``benchmarks/results/prefill_memory_cpu.{json,md}``; asserts the issue's
bound (ds_seqpar P <= 1.1 x single / P) and the prediction within 15 % (the memory model tests' tolerance).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import ds_seqpar
from benchmarks.common import gather_floats, save_results
from ds_seqpar import SeqParCausalLM, SeqParMesh, decode_cache_bytes, prefill_memory_estimate
from ds_seqpar.memory.trace import LiveBytes
from ds_seqpar.settings import auto_ulysses_degree

MIB = 2**20
BOUND, TOLERANCE, NEW_TOKENS = 1.1, 0.15, 17


def tiny_llama() -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained("assets/tiny-llama")
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()


def traced(call: object) -> int:
    """Peak bytes created inside ``call()`` on this process (no gradients)."""
    with torch.no_grad(), LiveBytes() as live:
        out = call()  # type: ignore[operator]
        del out
    return live.peak


def single_peak(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """Rank 0's single-process HF prefill peak (MiB), on every rank."""
    peak = (
        traced(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1)) if dist.get_rank() == 0 else 0
    )
    return gather_floats(peak)[0] / MIB


def sp_row(wrapper: SeqParCausalLM, ids: torch.Tensor, single: float) -> dict:
    """One (S, P) row: the prefill's peak on the first SP group's ranks against the model and the bound."""
    mesh, p = wrapper.mesh, wrapper.mesh.sp_size
    mine = dist.get_rank() < p  # the first SP group (ranks 0 .. P-1)
    peak = traced(lambda: ds_seqpar.prefill(wrapper, ids)) if mine else 0
    measured = max(gather_floats(peak)[:p]) / MIB
    est = prefill_memory_estimate(wrapper.config, ids.shape[1], mesh.settings)
    predicted, weights = est.step_bytes() / MIB, est.device["weights"] / MIB
    actual_weights = sum(t.numel() * t.element_size() for t in wrapper.parameters()) / MIB
    assert abs(actual_weights - weights) < 1e-9, (actual_weights, weights)
    return {
        "seq_len": ids.shape[1], "P": p, "mesh": f"U{mesh.ulysses_size} x R{mesh.ring_size}",
        "single_MiB": single, "measured_MiB": measured, "predicted_MiB": predicted,
        "error": (predicted - measured) / measured, "phase": est.phase, "bound_MiB": BOUND * single / p,
        "ratio_to_single_over_p": measured / (single / p), "weights_MiB": weights,
        "measured_plus_weights_MiB": measured + weights, "bound_plus_weights_MiB": BOUND * single / p + weights,
        "bound_ok": measured <= BOUND * single / p,
    }  # fmt: skip


def decode_row(wrapper: SeqParCausalLM, ids: torch.Tensor) -> dict:
    """Greedy generation of NEW_TOKENS tokens: the K/V entries decoding added per rank vs ``decode_cache_bytes``
    (the last chosen token is not decoded, so NEW_TOKENS - 1 tokens enter the cache)."""
    mesh = wrapper.mesh
    mine = dist.get_rank() < mesh.sp_size
    added = 0
    if mine:
        prompt = ds_seqpar.prefill(wrapper, ids).cache.bytes()
        out = ds_seqpar.generate(wrapper, ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        added = out.cache.bytes() - prompt
    per_rank = [int(x) for x in gather_floats(added)[: mesh.sp_size]]
    predicted = decode_cache_bytes(wrapper.config, NEW_TOKENS - 1, mesh.sp_size)
    return {"seq_len": ids.shape[1], "P": mesh.sp_size, "decoded_tokens": NEW_TOKENS - 1,
            "added_bytes_per_rank": per_rank, "predicted_busiest_bytes": predicted,
            "exact": max(per_rank) == predicted}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="S = 8192 only")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    plain = tiny_llama()
    cfg = plain.config
    wrappers = {}
    for p in (q for q in (1, 2, 4) if world % q == 0):
        u = auto_ulysses_degree(p, cfg.num_attention_heads, cfg.num_key_value_heads)
        wrappers[p] = SeqParCausalLM(tiny_llama(), SeqParMesh.from_config({"size": p, "ulysses_degree": u}))
    lengths = (8192,) if args.quick else (8192, 16384, 32768)
    start, rows = time.perf_counter(), []
    for s in lengths:
        ids = torch.randint(4, cfg.vocab_size, (1, s), generator=torch.Generator().manual_seed(s))
        single = single_peak(plain, ids)
        rows += [sp_row(w, ids, single) for w in wrappers.values()]
    decode = decode_row(wrappers[max(wrappers)], torch.randint(4, cfg.vocab_size, (1, 4096)))
    seconds = time.perf_counter() - start
    if dist.get_rank() == 0:
        table = save_results(
            "prefill_memory_cpu",
            f"Prefill peak per rank (MiB created inside the call, weights excluded; the largest rank of the first SP "
            f"group) vs a single-process HF prefill (use_cache=True, logits_to_keep=1), the memory model and the "
            f"bound 1.1 x single / P; tiny Llama (assets/tiny-llama), fp32, batch 1, {world} gloo ranks; "
            f"{seconds:.0f} s. Decoding ({decode['decoded_tokens']} tokens at P = {decode['P']}, S = "
            f"{decode['seq_len']}): K/V bytes added per rank {decode['added_bytes_per_rank']}, predicted for the "
            f"busiest {decode['predicted_busiest_bytes']}",
            {"world": world, "model": "assets/tiny-llama", "seconds": seconds, "decode": decode},
            rows,
            [
                ("S", "seq_len", "d"), ("P", "P", "d"), ("mesh", "mesh", "s"), ("single", "single_MiB", ".2f"),
                ("ds_seqpar (measured)", "measured_MiB", ".2f"), ("predicted", "predicted_MiB", ".2f"),
                ("error", "error", "+.1%"), ("phase", "phase", "s"), ("1.1 x single / P", "bound_MiB", ".2f"),
                ("measured / (single / P)", "ratio_to_single_over_p", ".3f"), ("weights", "weights_MiB", ".2f"),
                ("measured + weights", "measured_plus_weights_MiB", ".2f"),
                ("bound + weights", "bound_plus_weights_MiB", ".2f"),
            ],
        )  # fmt: skip
        print(table, flush=True)
    for r in rows:
        assert r["bound_ok"], r
        assert abs(r["error"]) <= TOLERANCE, r
    assert decode["exact"], decode
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    main()
