"""The flags of ``python -m ds_seqpar.generate`` and every check that runs before any process group.

``parse_args`` reads the DeepSpeed JSON's ``sequence_parallel`` section, the model's ``config.json`` and its
tokenizer, reads and tokenizes the prompts, and resolves the section against the world: a missing file, an
empty prompt, a prompt too long for the model, a sampling flag without ``--do-sample`` or a world that is not
one SP group raises by name with the fix (docs/inference_cli.md).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, NoReturn

from ds_seqpar.cli.args import WEIGHT_PATTERNS, load_tokenizer
from ds_seqpar.config import SECTION, load_config, with_overrides
from ds_seqpar.errors import MissingFileError, SeqParConfigError

__all__ = ["DTYPES", "build_parser", "parse_args", "read_prompts"]

DTYPES = ("float32", "bfloat16", "float16")
SAMPLING_FLAGS = ("temperature", "top_k", "top_p")


class _Parser(argparse.ArgumentParser):
    """``error()`` raises ``UsageError`` (reported once by ``user_errors.run_main``) instead of exiting."""

    def error(self, message: str) -> NoReturn:
        from ds_seqpar.user_errors import UsageError

        raise UsageError(f"{self.format_usage().rstrip()}\n{self.prog}: error: {message}")


def build_parser() -> argparse.ArgumentParser:
    """Every flag of ``python -m ds_seqpar.generate``, its default and its help."""
    from ds_seqpar.integrations.prefill import PREFILL_MODES

    p = _Parser(
        prog="python -m ds_seqpar.generate",
        description="Generate continuations of prompts with a HF causal LM whose prompt is split over the "
        "sequence-parallel ranks (sharded prefill, decoding from the sharded KV cache).",
        epilog="Launch like train.py: torchrun --nproc_per_node N -m ds_seqpar.generate ..., deepspeed --num_gpus N "
        "--module ds_seqpar.generate ..., or python -m ds_seqpar.generate ... --sp-size 1 for one process (on CPU "
        "set OMP_NUM_THREADS=1). See docs/inference_cli.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, help="HF model directory (from_pretrained; its tokenizer too)")
    p.add_argument("--ds_config", "--deepspeed_config", dest="ds_config", required=True,
                   help="DeepSpeed JSON whose 'sequence_parallel' section splits the prompt")  # fmt: skip
    p.add_argument("--prompt-file", required=True,
                   help="a text file (its whole text is one prompt, the final newline removed) or a .jsonl file "
                   "with one {\"prompt\": ...} object per line (each generated on its own)")  # fmt: skip
    p.add_argument(
        "--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (fewer at EOS)"
    )
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (with --do-sample)")
    p.add_argument("--top-k", type=int, default=None, help="top-k sampling (with --do-sample)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling (with --do-sample)")
    p.add_argument("--seed", type=int, default=0,
                   help="torch seed set before each prompt (the weights' seed with --random-init)")  # fmt: skip
    p.add_argument("--out", default=None, help="write one JSON line per prompt to this file")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="the model's dtype")
    p.add_argument("--sp-size", type=int, default=None, help="SP degree, overriding sequence_parallel.size")
    p.add_argument("--prefill-mode", choices=sorted(PREFILL_MODES), default="exact",
                   help="how the prompt's forward runs (ds_seqpar.register_prefill_mode)")  # fmt: skip
    p.add_argument("--random-init", action="store_true",
                   help="the model of DIR/config.json with random weights (directories without weights)")  # fmt: skip
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code")
    p.add_argument("--no-progress", action="store_true", help="print only the continuations on rank 0")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check everything before any process group. Adds ``section``, ``settings``, ``world``,
    ``model_config``, ``tokenizer`` and ``prompts`` (``[(text, token ids)]``) to the namespace."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_numbers(args, parser)
    _check_model_dir(args, parser)
    args.world = int(os.environ.get("WORLD_SIZE", "1"))
    args.section = _section(args, parser)
    args.model_config = _model_config(args)
    _check_world(args)
    args.settings = args.section.validate(args.model_config, args.world)  # heads vs U, the layout's rules
    if args.settings.dynamic_degree:
        raise SeqParConfigError(
            f"{args.ds_config}: {SECTION}.dynamic_degree=true runs batches on groups of ranks; decoding merges over "
            "the whole SP group: set dynamic_degree to false to generate"
        )
    args.tokenizer = load_tokenizer(args)
    texts = read_prompts(args.prompt_file)
    args.prompts = [(text, _tokenize(args, text, i)) for i, text in enumerate(texts)]
    _check_lengths(args)
    _check_out(args, parser)
    return args


def _check_numbers(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--max-new-tokens`` >= 1, the sampling flags in range and only with ``--do-sample``."""
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    if args.sp_size is not None and args.sp_size < 1:
        parser.error(f"--sp-size={args.sp_size} must be >= 1")
    given = [f"--{n.replace('_', '-')}" for n in SAMPLING_FLAGS if getattr(args, n) is not None]
    if given and not args.do_sample:
        parser.error(
            f"{', '.join(given)} only apply when sampling; greedy decoding would ignore them: add --do-sample"
        )
    if args.temperature is not None and not args.temperature > 0:
        parser.error(f"--temperature={args.temperature} must be > 0")
    if args.top_k is not None and args.top_k < 1:
        parser.error(f"--top-k={args.top_k} must be >= 1")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error(f"--top-p={args.top_p} must be in (0, 1]")


def _check_model_dir(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--model`` is a directory with a config.json, and with weights unless ``--random-init``."""
    path = Path(args.model)
    if not path.is_dir():
        parser.error(
            f"--model {args.model!r} is not a directory; pass a HF model directory (what save_pretrained writes)"
        )
    if not (path / "config.json").is_file():
        raise MissingFileError(
            f"--model {args.model}: no config.json in this directory; pass a HF model directory"
        )
    if not args.random_init and not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        raise MissingFileError(
            f"--model {args.model}: no weights in this directory (looked for {', '.join(WEIGHT_PATTERNS)}); fix: a "
            "directory with weights (train.py writes OUTPUT_DIR/hf_model), or --random-init for random weights"
        )


def _section(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    """The config's section with ``--sp-size`` applied; it must be enabled."""
    section, _ = load_config(args.ds_config, args.world)
    if args.sp_size is not None:
        try:
            section = with_overrides(section, {"size": args.sp_size})
        except SeqParConfigError as exc:
            parser.error(f"--sp-size={args.sp_size}: {exc}")
    if not section.enabled:
        raise SeqParConfigError(
            f"{args.ds_config}: {SECTION}.enabled is false; generation under SP needs it on"
        )
    return section


def _model_config(args: argparse.Namespace) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise SeqParConfigError(f"--model {args.model}: its config.json does not load ({exc})") from None


def _check_world(args: argparse.Namespace) -> None:
    """One SP group: every rank generates the same prompts (a data-parallel split is not done here)."""
    size = args.section.size
    if args.world != size:
        raise SeqParConfigError(
            f"{args.ds_config}: {args.world} ranks but {SECTION}.size={size}: generation runs on one SP group; "
            f"fix: launch {size} ranks, or pass --sp-size {args.world}"
        )


def read_prompts(path: str) -> list[str]:
    """The prompts of ``path``: a .jsonl file's ``"prompt"`` strings (blank lines skipped), else the whole text
    with its final newline removed; a missing, undecodable or empty file and an empty prompt raise by name."""
    if not os.path.isfile(path):
        raise MissingFileError(
            f"--prompt-file {path!r} does not exist; pass a text file or a .jsonl of prompts"
        )
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SeqParConfigError(
            f"--prompt-file {path}: not UTF-8 text (byte offset {exc.start}); save it as UTF-8"
        ) from None
    if not path.endswith(".jsonl"):
        prompt = text.removesuffix("\n").removesuffix("\r")
        if not prompt.strip():
            raise SeqParConfigError(
                f"--prompt-file {path}: the prompt is empty; write the prompt's text into it"
            )
        return [prompt]
    prompts = [_jsonl_prompt(path, n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not prompts:
        raise SeqParConfigError(
            f'--prompt-file {path}: no prompts; write one {{"prompt": "..."}} object per line'
        )
    return prompts


def _jsonl_prompt(path: str, number: int, line: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise SeqParConfigError(f"--prompt-file {path}, line {number}: not JSON ({exc.msg})") from None
    prompt = record.get("prompt") if isinstance(record, dict) else None
    if not isinstance(prompt, str) or not prompt.strip():
        raise SeqParConfigError(
            f'--prompt-file {path}, line {number}: needs a non-empty string "prompt"; got {str(record)[:80]!r}'
        )
    return prompt


def _tokenize(args: argparse.Namespace, text: str, index: int) -> list[int]:
    ids = list(args.tokenizer(text)["input_ids"])
    if not ids:
        raise SeqParConfigError(
            f"--prompt-file {args.prompt_file}: prompt {index + 1} ({text[:40]!r}) has no tokens for this tokenizer"
        )
    return ids


def _check_lengths(args: argparse.Namespace) -> None:
    """Prompt + new tokens must fit the model's ``max_position_embeddings`` (positions past it are untrained)."""
    limit = getattr(args.model_config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return
    for i, (_, ids) in enumerate(args.prompts):
        if len(ids) + args.max_new_tokens > limit:
            raise SeqParConfigError(
                f"--prompt-file {args.prompt_file}: prompt {i + 1} has {len(ids)} tokens, + --max-new-tokens "
                f"{args.max_new_tokens} > the model's max_position_embeddings={limit}; fix: a shorter prompt or "
                "fewer new tokens"
            )


def _check_out(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.out is not None and Path(args.out).is_dir():
        parser.error(
            f"--out {args.out!r} is a directory; pass a file path such as {args.out}/generations.jsonl"
        )
