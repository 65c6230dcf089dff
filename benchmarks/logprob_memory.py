"""Per-rank peak memory of the log-prob pass (``ds_seqpar.token_logprobs``) vs its chunk and vocabulary.

Run with PyTorch's launcher (one process per rank)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.logprob_memory [--quick]

A Llama (E = 64, 2 layers, 4 heads, random init, fp32) with a real-size vocabulary V (32000 and 128000),
one sequence of S tokens split over the 4 ranks (U = 2 x R = 2, zigzag; n = S / 4 tokens per rank),
through ``ds_seqpar.SeqParCausalLM``. Per (V, S), the peak of the bytes created inside each call on any
rank (``ds_seqpar.memory.trace.LiveBytes``; parameters and their gradients exist before the call, so they
are excluded) for:

* ``token_logprobs c``: ``ds_seqpar.token_logprobs(model, batch, gather=True, chunk_size=c)`` forward
  (``[B, S]`` gathered on every rank) and the backward of a loss on the gathered log-probs;
* the same with ``chunk_size = n``: the logits ``[B, n, V]`` of the whole shard at once (what an
  unchunked implementation costs);
* ``train forward``: the training loss's forward (``loss_chunk_size`` 1024), for reference.

``--width 512 --quick --out logprob_memory_e512_cpu`` shows the LM head's gradient term (``[V, E]``). Figures
and their reading: docs/logprob_memory.md.

Prints a markdown table on rank 0 and saves ``benchmarks/results/<out>.{json,md}``; asserts
that the chunked peak is below the unchunked one where n > c. Exactness is the tests' job
(``tests/test_logprobs.py``).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import ds_seqpar
from benchmarks.common import gather_floats, random_llama, save_results
from ds_seqpar import SeqParCausalLM, SeqParMesh, shard_batch
from ds_seqpar.memory.trace import LiveBytes

WIDTH, LAYERS, HEADS, TRAIN_CHUNK = 64, 2, 4, 1024
# (V, sequence lengths, chunk sizes, largest n measured unchunked: [n, V] fp32 tensors fit in 2 cores' RAM)
FULL = ((32000, (4096, 8192, 16384), (256, 1024), 4096), (128000, (4096, 8192), (256, 1024), 1024))
QUICK = ((32000, (4096, 8192), (256,), 2048),)
MIB = 2**20


def llama(vocab: int, width: int = WIDTH) -> torch.nn.Module:
    """Random-init fp32 Llama (``width`` E, untied head ``[V, E]``)."""
    return random_llama(vocab, width, LAYERS, HEADS)


def peak_of(call: object, top: int = 0) -> float | tuple[float, dict]:
    """The largest peak over the ranks of the bytes created inside ``call()`` (MiB); with ``top``, also this
    rank's ``top`` largest live allocations at its peak (op and shape -> MiB)."""
    live = LiveBytes()
    live.detail = top > 0
    with live:
        call()  # type: ignore[operator]
    peak = max(gather_floats(live.peak)) / MIB
    if not top:
        return peak
    return peak, {label: round(b / MIB, 1) for label, b in live.at_peak.most_common(top)}


def logprob_step(model: SeqParCausalLM, batch: dict, chunk: int) -> None:
    """Gathered log-probs ``[B, S]`` (``chunk`` tokens of logits at a time) and the backward of their mean."""
    out = ds_seqpar.token_logprobs(model, batch, gather=True, chunk_size=chunk)
    labelled = out.labels != -100
    (-(out.logprobs * labelled).sum() / labelled.sum()).backward()


def measure(
    mesh: SeqParMesh, model: SeqParCausalLM, vocab: int, seq_len: int, chunks: tuple, max_n: int
) -> dict:
    """One (V, S) row: the peaks (MiB) of the log-prob pass per chunk, unchunked, and of a training forward."""
    g = torch.Generator().manual_seed(seq_len)
    batch = shard_batch({"input_ids": torch.randint(4, vocab, (1, seq_len), generator=g)}, mesh)
    n = seq_len // mesh.sp_size
    row: dict = {"vocab": vocab, "seq_len": seq_len, "tokens_per_rank": n}
    for c in chunks:
        model.zero_grad(
            set_to_none=False
        )  # gradients exist before the call: accumulated in place, not counted
        row[f"logprobs_c{c}_MiB"], row[f"c{c}_at_peak_rank0"] = peak_of(
            lambda c=c: logprob_step(model, batch, c), 4
        )
        row[f"logits_c{c}_MiB"] = c * vocab * 4 / MIB
    row["logits_n_MiB"] = n * vocab * 4 / MIB
    row["unchunked_MiB"] = float("nan")
    if n <= max_n:
        model.zero_grad(set_to_none=False)
        row["unchunked_MiB"], row["unchunked_at_peak_rank0"] = peak_of(
            lambda: logprob_step(model, batch, n), 4
        )
    row["train_forward_MiB"] = peak_of(lambda: model(**batch))
    return row


def run(mesh: SeqParMesh, plan: tuple, width: int = WIDTH) -> list[dict]:
    """Every row of ``plan`` ((V, lengths, chunks, largest unchunked n) per vocabulary), hidden size ``width``."""
    rows = []
    for vocab, lengths, chunks, max_n in plan:
        model = SeqParCausalLM(llama(vocab, width), mesh, loss_chunk_size=TRAIN_CHUNK)
        warm = shard_batch({"input_ids": torch.randint(4, vocab, (1, 8 * mesh.sp_size))}, mesh)
        logprob_step(model, warm, 8)  # creates every parameter's .grad before the measured calls
        for s in lengths:
            rows.append(measure(mesh, model, vocab, s, chunks, max_n))
            rows[-1]["head_grad_MiB"] = vocab * width * 4 / MIB  # one [V, E] fp32: the head's weight gradient
        del model
    return rows


def table_columns(chunks: tuple) -> list[tuple[str, str, str]]:
    cols = [("V", "vocab", "d"), ("S", "seq_len", "d"), ("n = S/4", "tokens_per_rank", "d")]
    cols += [(f"token_logprobs c={c}", f"logprobs_c{c}_MiB", ".1f") for c in chunks]
    cols += [("unchunked (c = n)", "unchunked_MiB", ".1f"), ("train forward", "train_forward_MiB", ".1f")]
    cols += [(f"[{c}, V] fp32", f"logits_c{c}_MiB", ".1f") for c in chunks]
    return [*cols, ("[n, V] fp32", "logits_n_MiB", ".1f"), ("[V, E] fp32", "head_grad_MiB", ".1f")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="V = 32000, S = 4096 and 8192, c = 256 only")
    parser.add_argument(
        "--width", type=int, default=WIDTH, help="hidden size E (the head's gradient is [V, E])"
    )
    parser.add_argument("--out", default="logprob_memory_cpu", help="results/<out>.{json,md}")
    args = parser.parse_args(argv)
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    u = 2 if world % 2 == 0 else 1
    mesh = SeqParMesh.from_config({"size": world, "ulysses_degree": u})
    plan = QUICK if args.quick else FULL
    start = time.perf_counter()
    rows = run(mesh, plan, args.width)
    seconds = time.perf_counter() - start
    chunks = tuple(sorted({c for _, _, cs, _ in plan for c in cs}))
    if dist.get_rank() == 0:
        table = save_results(
            args.out,
            f"Peak memory per rank of the log-prob pass (MiB created inside the call: forward + backward of a loss "
            f"on the gathered log-probs; parameters and gradients excluded; the largest rank; unmeasured: nan); "
            f"{world} gloo ranks (U={u} x R={world // u}, zigzag), Llama E={args.width}, {LAYERS} layers, batch 1, "
            f"fp32; {seconds:.0f} s",
            {"world": world, "width": args.width, "layers": LAYERS, "chunks": chunks, "seconds": seconds},
            rows,
            table_columns(chunks),
        )
        print(table, flush=True)
    for r in rows:
        for c in chunks:
            if r["tokens_per_rank"] > c and r["unchunked_MiB"] == r["unchunked_MiB"]:
                assert r[f"logprobs_c{c}_MiB"] < r["unchunked_MiB"], r
    if own_group:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    main()
