"""Prefill and decoding time under SP, and the bytes each decoded token sends, against the formula.

Run with PyTorch's launcher (one process per rank)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.decode_speed [--quick]

A random-init fp32 Llama (E = 256, 4 layers, 8 heads, 4 K/V heads, V = 1000), one prompt of S tokens, B = 1:

* ``SP``: ``ds_seqpar.prefill`` over the whole world (a ring of P ranks, contiguous), then 16 decoding steps
  (``integrations/decode.decode_step``); the slowest rank's seconds. Bytes per token: what one rank sent in
  one decoding step (``mesh.comm_stats``), next to ``L · (P - 1) · parallel/decode.decode_bytes(B, 1, H, D)``.
* ``1 process``: HF's own forward with a ``DynamicCache`` (the prompt, then 16 single-token steps) on rank 0
  while the others wait; the same model and prompt.

Prints a markdown table on rank 0 and saves ``benchmarks/results/decode_speed.{json,md}``. On 2 shared CPU
cores the P ranks compete for the cores, so the times show the cost of the method here, not a speed-up;
exactness is ``tests/test_generation.py``'s job.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import ds_seqpar
from benchmarks.common import random_llama, save_results
from ds_seqpar import SeqParCausalLM, SeqParMesh
from ds_seqpar.integrations.decode import decode_step
from ds_seqpar.parallel.decode import decode_bytes

VOCAB, WIDTH, LAYERS, HEADS, STEPS = 1000, 256, 4, 8, 16


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def one_process(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    """HF's prefill and per-token decoding seconds with its own cache (rank 0 only)."""
    from transformers import DynamicCache

    with torch.no_grad():
        t0 = time.perf_counter()
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        prefill = time.perf_counter() - t0
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for i in range(STEPS):
            pos = torch.tensor([[ids.shape[1] + i]])
            out = model(input_ids=token, position_ids=pos, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
    return prefill, (time.perf_counter() - t0) / STEPS


def sharded(lm: SeqParCausalLM, ids: torch.Tensor) -> dict[str, float]:
    """Prefill and per-token decoding seconds (slowest rank) and one step's bytes on this rank."""
    dist.barrier()
    t0 = time.perf_counter()
    first = ds_seqpar.prefill(lm, ids, reserve=STEPS)
    prefill = _slowest(time.perf_counter() - t0)
    token = first.logits.argmax(-1)
    with lm.mesh.comm_stats.measure() as region:
        token = decode_step(lm, first.cache, token).argmax(-1)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(STEPS - 1):
        token = decode_step(lm, first.cache, token).argmax(-1)
    step = _slowest(time.perf_counter() - t0) / (STEPS - 1)
    return {"prefill": prefill, "step": step, "bytes": region.counters["all_gather"].bytes}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="S = 4096 only")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = SeqParMesh.from_config({"size": world, "ulysses_degree": 1, "ring": {"layout": "contiguous"}})
    model = random_llama(VOCAB, WIDTH, LAYERS, HEADS).eval()
    lm = SeqParCausalLM(random_llama(VOCAB, WIDTH, LAYERS, HEADS).eval(), mesh)
    rows = []
    for seq_len in (4096,) if args.quick else (4096, 16384):
        ids = torch.randint(3, VOCAB, (1, seq_len), generator=torch.Generator().manual_seed(0))
        sp = sharded(lm, ids)
        ref = one_process(model, ids) if dist.get_rank() == 0 else (0.0, 0.0)
        dist.barrier()
        formula = LAYERS * (world - 1) * decode_bytes(1, 1, HEADS, WIDTH // HEADS)
        rows.append({
            "S": seq_len, "P": world, "sp_prefill_s": sp["prefill"], "sp_step_ms": 1e3 * sp["step"],
            "one_prefill_s": ref[0], "one_step_ms": 1e3 * ref[1], "bytes": sp["bytes"], "formula": formula,
        })  # fmt: skip
        if sp["bytes"] != formula:
            raise AssertionError(f"rank {dist.get_rank()}: {sp['bytes']} bytes per token, formula {formula}")
    if dist.get_rank() == 0:
        columns = [
            ("S", "S", "d"), ("P", "P", "d"), ("SP prefill (s)", "sp_prefill_s", ".2f"),
            ("SP decode (ms/token)", "sp_step_ms", ".1f"), ("1 process prefill (s)", "one_prefill_s", ".2f"),
            ("1 process decode (ms/token)", "one_step_ms", ".1f"), ("bytes/token/rank", "bytes", "d"),
            ("formula", "formula", "d"),
        ]  # fmt: skip
        meta = {"vocab": VOCAB, "width": WIDTH, "layers": LAYERS, "heads": HEADS, "steps": STEPS}
        title = f"Decoding under SP ({world} gloo CPU ranks, ring, fp32 Llama E={WIDTH} L={LAYERS} H={HEADS})"
        print(save_results("decode_speed", title, meta, rows, columns))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
