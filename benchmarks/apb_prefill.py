"""APB / Star Attention prefill vs exact SP prefill on CPU gloo ranks, over APB's passing length.

Run with PyTorch's launcher (one process per rank)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.apb_prefill [--quick]

A random-init Llama (E = 256, 2 layers, 4 heads, 2 KV heads, D = 64, fp32) prefills one prompt of S tokens
(32768; ``--quick``: 4096) on the 4 ranks. In the same run:

* ``exact``: ``ds_seqpar.prefill(..., mode="exact")`` under the default section (USP, U "auto" = 2, zigzag);
* ``star`` (l_p = 0) and ``apb`` at each passing length l_p: ``ds_seqpar.prefill`` with ``inference.prefill``
  ``"star"`` / ``"apb"`` (anchor_len 1024, query_len 64; ``ring.layout: "contiguous"``, the same process groups:
  one row per rank = anchor + embedded query + its block of S / 4).

Per mode: the median over ``--reps`` (after one warm-up) of the slowest rank's prefill time, the speed-up
over exact, the bytes one rank sends in the prefill (``mesh.comm_stats``: every collective of the modes),
APB's all-gather bytes against the formula ``layers · (P-1) · B · H_kv · min(l_p, n) · (2·D·4 + 8)``, and
those bytes per block token. With ``--model DIR`` (an HF causal LM with the passkey tokenizer, e.g. one
trained by ``train.py``), passkey retrieval accuracy of the last position over ``--samples`` prompts
(``ds_seqpar/tasks/passkey.py``, one question at the end) for every mode; without it accuracy is not measured.
Saves ``benchmarks/results/apb_prefill_cpu.{json,md}``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import ds_seqpar
from benchmarks.common import gather_floats, random_llama, save_results, slowest_rank_median
from ds_seqpar import SeqParMesh
from ds_seqpar.parallel.apb import ApbSpec, apb_layer_bytes

WIDTH, LAYERS, HEADS, VOCAB = 256, 2, 4, 1024
ANCHOR, QUERY = 1024, 64


def _modes(budgets: list[int]) -> list[tuple[str, int]]:
    return [("exact", -1), *[("star" if b == 0 else "apb", b) for b in budgets]]


def _prompts(args, seq_len: int) -> list[tuple[torch.Tensor, int]]:
    """(ids [1, S], answer token) per passkey prompt ending on its first question (the embedded task's held-out
    rows, ``benchmarks/passkey_generate.py``); a random prompt without --model."""
    if args.model is None:
        g = torch.Generator().manual_seed(seq_len)
        return [(torch.randint(4, VOCAB, (1, seq_len), generator=g), -1)]
    from benchmarks.passkey_generate import DEFAULT_SEED, passkey_prompts

    ids, answers, _ = passkey_prompts(args.model, seq_len, args.samples, DEFAULT_SEED)
    return [(row.view(1, -1), answer) for row, answer in zip(ids, answers, strict=True)]


def run_mode(model, base: SeqParMesh, mode: str, budget: int, prompts, reps: int) -> dict:
    spec = ApbSpec(ANCHOR, QUERY, budget) if mode != "exact" else None
    mesh = base
    if spec is not None:
        inference = {"prefill": mode, "anchor_len": ANCHOR, "query_len": QUERY}
        if mode == "apb":
            inference["passing_len"] = budget
        section = {"size": base.sp_size, "ring": {"layout": "contiguous"}, "inference": inference}
        mesh = base.with_section(section, model.config)

    def call(ids):
        return ds_seqpar.prefill(model, ids, mesh=mesh).logits

    ids0 = prompts[0][0]
    seconds = slowest_rank_median(lambda: call(ids0), reps)
    with mesh.comm_stats.measure() as region:
        call(ids0)
    hits = [int(call(ids).argmax(-1)) == answer for ids, answer in prompts if answer >= 0]
    n = ids0.shape[1] // mesh.sp_size
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layers, h_kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    formula = 0 if spec is None else layers * apb_layer_bytes(spec, mesh.sp_size, 1, n, h_kv, d, d, 4)
    return {
        "mode": mode,
        "passing_len": "-" if spec is None else budget,
        "seconds": seconds,
        "sent_MiB": max(gather_floats(region.total_bytes)) / 2**20,
        "all_gather_bytes": region.bytes("all_gather") if spec is not None else 0,
        "formula_bytes": formula,
        "bytes_per_token": (region.bytes("all_gather") / n) if spec is not None else float("nan"),
        "accuracy": sum(hits) / len(hits) if hits else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="S = 4096, passing lengths 0, 64, 1024")
    parser.add_argument("--model", default=None, help="HF model dir with the passkey tokenizer (accuracy)")
    parser.add_argument("--samples", type=int, default=16, help="passkey prompts with --model")
    parser.add_argument("--reps", type=int, default=1, help="timed prefills per mode (after one warm-up)")
    parser.add_argument("--budgets", type=int, nargs="+", default=None,
                        help="passing lengths l_p to run (0 = Star Attention; default 0 256 1024 4096 n)")  # fmt: skip
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    seq_len = 4096 if args.quick else 32768
    n = seq_len // world
    budgets = args.budgets or ([0, 64, 1024] if args.quick else [0, 256, 1024, 4096, n])
    model = (random_llama(VOCAB, WIDTH, LAYERS, HEADS) if args.model is None else _load(args.model)).eval()
    mesh = SeqParMesh.from_config({"size": world}, model.config)
    prompts = _prompts(args, seq_len)
    rows = [run_mode(model, mesh, mode, b, prompts, args.reps) for mode, b in _modes(budgets)]
    for row in rows:
        row["speedup"] = rows[0]["seconds"] / row["seconds"]
        assert row["all_gather_bytes"] == row["formula_bytes"], row
    if dist.get_rank() == 0:
        _save(rows, world, seq_len, args)
    dist.destroy_process_group()


def _load(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="sdpa")


def _save(rows: list[dict], world: int, seq_len: int, args) -> None:
    what = (
        f"passkey accuracy over {args.samples} prompts of {args.model}"
        if args.model
        else "no accuracy (random model)"
    )
    table = save_results(
        "apb_prefill_cpu" + ("_quick" if args.quick else "") + ("_passkey" if args.model else ""),
        f"APB / Star vs exact SP prefill, S={seq_len} on {world} gloo CPU ranks (block n={seq_len // world}), "
        f"anchor_len {ANCHOR}, query_len {QUERY}, "
        + (
            f"model {args.model}, "
            if args.model
            else f"Llama E={WIDTH} {LAYERS} layers H={HEADS} H_kv={HEADS // 2} "
        )
        + "fp32, "
        f"batch 1; slowest rank, median of {args.reps} after a warm-up; {what}",
        {
            "world": world,
            "seq_len": seq_len,
            "anchor_len": ANCHOR,
            "query_len": QUERY,
            "width": WIDTH,
            "layers": LAYERS,
            "heads": HEADS,
            "model": args.model,
            "samples": args.samples,
        },
        rows,
        [
            ("mode", "mode", "s"),
            ("passing_len l_p", "passing_len", ""),
            ("prefill s", "seconds", ".2f"),
            ("speed-up vs exact", "speedup", ".2f"),
            ("MiB sent (busiest rank)", "sent_MiB", ".2f"),
            ("APB all-gather bytes (measured)", "all_gather_bytes", "d"),
            ("formula", "formula_bytes", "d"),
            ("bytes per block token", "bytes_per_token", ".1f"),
            ("passkey accuracy", "accuracy", ".3f"),
        ],
    )
    print(table, flush=True)


if __name__ == "__main__":
    main()
