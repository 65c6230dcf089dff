"""The flags of ``python -m ds_seqpar.verify`` and every check that runs before any process group.

``parse_args`` imports the ``--import`` modules (their kernels, schedules, layouts or recurrent layers
register first, so the config can name them), reads the config and the model's ``config.json``, and
resolves the section against the world; every problem raises a ``SeqParConfigError`` (a ``UsageError``
for a flag) that names the value and the fix. Nothing here starts a process or a process group.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
from pathlib import Path
from typing import Any

from ds_seqpar.config import SECTION, load_config
from ds_seqpar.errors import MissingFileError, SeqParConfigError
from ds_seqpar.verify.ds_config import comparison_config

__all__ = ["WEIGHT_PATTERNS", "build_parser", "model_class", "parse_args"]

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.index.json")  # what from_pretrained loads


class _Parser(argparse.ArgumentParser):
    """``error()`` raises ``UsageError`` (reported once by ``user_errors.run_main``) instead of exiting."""

    def error(self, message: str) -> Any:
        from ds_seqpar.user_errors import UsageError

        raise UsageError(f"{self.format_usage().rstrip()}\n{self.prog}: error: {message}")


def build_parser() -> argparse.ArgumentParser:
    """Every flag of ``python -m ds_seqpar.verify``, its default and its help."""
    p = _Parser(
        prog="python -m ds_seqpar.verify",
        description="Is ds_seqpar exact on YOUR model? Runs it for --steps optimizer steps with sequence "
        "parallelism (the config's sequence_parallel section) and without (the plain HF forward on the full "
        "sequence), same weights, data and optimizer, and compares losses and gradients per module.",
        epilog="Plainly invoked it starts sequence_parallel.size ranks through torch.distributed.run; under "
        "torchrun / deepspeed it runs on their ranks. Exit 0: PASS, 1: FAIL, 2: bad input. See docs/verify.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, help="HF model directory (from_pretrained; with --random-init only "
                   "its config.json is read)")  # fmt: skip
    p.add_argument("--ds_config", "--deepspeed_config", dest="ds_config", required=True,
                   help="DeepSpeed JSON with a 'sequence_parallel' section")  # fmt: skip
    p.add_argument("--seq-len", type=int, default=1024, help="tokens of the (random, seeded) sequence")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps compared")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest relative difference (loss per step, gradient per module) that passes")  # fmt: skip
    p.add_argument("--lr", type=float, default=1e-2, help="learning rate of the SGD step both runs take")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the data (and of the weights with --random-init)"
    )
    p.add_argument("--random-init", action="store_true",
                   help="build the model from DIR/config.json with random weights instead of loading them")  # fmt: skip
    p.add_argument(
        "--trust-remote-code", action="store_true", help="allow the model's own code (from_pretrained)"
    )
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE (a module name or a .py file) first, on every rank: code that registers "
                   "your own kernel, schedule, layout or recurrent layer (ds_seqpar.register_*); repeatable")  # fmt: skip
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check everything before any process group. Adds to the namespace: ``section``, ``settings``
    (resolved for ``world``), ``world`` (the launcher's, or the ranks the relaunch will start), ``launched``,
    ``model_config``, ``objective`` (``"causal"`` / ``"masked"``), ``mask_token_id``, ``ds_config_dict`` (the
    DeepSpeed dict both runs follow) and ``notes`` (what verify changed in the config, and why)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_numbers(args, parser)
    _check_model_dir(args, parser)
    for module in args.imports:
        _import_plugin(module, parser)
    section, ds_config = load_config(args.ds_config, int(os.environ.get("WORLD_SIZE", "0")) or None)
    if not section.enabled:
        raise SeqParConfigError(f"{args.ds_config}: {SECTION}.enabled is false; set it to true to verify it")
    args.launched = "WORLD_SIZE" in os.environ
    args.world = (
        int(os.environ["WORLD_SIZE"]) if args.launched else section.size * (section.data_parallel_size or 1)
    )
    args.model_config = _model_config(args)
    args.objective, args.mask_token_id = _objective(args, parser)
    args.settings = section.validate(args.model_config, args.world)  # heads vs U, world vs size
    _refuse_unsupported(args)
    args.section = section
    args.ds_config_dict, args.notes = comparison_config(ds_config, section, args.ds_config)
    if section.size == 1:
        args.notes.append(f"{SECTION}.size is 1: no sequence is split; use size >= 2 to check SP itself")
    _window_note(args)
    return args


def _check_numbers(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.seq_len < 2:
        parser.error(f"--seq-len={args.seq_len}: use at least 2 tokens (the loss predicts the next token)")
    if args.steps < 1:
        parser.error(f"--steps={args.steps}: use at least 1 step")
    if not args.tolerance > 0:
        parser.error(f"--tolerance={args.tolerance}: use a relative difference > 0, e.g. 1e-4")
    if not args.lr > 0:
        parser.error(f"--lr={args.lr}: use a learning rate > 0, e.g. 1e-2")


def _check_model_dir(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--model`` is a directory with a config.json, and with weights unless ``--random-init``."""
    path = Path(args.model)
    if not path.is_dir():
        parser.error(
            f"--model {args.model!r} is not a directory; pass an HF model directory (config.json and weights)"
        )
    if not (path / "config.json").is_file():
        raise MissingFileError(f"--model {args.model!r} has no config.json; pass an HF model directory")
    if not args.random_init and not any(any(path.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise MissingFileError(
            f"--model {args.model!r} has no weights ({', '.join(WEIGHT_PATTERNS)}); pass --random-init to verify "
            "its architecture with random weights, or point --model at a saved model"
        )


def _import_plugin(module: str, parser: argparse.ArgumentParser) -> None:
    """Import ``module``: a dotted module name, or a path to a .py file."""
    if module.endswith(".py"):
        if not os.path.isfile(module):
            parser.error(f"--import {module!r}: no such file; pass a .py file or a module name")
        spec = importlib.util.spec_from_file_location(Path(module).stem, module)
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        return
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module.startswith(exc.name):
            raise  # the module exists; something it imports does not
        parser.error(
            f"--import {module!r}: no such module on sys.path; pass a .py file or an importable module name"
        )


def _model_config(args: argparse.Namespace) -> Any:
    """The HF config of ``--model`` with every dropout probability set to 0 (both runs are deterministic)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    except (ValueError, OSError) as exc:
        raise SeqParConfigError(f"--model {args.model!r}: its config.json cannot be read ({exc})") from None
    for cfg in (config, getattr(config, "text_config", None)):
        for key, value in list(vars(cfg).items()) if cfg is not None else ():
            if "dropout" in key and isinstance(value, float):
                setattr(cfg, key, 0.0)
    max_pos = getattr(config, "max_position_embeddings", None)
    if isinstance(max_pos, int) and args.seq_len > max_pos:
        raise SeqParConfigError(
            f"--seq-len={args.seq_len} exceeds the model's max_position_embeddings={max_pos}; use --seq-len <= {max_pos}"
        )
    return config


def _objective(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[str, int | None]:
    """``("causal", None)`` for a causal LM, ``("masked", mask token id)`` for a masked-LM encoder."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    config, kind = args.model_config, getattr(args.model_config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        parser.error(
            f"--model {args.model!r} (model_type={kind!r}) is an encoder-decoder; verify compares causal and "
            "masked LMs (SeqParSeq2SeqLM is checked by tests/test_seq2seq.py)"
        )
    if kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or kind not in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "causal", None
    mask = getattr(config, "mask_token_id", None)
    if mask is None:
        from transformers import AutoTokenizer

        try:
            mask = AutoTokenizer.from_pretrained(
                args.model, trust_remote_code=args.trust_remote_code
            ).mask_token_id
        except (ValueError, OSError):
            mask = None
    if mask is None:
        parser.error(
            f"--model {args.model!r} is a masked LM without a mask token; set mask_token_id in its config.json"
        )
    return "masked", int(mask)


def model_class(objective: str) -> Any:
    """The transformers auto class of ``objective``: ``AutoModelForCausalLM`` or ``AutoModelForMaskedLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    return AutoModelForMaskedLM if objective == "masked" else AutoModelForCausalLM


def _refuse_unsupported(args: argparse.Namespace) -> None:
    """What ds_seqpar refuses of the model (docs/models.md), on a weightless copy (meta device), so that the
    ranks never start for it. A model whose code cannot be built on the meta device is checked in the ranks."""
    import torch

    from ds_seqpar.integrations.hf_model import refuse_unhonoured_features
    from ds_seqpar.integrations.recurrent_layers import refuse_recurrent_layers

    try:
        with torch.device("meta"):
            skeleton = model_class(args.objective).from_config(
                args.model_config, trust_remote_code=args.trust_remote_code
            )
    except (NotImplementedError, RuntimeError):  # meta tensors refuse some init code; the ranks check again
        return
    refuse_unhonoured_features(skeleton)
    refuse_recurrent_layers(skeleton)


def _window_note(args: argparse.Namespace) -> None:
    """A note when the sequence is too short to exercise the model's sliding window."""
    config = getattr(args.model_config, "text_config", None) or args.model_config
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and 0 < window < 10**8 and args.seq_len <= window:
        args.notes.append(
            f"--seq-len={args.seq_len} <= the model's sliding_window={window}: the window never binds; "
            f"pass --seq-len > {window} to check it"
        )
