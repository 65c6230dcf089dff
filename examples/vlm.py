"""Fine-tune a vision-language model (Qwen2-VL) on images and text under sequence parallelism.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 2 examples/vlm.py
    .venv/bin/python examples/vlm.py --single

The data is ``assets/vlm_data/train.jsonl`` (records with images, docs/multimodal_data.md), read by the
model's own processor and packed into rows of ``--seq-len`` tokens with document ids and each record's own mRoPE
positions (``ds_seqpar.cli.vlm``; ``--one-per-row``: one record per row). Every rank gets the same full
row; ``vlm_dataloader`` (``shard_vlm_batch``) keeps this rank's tokens (``ds_seqpar.shard_batch``) and passes
the vision inputs whole; ``ds_seqpar.SeqParVisionLM`` returns the SP group's token-mean loss. After backward each rank holds
its share of every gradient, summed over the SP group here (the semantics of ``SeqParCausalLM`` with
``grad_scale=1``). ``--single`` runs the plain HF model in one process on the same rows (the reference). The
model is the shipped tiny Qwen2-VL with seeded random weights (``--model`` loads one with
``from_pretrained``). The script fails unless the loss falls (its last 2 steps against its first 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForImageTextToText

from ds_seqpar.cli.vlm import (
    PackedVlmDataset,
    collate_vlm,
    family_of,
    hf_inputs,
    position_function,
    read_vlm_data,
    vlm_dataloader,
)

REPO = Path(__file__).resolve().parents[1]
TINY_VLM = REPO / "assets" / "tiny-qwen2-vl"
DATA = REPO / "assets" / "vlm_data" / "train.jsonl"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default=None, help="HF VLM directory (default: assets/tiny-qwen2-vl, random init)"
    )
    p.add_argument("--data", default=str(DATA), help="JSONL of multimodal records")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--single", action="store_true", help="one process, the plain HF model (the reference)")
    p.add_argument(
        "--one-per-row", action="store_true", help="one record per row (default: records packed into rows)"
    )
    return p.parse_args(argv)


def load(args: argparse.Namespace) -> tuple[torch.nn.Module, PackedVlmDataset]:
    """The model (seeded random init unless --model) and the packed rows; the data is checked first."""
    path = args.model or str(TINY_VLM)
    config = AutoConfig.from_pretrained(path)
    records = read_vlm_data(args.data, path, config, args.seq_len)  # refusals before any collective
    torch.manual_seed(args.seed)
    if args.model:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    else:
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    pad = config.text_config.pad_token_id or 0
    positions = position_function(family_of(config), model)
    return model, PackedVlmDataset(records, args.seq_len, positions, pad, pack=not args.one_per_row)


def train(args: argparse.Namespace, sp: bool = True) -> tuple[list[float], int]:
    """``--max-steps`` AdamW steps over the rows in order (under SP on every rank of the process group, or the
    plain model): the loss of every step, and the number of rows."""
    model, rows = load(args)
    loss_fn, mesh = model, None
    if sp:
        import ds_seqpar

        mesh = ds_seqpar.SeqParMesh.from_config({"size": dist.get_world_size()}, model.config)
        loss_fn = ds_seqpar.SeqParVisionLM(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    if mesh is not None:  # the rows in order, this rank's tokens and the vision inputs whole
        loader = vlm_dataloader(rows, mesh, 1, shuffle=False, pad_token_id=rows.pad_token_id)
    losses = []
    for step in range(args.max_steps):
        opt.zero_grad()
        if mesh is None:
            loss = model(**hf_inputs(collate_vlm([rows[step % len(rows)]]))).loss
            loss.backward()
        else:
            if step % len(rows) == 0:
                batches = iter(loader)
            loss = loss_fn(**next(batches))
            loss.backward()
            for p in model.parameters():  # each rank holds its share of every gradient
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=mesh.group("sp"))
        opt.step()
        losses.append(loss.item())
    return losses, len(rows)


def main(argv: list[str] | None = None) -> list[float]:
    args = parse(argv)
    started = dist.is_initialized()
    if not args.single and not started:
        dist.init_process_group("gloo")
    losses, _ = train(args, sp=not args.single)
    if args.single or dist.get_rank() == 0:
        print(f"examples/vlm.py: {len(losses)} steps, losses {[round(x, 4) for x in losses]}", flush=True)
    if not args.single and not started:
        dist.destroy_process_group()
    if len(losses) >= 4 and sum(losses[-2:]) >= sum(losses[:2]):
        raise SystemExit(
            f"examples/vlm.py: the loss did not fall (last 2 steps against the first 2): {losses}"
        )
    return losses


if __name__ == "__main__":
    main(sys.argv[1:])
