"""Every causal-LM type of the installed transformers under ds_seqpar: exact, refused, or skipped.

For each model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` a tiny random model is built from its
config (``benchmarks/tiny_configs.py``: 2 layers, hidden 64, 4 heads / 2 K/V heads, sliding windows of
8 tokens), and on 4 gloo ranks (U 2 x R 2, zigzag) one forward and backward of a 2 x 64 batch runs
twice: the plain model in one process (its own loss from ``labels``) and ``SeqParCausalLM`` (the
SP-group loss; every parameter's gradient summed over the SP ranks). Each type ends as

    exact      loss and every gradient within 1e-5 relative of the plain model (a gradient below 1 % of
               the whole gradient's norm, e.g. a key bias's, which the softmax cancels, relative to that 1 %)
    refused    ds_seqpar raised UnsupportedModelError, naming what it cannot honour
    skipped    the tiny plain model could not be built or run on text (the reason)
    mismatch   anything else that ran: a silent wrong result, which fails the sweep
    error      ds_seqpar failed with another exception (not silent, but not a clean refusal: to be fixed)

Usage::

    python -m benchmarks.model_sweep                      # all types -> docs/models.md + results JSON
    python -m benchmarks.model_sweep llama gemma2 --no-write
    python -m benchmarks.model_sweep --multimodal [TYPE ...]   # vision-language types: benchmarks/vlm_sweep.py

Exit status 1 if any type is a mismatch.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

TOLERANCE = 1e-5
WORLD, ULYSSES, LAYOUT = 4, 2, "zigzag"
BATCH, SEQ_LEN = 2, 64
GRAD_FLOOR = 1e-2  # a gradient smaller than this fraction of the whole gradient is judged against that
ROOT = Path(__file__).resolve().parents[1]

_MESH: dict = {}


def _mesh():
    from ds_seqpar import SeqParMesh

    if "mesh" not in _MESH:
        world = dist.get_world_size()
        section = {"size": world, "ulysses_degree": ULYSSES, "ring": {"layout": LAYOUT}}
        _MESH["mesh"] = SeqParMesh.from_config(section)
    return _MESH["mesh"]


def _first_line(exc: BaseException, limit: int = 240) -> str:
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reference(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The plain model's own loss (labels = ids), or the token-mean cross-entropy of its logits."""
    out = model(input_ids=ids, labels=ids, use_cache=False)
    if getattr(out, "loss", None) is not None:
        return out.loss
    logits = out.logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def sweep_one(model_type: str, seed: int = 0) -> dict:
    """On every rank: build, run the plain model and the SP model, compare (see the module docstring)."""
    from benchmarks.tiny_configs import TinyBuildError, build_tiny_model
    from ds_seqpar import SeqParCausalLM, SeqParConfigError, UnsupportedModelError, shard_batch

    mesh = _mesh()
    try:
        ref = build_tiny_model(model_type, seed=seed)
        vocab = ref.get_output_embeddings().weight.shape[0] if ref.get_output_embeddings() is not None else 96
        ids = torch.randint(0, min(vocab, 96), (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(1))
        model = copy.deepcopy(ref)
        ref_loss = _reference(ref, ids)
        ref_loss.backward()
    except (TinyBuildError, Exception) as exc:  # the plain tiny model itself does not run on text
        return {"status": "skipped", "detail": _first_line(exc)}
    try:
        lm = SeqParCausalLM(model, mesh)
        loss = lm(**shard_batch({"input_ids": ids}, mesh))
        loss.backward()
    except (UnsupportedModelError, SeqParConfigError) as exc:  # what ds_seqpar raises on purpose
        return {"status": "refused", "detail": _first_line(exc)}
    except Exception as exc:
        return {"status": "error", "detail": f"{type(exc).__name__}: {_first_line(exc)}"}
    loss_err = abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-30)
    worst, where = 0.0, ""
    ref_grads = [torch.zeros_like(p) if p.grad is None else p.grad.double() for p in ref.parameters()]
    floor = GRAD_FLOOR * torch.sqrt(sum((g**2).sum() for g in ref_grads)).item()
    for (name, p), g_ref in zip(model.named_parameters(), ref_grads, strict=True):
        grad = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad, group=mesh.group("sp"))  # SP ranks hold partial gradients of one sample
        # relative error; a gradient that is (numerically) zero, e.g. of a key bias, which softmax cancels,
        # is judged against 1 % of the whole gradient's norm instead of its own rounding noise
        err = (grad.double() - g_ref).norm().item() / max(g_ref.norm().item(), floor, 1e-30)
        if err > worst:
            worst, where = err, name
    exact = loss_err <= TOLERANCE and worst <= TOLERANCE
    detail = f"loss {loss_err:.1e}, gradients {worst:.1e}" + ("" if exact else f" (worst: {where})")
    return {"status": "exact" if exact else "mismatch", "detail": detail}


def sweep_many(model_types: list[str], one=None) -> list[dict]:
    """``one`` (default ``sweep_one``) for each type on this rank; rank 0's view plus agreement of the ranks'
    statuses."""
    out = []
    for t in model_types:
        t0 = time.perf_counter()
        res = (one or sweep_one)(t)
        res["seconds"] = round(time.perf_counter() - t0, 2)
        statuses = [None] * dist.get_world_size()
        dist.all_gather_object(statuses, res["status"])
        if len(set(statuses)) > 1:  # ranks disagree: report the worst
            order = ["mismatch", "error", "refused", "skipped", "exact"]
            res = {**res, "status": min(statuses, key=order.index), "detail": f"ranks disagree: {statuses}"}
        out.append({"type": t, **res})
    return out


def _versions() -> dict[str, str]:
    import deepspeed
    import transformers

    import ds_seqpar

    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "ds_seqpar": ds_seqpar.__version__,
        "python": platform.python_version(),
    }


# What is left refused, grouped by cause: (a phrase of the refusal message, the cause as docs/models.md states it)
CAUSES = (
    ("bidirectional (is_causal=False)", "an encoder, not a causal LM: train it with `SeqParMaskedLM`"),
    (
        "is not the next-token cross-entropy",
        "its own loss does not shift the labels (a decoder of an encoder-decoder): `SeqParSeq2SeqLM` for "
        "encoder-decoders",
    ),
    (
        "called transformers' attention interface",
        "attention computed inline, with no routed adapter (decoders of encoder-decoders, XLM, XLNet, CPM-Ant)",
    ),
    (
        "not one of the routed DSA layers",
        "a learned key selection of another kind than DeepSeek's (Kolibri 1.1)",
    ),
    (
        "compressed attention layers",
        "keys compressed by a learned compressor, not one per token (DeepSeek-V4)",
    ),
    ("indexed_attention", "a learned selection of compressed key blocks per query (Qwen4-Exp's QSA)"),
    ("index_topk", "DeepSeek sparse attention in a layer without an adapter"),
    ("block-sparse", "random and banded key blocks chosen over the whole row (BigBird block-sparse)"),
    ("LocalSelfAttention", "LSH buckets and a fixed chunk grid over the whole row (Reformer)"),
    ("dynamic mask attention", "a learned per-key bias with a top-k key selection over the whole row (Doge)"),
    ("recurrent layer", "a recurrent layer without an adapter"),
    (
        "treats a token differently",
        "a token treated differently in a shard, outside the attention (the probe)",
    ),
    (
        "passed position_bias",
        "a learned relative bias over the whole [S, S] passed to the attention (Inkling2)",
    ),
    ("passed attention_mask", "an explicit [S, S] mask passed to the attention"),
    ("Conv1d", "a convolution over the sequence outside a routed layer"),
)


def refusal_cause(detail: str) -> str:
    """The cause of a refusal (``CAUSES``), else its message without the class name."""
    for phrase, cause in CAUSES:
        if phrase in detail:
            return cause
    return detail.split(": ", 1)[-1][:120]


def _left_refused(rows: list[dict]) -> list[str]:
    """Markdown lines: the refused and skipped types grouped by cause, most types first."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        if r["status"] == "refused":
            groups.setdefault(refusal_cause(r["detail"]), []).append(r["type"])
        elif r["status"] == "skipped":
            groups.setdefault(f"skipped: {r['detail'][:100]}", []).append(r["type"])
    lines = ["## Left refused, by cause", "", "| cause | types |", "|---|---|"]
    for cause, types in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        cause = cause.replace("|", "\\|")
        lines.append(f"| {cause} | {len(types)}: {', '.join(f'`{t}`' for t in types)} |")
    return [*lines, ""]


def write_markdown(rows: list[dict], path: Path, seconds: float) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as NAMES

    counts = {
        s: sum(r["status"] == s for r in rows) for s in ("exact", "refused", "skipped", "mismatch", "error")
    }
    v = _versions()
    lines = [
        "# Model families under ds_seqpar",
        "",
        "Generated by `python -m benchmarks.model_sweep` (do not edit by hand): every model type of",
        f"transformers {v['transformers']}'s causal-LM auto mapping, as a tiny random model (2 layers, hidden 64,",
        f"4 heads / 2 K/V heads, sliding windows of 8 tokens), trained one step on a {BATCH} x {SEQ_LEN} batch in",
        f"one process and under ds_seqpar on {WORLD} gloo ranks (U {ULYSSES} x R {WORLD // ULYSSES}, {LAYOUT}).",
        f"`exact`: loss and every parameter gradient within {TOLERANCE:g} relative (a gradient below 1 % of the",
        "whole gradient's norm, such as a key bias's, which the softmax cancels, relative to that 1 %);",
        "`refused`: ds_seqpar raised an `UnsupportedModelError` naming what it cannot honour (when wrapping the",
        "model, before any collective; the checks that need one forward, identically on every rank);",
        "`skipped`: the tiny plain model itself could not be built or run on text-only input; `mismatch` (a",
        "silently wrong result) fails the sweep. How each refusal is detected: [integration.md](integration.md).",
        "",
        f"torch {v['torch']}, deepspeed {v['deepspeed']}, ds_seqpar {v['ds_seqpar']}, Python {v['python']};"
        f" {len(rows)} types in {seconds:.0f} s.",
        "",
        "| result | types |",
        "|---|---|",
        *(f"| {s} | {n} |" for s, n in counts.items()),
        "",
        *_left_refused(rows),
        "## Every type",
        "",
        "| type | class | result | detail |",
        "|---|---|---|---|",
    ]
    for r in rows:
        detail = r["detail"].replace("|", "\\|")
        lines.append(f"| `{r['type']}` | `{NAMES.get(r['type'], '?')}` | {r['status']} | {detail} |")
    from benchmarks.vlm_sweep import SECTION  # the vision-language section (benchmarks/vlm_sweep.py) is kept

    old = path.read_text() if path.exists() else ""
    tail = ["", SECTION + old.split("\n" + SECTION, 1)[1].rstrip("\n")] if "\n" + SECTION in old else []
    path.write_text("\n".join(lines + tail) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--multimodal" in argv:
        from benchmarks.vlm_sweep import main as vlm_main

        return vlm_main([a for a in argv if a != "--multimodal"])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("types", nargs="*", help="model types (default: every causal-LM type)")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write docs/models.md")
    parser.add_argument("--out", default=str(ROOT / "docs" / "models.md"))
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "models.json"))
    args = parser.parse_args(argv)

    from benchmarks.tiny_configs import CAUSAL_LM_TYPES
    from tests.helpers.harness import DistPool

    types = args.types or CAUSAL_LM_TYPES
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    rows: list[dict] = []
    with DistPool(WORLD, timeout=300) as pool:
        for i in range(0, len(types), 8):  # a few types per task: progress output, bounded failures
            batch = types[i : i + 8]
            rows += pool.run(sweep_many, batch)[0]
            for r in rows[-len(batch) :]:
                print(f"{r['type']:<28} {r['status']:<9} {r['detail']}", flush=True)
    seconds = time.perf_counter() - start
    bad = [r for r in rows if r["status"] == "mismatch"]
    summary = {
        s: sum(r["status"] == s for r in rows) for s in ("exact", "refused", "skipped", "mismatch", "error")
    }
    print(f"model_sweep: {summary} in {seconds:.0f} s", flush=True)
    if not args.no_write:
        write_markdown(rows, Path(args.out), seconds)
        Path(args.json).write_text(json.dumps({"versions": _versions(), "rows": rows}, indent=1) + "\n")
        print(f"model_sweep: wrote {args.out} and {args.json}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
