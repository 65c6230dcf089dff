"""Per-rank peak memory of a sharded evaluation vs a training step's forward, on CPU gloo ranks.

Run with PyTorch's launcher (one process per rank)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.eval_memory [--quick]

A Llama (E = 256, 2 layers, 4 heads, vocabulary V = 32000, random init, fp32) on one sequence of S tokens
split over the 4 ranks (U = 2 x R = 2, zigzag; n = S / 4 tokens per rank), through
``ds_seqpar.SeqParCausalLM`` with ``loss_chunk_size`` 1024. Per S, the peak of the bytes created inside
each call on any rank (``ds_seqpar.memory.trace.LiveBytes``: parameters excluded, the same for all
three) for:

* ``train forward``: the training loss's forward (gradients on, what autograd keeps for backward included);
* ``evaluate``: ``SeqParCausalLM.evaluate`` (no gradients, logits ``loss_chunk_size`` tokens at a time);
* ``evaluate, one chunk``: the same with ``loss_chunk_size`` >= n, i.e. the logits ``[n, V]`` of every
  labelled token of the shard at once (how evaluation ran before it was chunked).

Prints a markdown table on rank 0 and saves ``benchmarks/results/eval_memory_cpu.{json,md}``; asserts
that evaluation peaks no higher than the training forward. Exactness is the tests' job
(``tests/test_hf_integration.py``).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from benchmarks.common import gather_floats, random_llama, save_results
from ds_seqpar import SeqParCausalLM, SeqParMesh, shard_batch
from ds_seqpar.memory.trace import LiveBytes

WIDTH, LAYERS, HEADS, VOCAB, CHUNK = 256, 2, 4, 32000, 1024


def llama() -> torch.nn.Module:
    return random_llama(VOCAB, WIDTH, LAYERS, HEADS)


def peak_of(call: object) -> float:
    """The largest peak over the ranks of the bytes created inside ``call()`` (MiB)."""
    with LiveBytes() as live:
        out = call()  # type: ignore[operator]
        del out
    return max(gather_floats(live.peak)) / 2**20


def measure(mesh: SeqParMesh, seq_len: int) -> dict:
    g = torch.Generator().manual_seed(seq_len)
    batch = shard_batch({"input_ids": torch.randint(4, VOCAB, (1, seq_len), generator=g)}, mesh)
    model = SeqParCausalLM(llama(), mesh, loss_chunk_size=CHUNK)
    train = peak_of(lambda: model(**batch))
    model.eval()
    chunked = peak_of(lambda: model.evaluate(**batch))
    model.loss_chunk_size = seq_len  # every labelled token of the shard in one chunk
    whole = peak_of(lambda: model.evaluate(**batch))
    n = seq_len // mesh.sp_size
    return {
        "seq_len": seq_len,
        "tokens_per_rank": n,
        "train_forward_MiB": train,
        "eval_MiB": chunked,
        "eval_one_chunk_MiB": whole,
        "logits_chunk_MiB": CHUNK * VOCAB * 4 / 2**20,
        "eval_le_train": chunked <= train,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="S = 8192 only")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    u = 2 if world % 2 == 0 else 1
    mesh = SeqParMesh.from_config({"size": world, "ulysses_degree": u})
    lengths = (8192,) if args.quick else (4096, 8192, 16384)
    rows = [measure(mesh, s) for s in lengths]
    if dist.get_rank() == 0:
        table = save_results(
            "eval_memory_cpu",
            f"Peak memory per rank (MiB created inside the call, parameters excluded; the largest rank): "
            f"evaluation vs a training forward; {world} gloo ranks (U={u} x R={world // u}), Llama E={WIDTH}, "
            f"{LAYERS} layers, V={VOCAB}, loss_chunk_size {CHUNK}, batch 1, fp32",
            {"world": world, "width": WIDTH, "layers": LAYERS, "vocab": VOCAB, "chunk": CHUNK},
            rows,
            [
                ("S", "seq_len", "d"),
                ("tokens per rank", "tokens_per_rank", "d"),
                ("train forward", "train_forward_MiB", ".1f"),
                ("evaluate", "eval_MiB", ".1f"),
                ("evaluate, one chunk (before)", "eval_one_chunk_MiB", ".1f"),
                ("one logits chunk [1024, V] fp32", "logits_chunk_MiB", ".1f"),
            ],
        )
        print(table, flush=True)
    assert all(r["eval_le_train"] for r in rows), rows
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
