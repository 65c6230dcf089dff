"""Every image-text-to-text type of the installed transformers under ds_seqpar: exact, refused, or skipped.

For each model type of ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` a tiny random model is built from its
config and one batch with two images (and a video where the family takes videos) from the model's own feature
functions (``benchmarks/vlm_tiny.py``). On 4 gloo ranks (U 2 x R 2, zigzag) one forward and backward runs twice:
the plain model in one process (its own loss from ``labels``) and ``SeqParVisionLM`` (the SP-group loss; every
parameter's gradient summed over the SP ranks). Each type ends as in ``benchmarks/model_sweep.py``:

    exact      loss and every gradient within 1e-5 relative of the plain model (a gradient below 1 % of the
               whole gradient's norm, e.g. a key bias's, which the softmax cancels, relative to that 1 %)
    refused    ds_seqpar raised UnsupportedModelError, naming what it cannot honour
    skipped    the tiny plain model or its inputs could not be built or run (the reason)
    mismatch   anything else that ran: a silent wrong result, which fails the sweep
    error      ds_seqpar failed with another exception (not silent, but not a clean refusal: to be fixed)

Usage::

    python -m benchmarks.model_sweep --multimodal                # all types -> docs/models.md + results JSON
    python -m benchmarks.model_sweep --multimodal llava qwen2_vl --no-write

Exit status 1 if any type is a mismatch.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.model_sweep import (
    GRAD_FLOOR,
    LAYOUT,
    ROOT,
    TOLERANCE,
    ULYSSES,
    WORLD,
    _first_line,
    _mesh,
    sweep_many,
)

STATUSES = ("exact", "refused", "skipped", "mismatch", "error")
SECTION = "## Vision-language models"  # docs/models.md: this heading to the end is the sweep's


def reference_batch(ref: torch.nn.Module) -> tuple[dict, torch.Tensor]:
    """The batch (with a video where the family's forward takes one and runs on it) and the plain model's loss."""
    from benchmarks.vlm_tiny import takes_video, vlm_batch

    errors = []
    for with_video in ([True] if takes_video(ref) else []) + [False]:
        try:
            batch = vlm_batch(ref, with_video)
            loss = ref(**batch, use_cache=False).loss
        except Exception as exc:
            errors.append(_first_line(exc, 160))
            continue
        if loss is None or not torch.isfinite(loss):
            errors.append(f"plain loss {loss}")
            continue
        return batch, loss
    raise RuntimeError(errors[-1])


def _grad_error(model: torch.nn.Module, ref: torch.nn.Module, mesh) -> tuple[float, str]:
    """The worst relative gradient error (SP gradients summed over the group) and its parameter."""
    ref_grads = [torch.zeros_like(p) if p.grad is None else p.grad.double() for p in ref.parameters()]
    floor = GRAD_FLOOR * torch.sqrt(sum((g**2).sum() for g in ref_grads)).item()
    worst, where = 0.0, ""
    for (name, p), g_ref in zip(model.named_parameters(), ref_grads, strict=True):
        grad = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad, group=mesh.group("sp"))
        err = (grad.double() - g_ref).norm().item() / max(g_ref.norm().item(), floor, 1e-30)
        if err > worst:
            worst, where = err, name
    return worst, where


def sweep_one(model_type: str, seed: int = 0) -> dict:
    """On every rank: build, run the plain model and SeqParVisionLM, compare (see the module docstring)."""
    from benchmarks.vlm_tiny import build_tiny_vlm
    from ds_seqpar import SeqParConfigError, SeqParVisionLM, UnsupportedModelError, shard_batch
    from ds_seqpar.integrations.vision.split_tower import vision_towers

    mesh = _mesh()
    try:
        ref = build_tiny_vlm(model_type, seed=seed)
        model = copy.deepcopy(ref)
    except Exception as exc:  # the plain tiny model
        return {"status": "skipped", "detail": _first_line(exc)}
    try:  # a family ds_seqpar does not run is refused when wrapped, whatever the batch
        lm = SeqParVisionLM(model, mesh)
    except (UnsupportedModelError, SeqParConfigError) as exc:
        return {"status": "refused", "detail": _first_line(exc)}
    except Exception as exc:
        return {"status": "error", "detail": f"{type(exc).__name__}: {_first_line(exc)}"}
    try:
        batch, ref_loss = reference_batch(ref)
        ref_loss.backward()
    except Exception as exc:  # the plain tiny model or its inputs
        return {"status": "skipped", "detail": _first_line(exc)}
    text = {k: batch[k] for k in ("input_ids", "labels")}
    vision = {
        k: v for k, v in batch.items() if k not in text and k != "attention_mask"
    }  # no padding: SP needs none
    shape = (
        f"{batch['input_ids'].shape[1]} tokens, {'video' if any('video' in k for k in vision) else 'images'}"
    )
    rules = sorted({rule.name if rule else "whole" for _, _, rule in vision_towers(ref)}) or ["whole"]
    shape += f", tower {'/'.join(rules)}"  # split by the TowerRule of that name, or run whole on every rank
    if "token_type_ids" in inspect.signature(type(ref.model).forward).parameters:
        shape += " (no token_type_ids: image blocks are refused by name)"
    try:
        loss = lm(**shard_batch(text, mesh), **vision)
        loss.backward()
    except (UnsupportedModelError, SeqParConfigError) as exc:
        return {"status": "refused", "detail": _first_line(exc)}
    except Exception as exc:
        return {"status": "error", "detail": f"{type(exc).__name__}: {_first_line(exc)}"}
    loss_err = abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-30)
    worst, where = _grad_error(model, ref, mesh)
    exact = loss_err <= TOLERANCE and worst <= TOLERANCE
    detail = f"{shape}; loss {loss_err:.1e}, gradients {worst:.1e}" + ("" if exact else f" (worst: {where})")
    return {"status": "exact" if exact else "mismatch", "detail": detail}


def sweep_vlms(model_types: list[str]) -> list[dict]:
    """``sweep_one`` for each type on this rank (rank 0's view plus the ranks' agreement)."""
    return sweep_many(model_types, sweep_one)


# What is left refused, grouped by cause: (a phrase of the refusal message, the cause as docs/models.md states it)
CAUSES = (
    ("VLMs built as model.language_model", "not built as model.language_model + model.<vision tower>"),
    ("passed [", "the VLM passes its language model an input ds_seqpar cannot cut to this rank's tokens"),
    ("image block mask", "image tokens attend to each other bidirectionally (token_type_ids)"),
    ("use_bidirectional_attention='vision'", "image tokens attend to each other bidirectionally (Gemma 4)"),
    (
        "sees later tokens",
        "the model's own mask lets tokens see later tokens (the mask probe: a bidirectional connector)",
    ),
    (
        "not one of the routed DSA layers",
        "DeepSeek sparse attention (index_topk) in a layer without a DSA adapter",
    ),
    ("failed on a probe", "the text-only probe when wrapping fails (the family's own error, in the detail)"),
    ("output_router_logits=True", "the MoE load-balancing loss (output_router_logits=True)"),
    (
        "built an attention mask",
        "the VLM builds its own attention mask from an input ds_seqpar does not honour",
    ),
)


def refusal_cause(detail: str) -> str:
    from benchmarks.model_sweep import refusal_cause as text_cause

    for phrase, cause in CAUSES:
        if phrase in detail:
            return cause
    return text_cause(detail)


def _grouped(rows: list[dict]) -> list[str]:
    groups: dict[str, list[str]] = {}
    for r in rows:
        if r["status"] in ("refused", "skipped", "error"):
            cause = (
                refusal_cause(r["detail"])
                if r["status"] == "refused"
                else f"{r['status']}: {r['detail'][:110]}"
            )
            groups.setdefault(cause, []).append(r["type"])
    lines = ["### Left refused or skipped, by cause", "", "| cause | types |", "|---|---|"]
    for cause, types in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append(f"| {cause.replace('|', '/')} | {len(types)}: {', '.join(f'`{t}`' for t in types)} |")
    return [*lines, ""]


def section_markdown(rows: list[dict], seconds: float, command: str) -> list[str]:
    """The lines of docs/models.md's vision-language section."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as NAMES

    from benchmarks.model_sweep import _versions
    from benchmarks.vlm_tiny import IMAGE, PATCH

    v = _versions()
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    lines = [
        SECTION,
        "",
        f"Generated by `{command}` on {time.strftime('%Y-%m-%d')} (do not edit by hand): every model type of",
        f"transformers {v['transformers']}'s image-text-to-text auto mapping, as a tiny random model (text: 2 layers,",
        f"hidden 64; vision: 2 blocks, {IMAGE} x {IMAGE} images in {PATCH} x {PATCH} patches; `benchmarks/vlm_tiny.py`),",
        "trained one step (fp32) on one row of text with two images (and a video where the family takes one; the",
        "placeholder counts from the model's own feature functions) in one process and as `SeqParVisionLM` on",
        f"{WORLD} gloo ranks (U {ULYSSES} x R {WORLD // ULYSSES}, {LAYOUT}); the detail names the `TowerRule` that",
        "split the vision tower over the ranks, or `whole` (run whole on every rank). The result classes are the",
        "text sweep's;",
        "`skipped` here also means the family's pixel inputs could not be built generically. Family fixes:",
        "`VLM_OVERRIDES` in `benchmarks/vlm_tiny.py` (Gemma 4 is swept as its larger models are configured,",
        "`use_bidirectional_attention='vision'`). torch",
        f"{v['torch']}, deepspeed {v['deepspeed']}, ds_seqpar {v['ds_seqpar']}, Python {v['python']};"
        f" {len(rows)} types in {seconds:.0f} s.",
        "",
        "| result | types |",
        "|---|---|",
        *(f"| {s} | {n} |" for s, n in counts.items()),
        "",
        *_grouped(rows),
        "### Every vision-language type",
        "",
        "| type | class | result | detail |",
        "|---|---|---|---|",
    ]
    for r in rows:
        detail = r["detail"].replace("|", "\\|")
        lines.append(f"| `{r['type']}` | `{NAMES.get(r['type'], '?')}` | {r['status']} | {detail} |")
    return lines


def write_section(path: Path, lines: list[str]) -> None:
    """Replace docs/models.md from ``SECTION`` to the end (the text sweep's part above is kept)."""
    text = path.read_text() if path.exists() else ""
    head = text.split("\n" + SECTION, 1)[0].rstrip("\n")
    path.write_text((head + "\n\n" if head else "") + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("types", nargs="*", help="model types (default: every image-text-to-text type)")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write docs/models.md")
    parser.add_argument("--out", default=str(ROOT / "docs" / "models.md"))
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "vlm_models.json"))
    args = parser.parse_args(argv)

    from benchmarks.model_sweep import _versions
    from benchmarks.vlm_tiny import VLM_TYPES
    from tests.helpers.harness import DistPool

    types = args.types or VLM_TYPES
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    rows: list[dict] = []
    with DistPool(WORLD, timeout=300) as pool:  # one spawned group for every type
        for i in range(0, len(types), 8):
            batch = types[i : i + 8]
            rows += pool.run(sweep_vlms, batch)[0]
            for r in rows[-len(batch) :]:
                print(f"{r['type']:<28} {r['status']:<9} {r['detail']}", flush=True)
    seconds = time.perf_counter() - start
    summary = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    print(f"vlm_sweep: {summary} in {seconds:.0f} s", flush=True)
    if not args.no_write:
        command = "python -m benchmarks.model_sweep --multimodal" + "".join(f" {t}" for t in args.types)
        write_section(Path(args.out), section_markdown(rows, seconds, command))
        Path(args.json).write_text(json.dumps({"versions": _versions(), "rows": rows}, indent=1) + "\n")
        print(f"vlm_sweep: wrote {args.out} and {args.json}")
    return 1 if summary["mismatch"] else 0


if __name__ == "__main__":
    sys.exit(main())
