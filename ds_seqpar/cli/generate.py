"""``python -m ds_seqpar.generate``: generate continuations of prompts over the SP group (docs/inference_cli.md).

    torchrun --nproc_per_node N -m ds_seqpar.generate --model DIR --ds_config X.json --prompt-file F

Every flag, the config, the model directory and the prompts are checked first (``generate_args.py``). Every
rank loads the model (``from_pretrained``, ``--dtype``), builds the mesh of the config's ``sequence_parallel``
section and runs ``ds_seqpar.generate`` on each prompt on its own (the same tokens on every rank); rank 0
prints each continuation and, with ``--out``, writes one JSON line per prompt: token counts, the new token
ids, the text, the prefill time, the decoding time and tokens per second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ds_seqpar.cli.generate_args import parse_args

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``python -m ds_seqpar.generate``; returns the exit code (0) on every rank."""
    import torch.distributed as dist

    from ds_seqpar.integrations.deepspeed import init_distributed
    from ds_seqpar.integrations.prefill import causal_wrapper
    from ds_seqpar.mesh import SeqParMesh

    warnings.filterwarnings("ignore", message=r".*is deprecated", category=FutureWarning)
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    if "WORLD_SIZE" not in os.environ:
        _single_process_env()
    init_distributed(args.settings.fault_timeout_s)
    mesh = SeqParMesh.from_config(args.section, args.model_config)
    rank = dist.get_rank()
    model = causal_wrapper(_load_model(args), mesh)  # built once: its checks run a probe forward, not timed
    say = (
        (lambda text: print(text, flush=True)) if rank == 0 and not args.no_progress else (lambda text: None)
    )
    say(
        f"generate: {mesh.sp_size} ranks per sequence, {mesh.settings.attention}, layout {mesh.settings.ring.layout} | "
        f"{len(args.prompts)} prompt(s), up to {args.max_new_tokens} new tokens, "
        + ("sampling" if args.do_sample else "greedy")
        + f", {args.dtype}, prefill {args.prefill_mode}"
    )
    rows = []
    for index, (_, ids) in enumerate(args.prompts):
        row = generate_one(model, args, ids)
        rows.append({"index": index, **row})
        say(
            f"[{index + 1}/{len(args.prompts)}] {row['prompt_tokens']} prompt tokens -> {row['new_tokens']} new "
            f"tokens; prefill {row['prefill_s']:.3f} s, {row['tokens_per_s']:.1f} tokens/s"
        )
        if rank == 0:
            print(row["text"], flush=True)
    if rank == 0 and args.out is not None:
        _write(args.out, rows)
        say(f"generate: {len(rows)} row(s) in {args.out}")
    dist.barrier()
    return 0


def _single_process_env() -> None:
    """``python -m ds_seqpar.generate`` without a launcher: a process group of this one process."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():  # fmt: skip
        os.environ.setdefault(key, value)


def _load_model(args: argparse.Namespace) -> torch.nn.Module:
    """The causal LM of ``--model`` in ``--dtype``, in eval mode, on this rank's device."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    if args.random_init:
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(
            args.model_config, dtype=dtype, trust_remote_code=args.trust_remote_code
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=dtype, trust_remote_code=args.trust_remote_code
        )
    if torch.cuda.is_available():
        model = model.to(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    return model.eval()


def generate_one(model: Any, args: argparse.Namespace, ids: list[int]) -> dict[str, Any]:
    """One prompt's generation by the ``SeqParCausalLM`` ``model`` and its row: token counts, new token ids,
    text, prefill and decoding times."""
    from ds_seqpar.integrations.generation import generate
    from ds_seqpar.integrations.hf_model import unwrap_hf_model

    device = next(model.parameters()).device
    prompt = torch.tensor([ids], dtype=torch.long, device=device)
    sampling = {"do_sample": args.do_sample}
    sampling.update(
        {k: getattr(args, k) for k in ("temperature", "top_k", "top_p") if getattr(args, k) is not None}
    )
    head = unwrap_hf_model(model.model).get_output_embeddings()
    stamps: list[float] = []
    hook = head.register_forward_hook(
        lambda *_: stamps.append(_now(device))
    )  # the first call ends the prefill
    try:
        start = _now(device)
        out = generate(model, prompt, prefill_mode=args.prefill_mode, seed=args.seed,
                       max_new_tokens=args.max_new_tokens, **sampling)  # fmt: skip
        end = _now(device)
    finally:
        hook.remove()
    new = out.sequences[0, len(ids) :].tolist()
    prefill_s = stamps[0] - start
    decode_s = end - stamps[0]
    return {
        "prompt_tokens": len(ids),
        "new_tokens": len(new),
        "new_token_ids": new,
        "text": args.tokenizer.decode(new, skip_special_tokens=True),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "tokens_per_s": len(new) / (end - start),
        "decode_tokens_per_s": (len(new) - 1) / decode_s if len(new) > 1 and decode_s > 0 else None,
        "sp_size": model.mesh.sp_size,
    }


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _write(path: str, rows: list[dict[str, Any]]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
