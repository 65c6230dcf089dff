"""``train.py``'s flags and configuration: the parser, and every check that runs before any process group.

Every flag, the whole config and the inputs are checked here (``parse_args``), so a bad input fails
before torch.distributed starts, naming the flag, key or file and the fix: the DeepSpeed JSON's batch keys,
the model directory (config.json, tokenizer, weights unless ``--random-init``) and ``--data`` (read,
checked and tokenized once: ``args.data_tokens``, ``ds_seqpar.tasks.text``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, NoReturn

from ds_seqpar.cli.eval_generate import add_eval_generate_flag, check_eval_generate
from ds_seqpar.cli.heldout import add_eval_data_flag, check_eval_data
from ds_seqpar.cli.vlm.cli import check_vlm_data
from ds_seqpar.config import load_config, with_overrides
from ds_seqpar.errors import MissingFileError, SeqParConfigError
from ds_seqpar.tasks.text import PACKINGS

__all__ = [
    "DEFAULT_CONFIG",
    "DEFAULT_MLM_MODEL",
    "DEFAULT_MODEL",
    "build_parser",
    "load_tokenizer",
    "model_config",
    "model_path",
    "parse_args",
]

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "assets" / "tiny-llama"
DEFAULT_MLM_MODEL = REPO / "assets" / "tiny-modernbert"
OBJECTIVES = ("causal", "mlm")  # --objective: next-token or masked-LM loss
MLM_PROBABILITY = 0.15
DEFAULT_CONFIG = REPO / "ds_configs" / "usp_zero3.json"
DEFAULT_TASK_LR = 3e-3
DEFAULT_CURRICULUM = "1024:400"
PASSKEYS = 8
# what a checkpoint of the embedded task records of it (a resume on another version of the task is refused)
PASSKEY_TASK = f"passkey retrieval, {PASSKEYS} passkeys, each asked once per block of {PASSKEYS} rows"
PASSKEY_QUESTIONS = 64
PASSKEY_PREFIX = 8
ROPE_TYPES = ("linear", "dynamic", "yarn")


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default when it has a meaningful one (not None / False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """``error()`` raises ``UsageError`` instead of printing on every rank (``user_errors.run_main`` reports it once)."""

    def error(self, message: str) -> NoReturn:
        from ds_seqpar.user_errors import UsageError

        raise UsageError(f"{self.format_usage().rstrip()}\n{self.prog}: error: {message}")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``train.py`` (every flag, its default and its help)."""
    p = _Parser(
        prog="train.py",
        description="Long-context fine-tuning with ds_seqpar (sequence parallelism under DeepSpeed).",
        epilog="Launch with deepspeed --num_gpus N train.py ... or torchrun --nproc_per_node N train.py ... "
        "(on CPU set OMP_NUM_THREADS=1). See docs/train.md.",
        formatter_class=_HelpFormatter,
    )
    for add in (_model_flags, _data_flags, _parallel_flags, _output_flags):
        add(p)
    return p


def _model_flags(p: argparse.ArgumentParser) -> None:
    """The config, the model and the objective."""
    p.add_argument(
        "--ds_config",
        "--deepspeed_config",
        dest="ds_config",
        default=str(DEFAULT_CONFIG),
        help="DeepSpeed JSON with a 'sequence_parallel' section (--deepspeed_config is an alias)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="HF model directory for from_pretrained (default: shipped tiny Llama, or tiny ModernBERT for "
        "--objective mlm; random init)",
    )
    p.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="causal",
        help="causal: next-token loss of a causal LM; mlm: masked-LM loss of a bidirectional encoder "
        f"(*ForMaskedLM, e.g. ModernBERT; {MLM_PROBABILITY * 100:.0f}%% of --data's tokens masked, the answers "
        "of the embedded passkey rows; default model assets/tiny-modernbert)",
    )
    p.add_argument(
        "--trust-remote-code", action="store_true", help="allow custom model code when loading --model"
    )
    p.add_argument(
        "--random-init",
        action="store_true",
        help="build --model's architecture from its config.json with random weights (directories without "
        "weights, e.g. assets/tiny-minimax)",
    )


def _data_flags(p: argparse.ArgumentParser) -> None:
    """The data, lengths, steps and optimiser overrides."""
    p.add_argument(
        "--data",
        default=None,
        help="training text: .jsonl, .txt or a datasets save_to_disk directory (default: passkey task); for a "
        "vision-language model, a .jsonl of records with images / videos (docs/multimodal_data.md)",
    )
    p.add_argument("--text-field", default="text", help="field holding the text in --data records")
    add_eval_data_flag(p)
    p.add_argument(
        "--packing",
        choices=PACKINGS,
        default="fixed",
        help="how --data becomes rows: fixed (concatenate and cut into rows of --seq-len, every row full) or "
        "balanced (whole documents grouped by the SP degree they need, the rest of a row padding; with "
        "ring.layout 'documents' and dynamic_degree, docs/balance.md)",
    )
    p.add_argument(
        "--seq-len", type=int, default=4096, help="tokens per sequence (split across the SP ranks)"
    )
    p.add_argument("--max-steps", type=int, default=700, help="optimizer steps to train")
    p.add_argument(
        "--curriculum",
        default=None,
        help="train the first STEPS steps at SEQ tokens, then at --seq-len: SEQ:STEPS, or 'none' "
        f"(embedded task default: {DEFAULT_CURRICULUM})",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"learning rate override (default: the config's; {DEFAULT_TASK_LR} for the embedded task)",
    )
    p.add_argument(
        "--rope-scaling",
        default=None,
        help="context extension, TYPE:FACTOR with TYPE in linear, dynamic, yarn (e.g. linear:4)",
    )


def _parallel_flags(p: argparse.ArgumentParser) -> None:
    """Overrides of the sequence_parallel section and the memory model search."""
    p.add_argument(
        "--sp-size",
        type=int,
        default=None,
        help="SP degree P, overriding sequence_parallel.size: the ranks that split one sequence (the world "
        "size must be a multiple; the rest is data parallel)",
    )
    p.add_argument(
        "--memory",
        default=None,
        help="memory savings, overriding sequence_parallel.memory: 'all' (checkpointing + offload + tiled MLP "
        "and norms), 'none', or a comma list of activation_checkpointing, offload, tiled_mlp, tiled_norms "
        "(docs/memory.md)",
    )
    p.add_argument(
        "--max-seq-len-search",
        type=float,
        default=None,
        metavar="BUDGET_MIB",
        help="print the memory model's largest --seq-len whose step fits BUDGET_MIB per rank (with this "
        "config, model, world and --memory), then exit without training",
    )


def _output_flags(p: argparse.ArgumentParser) -> None:
    """Outputs, checkpoints, evaluation and the launcher's own flag."""
    p.add_argument(
        "--output-dir", default="outputs/run", help="metrics, checkpoints and the final HF model go here"
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=100,
        help="save a DeepSpeed checkpoint every N steps (0: only at the end)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in OUTPUT_DIR/checkpoints (checked against its "
        "manifest; one saved by another number of ranks is converted to DeepSpeed's universal checkpoint first)",
    )
    p.add_argument(
        "--max-bad-steps",
        type=int,
        default=10,
        help="stop the run (rc 2, nothing saved or exported) after this many consecutive steps with a non-finite "
        "loss or skipped by DeepSpeed's overflow check",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start a new run in an OUTPUT_DIR that holds one: the old run is moved aside to "
        "OUTPUT_DIR.old-<time> (never deleted); without it (or --resume) such a directory is refused",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=100,
        help="evaluate on held-out samples every N steps (0: start and end only)",
    )
    p.add_argument("--eval-samples", type=int, default=16, help="held-out samples per evaluation")
    add_eval_generate_flag(p)
    p.add_argument("--seed", type=int, default=0, help="model init and data seed")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    p.add_argument("--no-export", action="store_true", help="skip the final HF-format export")
    p.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher; ignored"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check every flag and the config, before any process group exists; ``args.section`` is the
    section (with the flags' overrides) and ``args.settings`` its resolved settings for this world."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_numbers(args, parser)
    args.phases = _phases(args, parser)
    if args.rope_scaling is not None:
        args.rope_scaling = _rope_scaling(args.rope_scaling, parser)
    for name in ("model", "data"):
        path = getattr(args, name)
        if path is not None and not os.path.exists(path):
            parser.error(f"--{name} {path!r} does not exist")
    section, ds_config = _section(args, parser)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    training = args.max_seq_len_search is None  # the search reads only config.json
    _check_model_dir(args)
    config = model_config(args)
    args.vlm_records = check_vlm_data(args, config, model_path(args)) if training else None  # cli/vlm
    tokenizer = load_tokenizer(args) if training or args.objective == "mlm" else None
    _check_objective(args, config, tokenizer, parser)
    if training and args.model is not None and not args.random_init:
        _check_weights(Path(args.model))
    args.settings = section.validate(config, world)  # heads vs U, world vs size: before any process group
    _check_packing(args, parser)
    check_eval_generate(args, parser)
    _check_train_batch(ds_config, args.ds_config, world // args.settings.size)
    _check_monitor(ds_config, args.ds_config, args.output_dir)
    args.section, args.ds_config_dict, args.tokenizer = section, ds_config, tokenizer
    text = training and args.data is not None and args.vlm_records is None
    args.data_tokens = _data_tokens(args, tokenizer) if text else None
    args.eval_tokens = check_eval_data(args, tokenizer, parser) if training else None
    return args


def _check_packing(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--packing balanced`` packs --data's documents into rows split evenly over the SP ranks."""
    if args.packing == "fixed":
        return
    if args.data is None:
        parser.error(
            "--packing balanced packs the documents of --data; the embedded task has none: pass --data"
        )
    size = args.settings.size
    odd = [seq for seq, _ in args.phases if seq % size]
    if odd:
        parser.error(
            f"--packing balanced needs every row length to be a multiple of the SP degree {size}; got {odd} "
            "(--seq-len / --curriculum)"
        )


def _check_numbers(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for name in ("seq_len", "max_steps", "sp_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.max_seq_len_search is not None and not args.max_seq_len_search > 0:
        parser.error(f"--max-seq-len-search={args.max_seq_len_search:g} must be a budget > 0 MiB per rank")
    if args.save_every < 0 or args.eval_every < 0 or args.eval_samples < 1:
        parser.error("--save-every and --eval-every must be >= 0 and --eval-samples >= 1")
    if args.max_bad_steps < 1:
        parser.error(
            f"--max-bad-steps={args.max_bad_steps} must be >= 1 (consecutive bad steps that stop the run)"
        )


def _phases(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[tuple[int, int]]:
    """``[(seq_len, steps), ...]`` of the curriculum (one phase at --seq-len without one)."""
    curriculum = args.curriculum or (
        DEFAULT_CURRICULUM if args.model is None and args.data is None else "none"
    )
    if curriculum == "none":
        phases = [(args.seq_len, args.max_steps)]
    else:
        seq, _, steps = curriculum.partition(":")
        if not (seq.isdigit() and steps.isdigit() and int(seq) >= 1 and int(steps) >= 0):
            parser.error(f"--curriculum={curriculum!r}: use SEQ:STEPS (e.g. 1024:400) or none")
        short_steps = min(int(steps), args.max_steps)
        phases = [(int(seq), short_steps), (args.seq_len, args.max_steps - short_steps)]
    if args.data is None and min(seq for seq, _ in phases) < 2 * PASSKEY_QUESTIONS + PASSKEY_PREFIX + 1:
        parser.error(
            f"the embedded passkey task needs sequences of at least {2 * PASSKEY_QUESTIONS + PASSKEY_PREFIX + 1} tokens "
            f"(--seq-len / --curriculum); got {[seq for seq, _ in phases]}"
        )
    return phases


def _rope_scaling(text: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    kind, _, factor = text.partition(":")
    try:
        value = float(factor)
    except ValueError:
        value = 0.0
    if kind not in ROPE_TYPES or value <= 1.0:
        parser.error(
            f"--rope-scaling={text!r}: use TYPE:FACTOR with TYPE in {', '.join(ROPE_TYPES)} and FACTOR > 1, e.g. linear:4"
        )
    return {"rope_type": kind, "factor": value}


def _section(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Any, dict[str, Any]]:
    """The config's section with --sp-size and --memory applied, and the DeepSpeed dict."""
    section, ds_config = load_config(args.ds_config)
    gas = ds_config.get("gradient_accumulation_steps", 1)
    if gas != 1:  # each loop iteration is one micro batch; --max-steps, metrics and the monitor count steps
        raise SeqParConfigError(
            f"{args.ds_config}: gradient_accumulation_steps={gas!r}: train.py runs one micro batch per optimizer "
            "step; valid: gradient_accumulation_steps=1 (raise train_micro_batch_size_per_gpu instead), or use "
            "SeqParTrainer / ds_seqpar.initialize for accumulation"
        )
    _check_micro_batch(ds_config, args.ds_config)
    if args.sp_size is not None:
        section = _with_size(section, args.sp_size, parser)
        if "sequence_parallel_size" in ds_config:  # DeepSpeed's own key follows the override
            ds_config["sequence_parallel_size"] = args.sp_size
    if args.memory is not None:
        section = _with_memory(section, args.memory, parser)
    if not section.enabled:
        raise SeqParConfigError(f"{args.ds_config}: sequence_parallel.enabled is false; train.py needs it on")
    return section, ds_config


BATCH_KEYS = ("train_micro_batch_size_per_gpu", "train_batch_size")


def _check_micro_batch(ds_config: dict[str, Any], config_path: str) -> None:
    """The micro batch train.py's loader and DeepSpeed use: an integer >= 1 (1 when the JSON has neither
    batch key; DeepSpeed needs one of them)."""
    for key in BATCH_KEYS:
        value = ds_config.get(key)
        if key in ds_config and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SeqParConfigError(
                f"{config_path}: {key}={value!r}: set an integer >= 1; 'auto' is filled in only by the HF "
                "Trainer integration (SeqParTrainer), not by train.py"
            )
    if "train_micro_batch_size_per_gpu" not in ds_config:
        if "train_batch_size" in ds_config:  # DeepSpeed would derive the micro batch the loader does not use
            raise SeqParConfigError(
                f"{config_path}: train_batch_size={ds_config['train_batch_size']} without "
                "train_micro_batch_size_per_gpu; train.py reads the micro batch per rank from "
                "train_micro_batch_size_per_gpu: set it (and drop train_batch_size, which is micro x dp)"
            )
        ds_config["train_micro_batch_size_per_gpu"] = 1


def _check_train_batch(ds_config: dict[str, Any], config_path: str, dp: int) -> None:
    """An explicit ``train_batch_size`` must be micro batch x dp (gradient accumulation is 1), as DeepSpeed
    asserts inside ``deepspeed.initialize``."""
    micro, total = ds_config["train_micro_batch_size_per_gpu"], ds_config.get("train_batch_size")
    if total is not None and total != micro * dp:
        raise SeqParConfigError(
            f"{config_path}: train_batch_size={total} is not train_micro_batch_size_per_gpu={micro} x data "
            f"parallel {dp} (world / sequence_parallel.size); fix: drop train_batch_size or set it to {micro * dp}"
        )


MEMORY_SAVINGS = ("activation_checkpointing", "offload", "tiled_mlp", "tiled_norms")


def _with_size(section: Any, size: int, parser: argparse.ArgumentParser) -> Any:
    """``section`` with ``sequence_parallel.size`` set from ``--sp-size`` (validated like the JSON)."""
    try:
        return with_overrides(section, {"size": size})
    except SeqParConfigError as exc:
        parser.error(f"--sp-size={size}: {exc}")


def _with_memory(section: Any, choice: str, parser: argparse.ArgumentParser) -> Any:
    """``section`` with ``sequence_parallel.memory`` set from ``--memory`` (validated like the JSON)."""
    names = {"all": MEMORY_SAVINGS, "none": ()}.get(choice)
    if names is None:
        names = tuple(n.strip() for n in choice.split(",") if n.strip())
        unknown = [n for n in names if n not in MEMORY_SAVINGS]
        if unknown or not names:
            parser.error(
                f"--memory={choice!r}: unknown saving(s) {unknown}; use all, none or a comma list of "
                f"{', '.join(MEMORY_SAVINGS)}"
            )
    memory = {**section.memory.model_dump(exclude_unset=True), **{n: n in names for n in MEMORY_SAVINGS}}
    if not ({"tiled_mlp", "tiled_norms"} & set(names)):
        memory.pop("mlp_tile_tokens", None)
    try:
        return with_overrides(section, {"memory": memory})
    except SeqParConfigError as exc:
        parser.error(f"--memory={choice!r}: {exc}")


def model_path(args: argparse.Namespace) -> str | Path:
    """``--model``, else the shipped tiny model of ``--objective``."""
    return args.model or (DEFAULT_MLM_MODEL if args.objective == "mlm" else DEFAULT_MODEL)


WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.index.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "*.tiktoken",
)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _check_model_dir(args: argparse.Namespace) -> None:
    """The model directory holds a config.json."""
    path = Path(model_path(args))
    if not (path / "config.json").is_file():
        raise MissingFileError(
            f"--model {path}: no config.json in this directory; fix: pass a HuggingFace model directory "
            "(what save_pretrained writes: config.json, the tokenizer files, the weights), e.g. assets/tiny-llama"
        )


def _check_weights(path: Path) -> None:
    """The model directory holds weights for ``from_pretrained`` (checked without ``--random-init``)."""
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        raise MissingFileError(
            f"--model {path}: no weights in this directory (looked for {', '.join(WEIGHT_PATTERNS)}); fix: "
            "--random-init to train its architecture from config.json with random weights, or a directory "
            "with the weights"
        )


def load_tokenizer(args: argparse.Namespace) -> Any:
    """The tokenizer of the model directory; a directory without one (or one that does not load) is
    refused by name."""
    from transformers import AutoTokenizer

    path = Path(model_path(args))
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError, ImportError, KeyError, TypeError) as exc:
        if not any(next(path.glob(pattern), None) for pattern in TOKENIZER_FILES):
            raise MissingFileError(
                f"--model {path}: no tokenizer in this directory (looked for {', '.join(TOKENIZER_FILES)}); "
                "fix: save the tokenizer of the model it came from there (tokenizer.save_pretrained(DIR) "
                "writes tokenizer.json and tokenizer_config.json)"
            ) from exc
        raise SeqParConfigError(
            f"--model {path}: its tokenizer does not load: {_first_line(exc)}; fix: save it as a fast "
            "tokenizer (tokenizer.json, via tokenizer.save_pretrained(DIR)) or install what the message names"
        ) from exc


def _data_tokens(args: argparse.Namespace, tokenizer: Any) -> Any:
    """``--data`` read, checked and tokenized (every phase packs these tokens); too few for the longest
    phase's rows is refused here, before any process group."""
    from ds_seqpar.tasks.text import load_documents, tokenize_documents

    tokens = tokenize_documents(load_documents(args.data, args.text_field), tokenizer, args.data)
    tokens.require_rows(max(seq for seq, _ in args.phases), tokenizer.eos_token_id)
    return tokens


def _check_objective(
    args: argparse.Namespace, config: Any, tokenizer: Any, parser: argparse.ArgumentParser
) -> None:
    """``--objective`` must fit the model: a masked-LM head for mlm, no encoder-only model for causal."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    kind = getattr(config, "model_type", None)
    if args.objective == "mlm" and kind not in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        parser.error(
            f"--objective mlm: the model at {model_path(args)} (model_type={kind!r}) has no masked-LM class in "
            "transformers; valid: an encoder such as modernbert or bert (assets/tiny-modernbert), or --objective causal"
        )
    if args.objective == "mlm" and tokenizer.mask_token_id is None:
        parser.error(
            f"--objective mlm: the tokenizer at {model_path(args)} has no mask token; set mask_token in its "
            "tokenizer_config.json"
        )
    if (
        args.objective == "causal"
        and kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES
        and kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    ):
        parser.error(
            f"the model at {model_path(args)} (model_type={kind!r}) is a masked-LM encoder, not a causal LM: "
            "pass --objective mlm"
        )


def model_config(args: argparse.Namespace) -> Any:
    """The model's HF config, with --rope-scaling applied."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path(args), trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:  # a malformed config.json (JSON, model_type, fields)
        raise SeqParConfigError(
            f"{Path(model_path(args)) / 'config.json'} does not load as a transformers config: "
            f"{_first_line(exc)}; fix: the config.json that save_pretrained wrote for this model (with "
            "its model_type)"
        ) from exc
    if args.rope_scaling:
        # transformers 5 reads RoPE settings from config.rope_parameters (rope_scaling is deprecated)
        params = dict(getattr(config, "rope_parameters", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
        params.update(args.rope_scaling)
        if params["rope_type"] == "yarn":
            params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
        config.rope_parameters = params
    return config


# DeepSpeed's monitor sections that need a package: key -> (module to import, what to pip install)
MONITOR_PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "comet": ("comet_ml", "comet_ml>=3.41.0"),
}
MONITOR_KEYS = ("tensorboard", "csv_monitor", "wandb", "comet")


def _check_monitor(ds_config: dict[str, Any], config_path: str, output_dir: str) -> None:
    """Check DeepSpeed's monitor sections before any process group, and default their ``output_path``.

    DeepSpeed builds its monitors on rank 0 only, inside ``deepspeed.initialize``: a missing package
    fails there with a bare ImportError while the other ranks wait in a collective. Here every rank
    fails first, naming the key. An empty ``output_path`` (tensorboard, csv_monitor) becomes
    ``--output-dir`` (DeepSpeed's default is the launch directory), so files go to
    ``OUTPUT_DIR/<job_name>/``.
    """
    present = {k: ds_config[k] for k in MONITOR_KEYS if k in ds_config}
    if not present:
        return
    import importlib.metadata
    import importlib.util

    from deepspeed.monitor.config import get_monitor_config
    from packaging.version import Version

    try:
        monitor = get_monitor_config(present)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        keys = ", ".join(present)
        raise SeqParConfigError(
            f"{config_path}: DeepSpeed rejects the monitor section(s) {keys}: {exc}"
        ) from None
    for key, (module, requirement) in MONITOR_PACKAGES.items():
        if not getattr(monitor, key).enabled:
            continue
        found = importlib.util.find_spec(module) is not None
        if found and key == "comet":
            found = Version(importlib.metadata.version("comet_ml")) >= Version("3.41.0")
        if not found:
            raise SeqParConfigError(
                f'{config_path}: "{key}": {{"enabled": true}} needs the {requirement!r} package, which is not '
                f'installed; fix: pip install "{requirement}", or set "{key}.enabled" to false'
            )
    for key in ("tensorboard", "csv_monitor"):
        if getattr(monitor, key).enabled and not getattr(monitor, key).output_path:
            ds_config[key] = {**ds_config[key], "output_path": output_dir}
