"""Training on a length mix: today's default against document placement, length-aware packing and a
dynamic SP degree, on the same documents (tiny Llama, CPU gloo ranks).

Run with PyTorch's launcher (one process per rank)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.bench_dynamic

Documents: every document of the first ``--mix-rows`` rows of ``benchmarks/lengths/<mix>.json``, its length
scaled from the mix's row length to ``--seq-len`` (at least 2 tokens), random token ids. Each system packs
them into rows of S = ``--seq-len`` and trains one pass over its rows (one row per step: forward,
token-weighted loss over the SP group, backward, gradient all-reduce, AdamW) with ``SeqParCausalLM`` on
``assets/tiny-llama``'s config (random init, seed 0, fp32):

    default             concat-and-chunk rows (every row full, documents cut at row ends) and today's
                        default layout (zigzag)
    documents           the same rows under ring.layout 'documents'
    balanced            whole documents packed by the degree they need (``tasks/packing.py``), zigzag
    balanced+documents  the same rows under ring.layout 'documents'
    balanced+dynamic    the same rows under ring.layout 'documents' and dynamic_degree

Balanced rows keep every document whole, so their attention does more work per token than rows that cut
documents at row ends: compare the balanced systems with each other (same rows, same work), and the
packings by their causal pairs per token (reported).

Reported per system: steps, the documents' tokens, the padding, the slowest rank's total time, tokens/s
(the documents' tokens over that time), and the degrees the rows ran at. The first step of each system is
a warm-up, timed apart. Saves ``benchmarks/results/dynamic_cpu.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import save_results, sum_grads
from ds_seqpar import SeqParCausalLM, SeqParMesh, input_layout, shard_batch
from ds_seqpar.settings import auto_ulysses_degree

ROOT = Path(__file__).resolve().parents[1]
MIXES = ROOT / "benchmarks" / "lengths"
MODEL_DIR = ROOT / "assets" / "tiny-llama"
EOS = 2
SYSTEMS = {
    "default": ("fixed", {"layout": "zigzag"}, False),
    "documents": ("fixed", {"layout": "documents"}, False),
    "balanced": ("balanced", {"layout": "zigzag"}, False),
    "balanced+documents": ("balanced", {"layout": "documents"}, False),
    "balanced+dynamic": ("balanced", {"layout": "documents"}, True),
}


def mix_documents(mix: str, rows: int, seq_len: int, vocab: int) -> list[torch.Tensor]:
    """The token ids of every document of the mix's first ``rows`` rows, lengths scaled to ``seq_len``."""
    data = json.loads((MIXES / f"{mix}.json").read_text())
    g = torch.Generator().manual_seed(0)
    lengths = [max(2, round(x * seq_len / data["seq_len"])) for row in data["rows"][:rows] for x in row]
    return [torch.randint(4, vocab, (length - 1,), generator=g) for length in lengths]  # EOS added by packing


def pack(packing: str, docs: list[torch.Tensor], seq_len: int, sp_size: int) -> list[dict]:
    from ds_seqpar.tasks.packing import pack_by_degree
    from ds_seqpar.tasks.text import pack_documents

    if packing == "fixed":
        return pack_documents(docs, seq_len, EOS)
    return pack_by_degree(docs, seq_len, sp_size, EOS)


def _model(seed: int = 0) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(MODEL_DIR)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def run_system(name: str, docs: list[torch.Tensor], seq_len: int) -> dict:
    """One pass of one system over its rows: times, tokens and the degrees its rows ran at."""
    packing, ring, dynamic = SYSTEMS[name]
    world = dist.get_world_size()
    model = _model()
    u = auto_ulysses_degree(world, model.config.num_attention_heads, model.config.num_key_value_heads)
    section = {"size": world, "ulysses_degree": u, "ring": ring, "dynamic_degree": dynamic}
    mesh = SeqParMesh.from_config(section)
    sp = SeqParCausalLM(model, mesh)
    opt = torch.optim.AdamW(sp.parameters(), lr=1e-4)
    rows = pack(packing, docs, seq_len, world)
    if len(rows) < 2:
        raise SystemExit(
            f"{name}: {len(rows)} row(s) of {seq_len} tokens; pass more --mix-rows (a warm-up and a step)"
        )
    times, degrees, losses, pairs, per_row = [], collections.Counter(), [], 0, []
    for row in rows:
        batch = {k: v[None] for k, v in row.items()}
        dist.barrier()
        start = time.perf_counter()
        shard = shard_batch(batch, mesh)
        loss = sp(**shard)
        loss.backward()
        sum_grads(sp)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        layout = input_layout(mesh, shard["doc_ids"])
        degrees[layout.group_degree or world] += 1
        per_row.append(layout.group_degree or world)
        pairs += _pairs(row)
    slowest = [max(t) for t in zip(*_gathered(times), strict=True)]
    tokens = sum(int(r.get("attention_mask", torch.ones_like(r["input_ids"])).sum()) for r in rows)
    return {
        "system": name,
        "layout": ring["layout"] + (" + dynamic_degree" if dynamic else ""),
        "packing": packing,
        "U": u,
        "steps": len(rows),
        "tokens": tokens,
        "padding_pct": 100.0 * (1 - tokens / (len(rows) * seq_len)),
        "warmup_s": slowest[0],
        "total_s": sum(slowest[1:]),
        "tokens_per_s": (tokens - _row_tokens(rows[0])) / sum(slowest[1:]),
        "degrees": " ".join(f"p={p}: {c}" for p, c in sorted(degrees.items())),
        "pairs_per_token": pairs / tokens,
        "row_degrees": per_row,
        "row_seconds": slowest,
        "mean_loss": sum(losses) / len(losses),
    }


def _pairs(row: dict) -> int:
    """Causal (query, key) pairs inside the row's documents."""
    from ds_seqpar.data import doc_ids_from_positions
    from ds_seqpar.layout import document_lengths

    docs = doc_ids_from_positions(row["position_ids"][None])
    if "attention_mask" in row:
        docs = docs.masked_fill(row["attention_mask"][None] == 0, -1)
    return sum(x * (x + 1) // 2 for x in document_lengths(docs))


def _row_tokens(row: dict) -> int:
    return int(row.get("attention_mask", torch.ones_like(row["input_ids"])).sum())


def _gathered(times: list[float]) -> list[list[float]]:
    out = [torch.zeros(len(times), dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor(times, dtype=torch.float64))
    return [t.tolist() for t in out]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mix", default="longtail_128k")
    p.add_argument("--mix-rows", type=int, default=16, help="rows of the mix whose documents are trained on")
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--out", default="dynamic_cpu", help="results/<out>.{json,md}")
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    vocab = json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]
    docs = mix_documents(args.mix, args.mix_rows, args.seq_len, vocab)
    results = [run_system(name, docs, args.seq_len) for name in args.systems.split(",")]
    base = results[0]["tokens_per_s"]
    for r in results:
        r["speedup"] = r["tokens_per_s"] / base
    if dist.get_rank() == 0:
        meta = {"mix": args.mix, "mix_rows": args.mix_rows, "seq_len": args.seq_len, "world": dist.get_world_size(),
                "documents": len(docs), "model": "assets/tiny-llama (random init, fp32)", "torch": torch.__version__}  # fmt: skip
        title = (
            f"One pass over {len(docs)} documents of {args.mix} (first {args.mix_rows} rows, scaled to S = "
            f"{args.seq_len}) on {dist.get_world_size()} CPU gloo ranks, tiny Llama fp32; slowest rank, warm-up "
            "step excluded."
        )
        columns = [
            ("system", "system", "s"), ("layout", "layout", "s"), ("packing", "packing", "s"), ("U", "U", "d"),
            ("steps", "steps", "d"), ("tokens", "tokens", "d"), ("padding %", "padding_pct", ".1f"),
            ("time (s)", "total_s", ".2f"), ("tokens/s", "tokens_per_s", ".0f"), ("vs default", "speedup", ".2f"),
            ("rows at degree", "degrees", "s"), ("pairs / token", "pairs_per_token", ".0f"),
            ("mean loss", "mean_loss", ".4f"),
        ]  # fmt: skip
        print(save_results(args.out, title, meta, results, columns))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
