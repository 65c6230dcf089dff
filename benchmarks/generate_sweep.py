"""Every causal-LM type the training sweep finds exact, generating under ds_seqpar: exact, refused, or skipped.

For each type that ``benchmarks/model_sweep.py`` reports exact (``benchmarks/results/models.json``), the tiny
random model of ``benchmarks/tiny_configs.py`` generates ``NEW_TOKENS`` greedy tokens from a 2 x ``PROMPT``
prompt twice: HF's own ``model.generate`` in one process (its own cache, its default attention) and
``ds_seqpar.generate`` on 4 gloo ranks (U 2 x R 2, zigzag: sharded prefill, then decoding from the sharded KV
cache). Each type ends as

    exact      every step's logits within 1e-5 of HF's (relative to max(|x|, 1)) and the same tokens
    refused    ds_seqpar raised UnsupportedModelError before any collective, naming what it cannot decode
    skipped    the plain tiny model cannot generate (HF's own generate raised; the reason)
    mismatch   anything else that ran: a silently wrong result, which fails the sweep
    error      ds_seqpar failed with another exception (not silent, but not a clean refusal: to be fixed)

Usage::

    python -m benchmarks.generate_sweep                   # every exact type -> docs/generation_models.md + JSON
    python -m benchmarks.generate_sweep llama gemma2 --no-write

Exit status 1 if any type is a mismatch.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.model_sweep import ROOT, TOLERANCE, _first_line, _mesh, _versions, sweep_many

PROMPT, BATCH, NEW_TOKENS = 42, 2, 12
STATUSES = ("exact", "refused", "skipped", "mismatch", "error")
MODELS_JSON = ROOT / "benchmarks" / "results" / "models.json"


def exact_training_types(path: Path = MODELS_JSON) -> list[str]:
    """The types the training sweep's results report exact."""
    return [r["type"] for r in json.loads(path.read_text())["rows"] if r["status"] == "exact"]


def _prompt(model: torch.nn.Module) -> torch.Tensor:
    emb = model.get_input_embeddings()
    vocab = int(getattr(emb, "num_embeddings", 0) or model.config.get_text_config().vocab_size)
    return torch.randint(3, min(vocab, 96), (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))


def _hf_generate(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model.generate(
        ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True,
        use_cache=True, pad_token_id=0,
    )  # fmt: skip
    return out.sequences, [x.float() for x in out.logits]


def _compare(out, seqs: torch.Tensor, ref_logits: list[torch.Tensor]) -> dict:
    steps = (len(out.logits), len(ref_logits))
    errors = [
        ((a - b).abs() / b.abs().clamp(min=1.0)).max().item()
        for a, b in zip(out.logits, ref_logits, strict=False)
    ]
    worst = max(errors, default=float("inf"))
    at = errors.index(worst) if errors else -1
    same = steps[0] == steps[1] and torch.equal(out.sequences, seqs)
    exact = same and worst <= TOLERANCE
    detail = f"logits {worst:.1e} (step {at})" + ("" if same else f", tokens differ (steps {steps})")
    return {"status": "exact" if exact else "mismatch", "detail": detail}


def generate_one(model_type: str, seed: int = 0) -> dict:
    """On every rank: build, generate with HF and with ds_seqpar, compare (see the module docstring)."""
    import ds_seqpar
    from benchmarks.tiny_configs import build_tiny_model
    from ds_seqpar import SeqParConfigError, UnsupportedModelError

    mesh = _mesh()
    try:
        ref = build_tiny_model(model_type, seed=seed).eval()
        model = copy.deepcopy(ref)
        ids = _prompt(ref)
        with torch.no_grad():
            seqs, ref_logits = _hf_generate(ref, ids)
    except Exception as exc:  # the plain tiny model itself does not generate
        return {"status": "skipped", "detail": _first_line(exc)}
    try:
        out = ds_seqpar.generate(
            model, ids, mesh=mesh, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    except (UnsupportedModelError, SeqParConfigError) as exc:
        return {"status": "refused", "detail": _first_line(exc)}
    except Exception as exc:
        return {"status": "error", "detail": f"{type(exc).__name__}: {_first_line(exc)}"}
    return _compare(out, seqs, ref_logits)


def generate_many(model_types: list[str]) -> list[dict]:
    return sweep_many(model_types, generate_one)


def counts(rows: list[dict]) -> dict[str, int]:
    return {s: sum(r["status"] == s for r in rows) for s in STATUSES}


# What is refused, grouped by cause: (a phrase of the refusal message, the cause)
CAUSES = (
    ("has no decoding from a sharded cache", "a recurrent layer without a decoder (`RECURRENT_DECODERS`)"),
    (
        "computes its attention scores itself",
        "attention scores computed in the layer (ALiBi, inline softmax, Llama 4)",
    ),
    (
        "derives its position ids from the token ids",
        "position ids derived from the token ids (a position rule)",
    ),
    ("does not decode from a sharded cache:", "a family rule of `integrations/decode_rules.py`"),
)


def _by_cause(rows: list[dict]) -> list[str]:
    """Markdown lines: the refused and skipped types grouped by cause, most types first."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        if r["status"] == "refused":
            cause = next(
                (c for phrase, c in CAUSES if phrase in r["detail"]), r["detail"].split(": ", 1)[-1][:120]
            )
            groups.setdefault(cause, []).append(r["type"])
        elif r["status"] == "skipped":
            groups.setdefault(f"skipped: {r['detail'][:100]}", []).append(r["type"])
    lines = ["## Refused and skipped, by cause", "", "| cause | types |", "|---|---|"]
    for cause, types in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append(
            f"| {cause.replace('|', chr(92) + '|')} | {len(types)}: {', '.join(f'`{t}`' for t in types)} |"
        )
    return [*lines, ""]


def write_markdown(rows: list[dict], path: Path, seconds: float) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as NAMES

    v = _versions()
    by_status = {s: [r for r in rows if r["status"] == s] for s in STATUSES}
    lines = [
        "# Model families generating under ds_seqpar",
        "",
        "Generated by `python -m benchmarks.generate_sweep` (do not edit by hand): every type that",
        "[the training sweep](models.md) finds exact, as the same tiny random model, generating",
        f"{NEW_TOKENS} greedy tokens from a {BATCH} x {PROMPT} prompt with HF's own `model.generate` (its own cache) and",
        "with `ds_seqpar.generate` (sharded prefill, then decoding from the sharded KV cache) on",
        "4 gloo ranks (U 2 x R 2, zigzag). `exact`: every step's logits within",
        f"{TOLERANCE:g} relative to max(\\|x\\|, 1) and the same tokens; `refused`: an `UnsupportedModelError`",
        "naming what does not decode, before any collective ([inference.md](inference.md#what-does-not-decode));",
        "`skipped`: HF's own generate fails on the tiny model; `mismatch` (a silently wrong result) fails the sweep.",
        "",
        f"transformers {v['transformers']}, torch {v['torch']}, ds_seqpar {v['ds_seqpar']};"
        f" {len(rows)} types in {seconds:.0f} s.",
        "",
        "| result | types |",
        "|---|---|",
        *(f"| {s} | {len(by_status[s])} |" for s in STATUSES),
        "",
        *_by_cause(rows),
        "## Every type",
        "",
        "| type | class | result | detail |",
        "|---|---|---|---|",
    ]
    for s in STATUSES:
        for r in by_status[s]:
            detail = r["detail"].replace("|", "\\|")
            lines.append(f"| `{r['type']}` | `{NAMES.get(r['type'], '?')}` | {s} | {detail} |")
    path.write_text("\n".join(lines) + "\n")


def _merge(path: Path, rows: list[dict]) -> list[dict]:
    """The rows of an earlier run at ``path`` with ``rows`` replacing theirs (a sweep run in chunks)."""
    if not path.exists():
        return rows
    new = {r["type"]: r for r in rows}
    old = [r for r in json.loads(path.read_text())["rows"] if r["type"] not in new]
    return sorted(old + rows, key=lambda r: r["type"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "types", nargs="*", help="model types (default: every type the training sweep finds exact)"
    )
    parser.add_argument("--no-write", action="store_true", help="print only; write no files")
    parser.add_argument("--merge", action="store_true", help="update these types' rows in the existing JSON")
    parser.add_argument("--out", default=str(ROOT / "docs" / "generation_models.md"))
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "generation_models.json"))
    args = parser.parse_args(argv)

    from tests.helpers.harness import DistPool

    types = args.types or exact_training_types()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    rows: list[dict] = []
    with DistPool(4, timeout=300) as pool:
        for i in range(0, len(types), 8):
            batch = types[i : i + 8]
            rows += pool.run(generate_many, batch)[0]
            for r in rows[-len(batch) :]:
                print(f"{r['type']:<28} {r['status']:<9} {r['detail']}", flush=True)
    seconds = time.perf_counter() - start
    print(f"generate_sweep: {counts(rows)} in {seconds:.0f} s", flush=True)
    if not args.no_write:
        jpath = Path(args.json)
        if args.merge:
            rows = _merge(jpath, rows)
        write_markdown(rows, Path(args.out), seconds)
        jpath.write_text(json.dumps({"versions": _versions(), "rows": rows}, indent=1) + "\n")
        print(f"generate_sweep: wrote {args.out} and {args.json} ({counts(rows)})")
    return 1 if any(r["status"] == "mismatch" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
