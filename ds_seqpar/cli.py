"""``train.py``: long-context fine-tuning of a HuggingFace causal LM with sequence parallelism.

    deepspeed --num_gpus N train.py --ds_config ds_configs/usp_zero3.json [--model PATH] [--data PATH]
    torchrun --nproc_per_node N train.py --ds_config ds_configs/usp_zero3.json ...

Without ``--model`` / ``--data`` it runs the embedded default: the shipped tiny Llama
(``assets/tiny-llama``, random init) learns passkey retrieval at 4096 tokens, where the answer sits
a whole sequence before the question (``ds_seqpar.tasks.passkey``); it prints retrieval accuracy
before and after. ``--objective mlm`` trains a masked-LM encoder instead (default: the shipped tiny
ModernBERT, ``assets/tiny-modernbert``, on the same passkey rows with every answer replaced by the mask
token, ``ds_seqpar.tasks.masking.MaskedAnswers``; with ``--data``, 15 % of the tokens masked per sample by
BERT's rule; accuracy is over the masked tokens). Outputs (``--output-dir``): ``metrics.jsonl`` (one line per step and per eval),
DeepSpeed checkpoints under ``checkpoints/`` every ``--save-every`` steps (``--resume`` continues
from the latest), and the final HF model in ``hf_model/`` (``save_pretrained``, gathered from ZeRO-3).

Every flag and the whole config are checked before any process group starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch

from ds_seqpar.config import MissingFileError, SeqParConfigError, load_config, parse_section

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "assets" / "tiny-llama"
DEFAULT_MLM_MODEL = REPO / "assets" / "tiny-modernbert"
OBJECTIVES = ("causal", "mlm")  # --objective: next-token or masked-LM loss
MLM_PROBABILITY = 0.15
DEFAULT_CONFIG = REPO / "ds_configs" / "usp_zero3.json"
DEFAULT_TASK_LR = 3e-3
DEFAULT_CURRICULUM = "1024:400"
PASSKEYS = 16
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
    p = _Parser(
        prog="train.py",
        description="Long-context fine-tuning with ds_seqpar (sequence parallelism under DeepSpeed).",
        epilog="Launch with deepspeed --num_gpus N train.py ... or torchrun --nproc_per_node N train.py ... "
        "(on CPU set OMP_NUM_THREADS=1). See docs/train.md.",
        formatter_class=_HelpFormatter,
    )
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
    p.add_argument(
        "--data",
        default=None,
        help="training text: .jsonl, .txt or a datasets save_to_disk directory (default: passkey task)",
    )
    p.add_argument("--text-field", default="text", help="field holding the text in --data records")
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
        help="continue from the latest checkpoint in OUTPUT_DIR/checkpoints (one saved by another number of "
        "ranks is converted to DeepSpeed's universal checkpoint first)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=100,
        help="evaluate on held-out samples every N steps (0: start and end only)",
    )
    p.add_argument("--eval-samples", type=int, default=16, help="held-out samples per evaluation")
    p.add_argument("--seed", type=int, default=0, help="model init and data seed")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    p.add_argument("--no-export", action="store_true", help="skip the final HF-format export")
    p.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher; ignored"
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check every flag and the config, before any process group exists."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("seq_len", "max_steps", "sp_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.max_seq_len_search is not None and not args.max_seq_len_search > 0:
        parser.error(f"--max-seq-len-search={args.max_seq_len_search:g} must be a budget > 0 MiB per rank")
    if args.save_every < 0 or args.eval_every < 0 or args.eval_samples < 1:
        parser.error("--save-every and --eval-every must be >= 0 and --eval-samples >= 1")
    curriculum = args.curriculum or (
        DEFAULT_CURRICULUM if args.model is None and args.data is None else "none"
    )
    if curriculum == "none":
        args.phases = [(args.seq_len, args.max_steps)]
    else:
        seq, _, steps = curriculum.partition(":")
        if not (seq.isdigit() and steps.isdigit() and int(seq) >= 1 and int(steps) >= 0):
            parser.error(f"--curriculum={curriculum!r}: use SEQ:STEPS (e.g. 1024:400) or none")
        short_steps = min(int(steps), args.max_steps)
        args.phases = [(int(seq), short_steps), (args.seq_len, args.max_steps - short_steps)]
    if args.data is None and min(seq for seq, _ in args.phases) < 2 * PASSKEY_QUESTIONS + PASSKEY_PREFIX + 1:
        parser.error(
            f"the embedded passkey task needs sequences of at least {2 * PASSKEY_QUESTIONS + PASSKEY_PREFIX + 1} tokens "
            f"(--seq-len / --curriculum); got {[seq for seq, _ in args.phases]}"
        )
    if args.rope_scaling is not None:
        kind, _, factor = args.rope_scaling.partition(":")
        try:
            value = float(factor)
        except ValueError:
            value = 0.0
        if kind not in ROPE_TYPES or value <= 1.0:
            parser.error(
                f"--rope-scaling={args.rope_scaling!r}: use TYPE:FACTOR with TYPE in {', '.join(ROPE_TYPES)} and FACTOR > 1, e.g. linear:4"
            )
        args.rope_scaling = {"rope_type": kind, "factor": value}
    for name in ("model", "data"):
        path = getattr(args, name)
        if path is not None and not os.path.exists(path):
            parser.error(f"--{name} {path!r} does not exist")
    section, ds_config = load_config(args.ds_config)
    gas = ds_config.get("gradient_accumulation_steps", 1)
    if gas != 1:  # each loop iteration is one micro batch; --max-steps, metrics and the monitor count steps
        raise SeqParConfigError(
            f"{args.ds_config}: gradient_accumulation_steps={gas!r}: train.py runs one micro batch per optimizer "
            "step; valid: gradient_accumulation_steps=1 (raise train_micro_batch_size_per_gpu instead), or use "
            "SeqParTrainer / ds_seqpar.initialize for accumulation"
        )
    if args.sp_size is not None:
        section = _with_size(section, args.sp_size, parser)
        if "sequence_parallel_size" in ds_config:  # DeepSpeed's own key follows the override
            ds_config["sequence_parallel_size"] = args.sp_size
    if args.memory is not None:
        section = _with_memory(section, args.memory, parser)
    if not section.enabled:
        raise SeqParConfigError(f"{args.ds_config}: sequence_parallel.enabled is false; train.py needs it on")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = _model_config(args)
    _check_objective(args, config, parser)
    section.validate(config, world)  # heads vs U, world vs size: before any process group
    _check_monitor(ds_config, args.ds_config, args.output_dir)
    args.section, args.ds_config_dict = section, ds_config
    return args


MEMORY_SAVINGS = ("activation_checkpointing", "offload", "tiled_mlp", "tiled_norms")


def _with_size(section: Any, size: int, parser: argparse.ArgumentParser) -> Any:
    """``section`` with ``sequence_parallel.size`` set from ``--sp-size`` (validated like the JSON)."""
    try:
        return parse_section({**section.model_dump(exclude_unset=True), "size": size})
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
    dumped = section.model_dump(exclude_unset=True)
    try:
        return parse_section({**dumped, "memory": memory})
    except SeqParConfigError as exc:
        parser.error(f"--memory={choice!r}: {exc}")


def memory_report(args: argparse.Namespace, world: int, seq_len: int | None = None) -> Any:
    """The memory model's estimate for this run (per rank), from the config, model and world."""
    from ds_seqpar.memory import memory_estimate

    return memory_estimate(
        _model_config(args), seq_len or args.seq_len, args.section, **_run_sizes(args, world)
    )


def _run_sizes(args: argparse.Namespace, world: int) -> dict[str, int]:
    """The memory model's keyword arguments that the DeepSpeed config and the world decide."""
    ds = args.ds_config_dict
    half = bool(ds.get("bf16", {}).get("enabled")) or bool(ds.get("fp16", {}).get("enabled"))
    return {
        "world_size": world,
        "zero_stage": int(ds.get("zero_optimization", {}).get("stage", 0)),
        "micro_batch": int(ds.get("train_micro_batch_size_per_gpu", 1)),
        "bytes_per_element": 2 if half else 4,
    }


def max_seq_len_search(args: argparse.Namespace, world: int) -> int:
    """Print and return the largest S (a multiple of the layout's) whose predicted peak fits the budget."""
    from ds_seqpar.layout import SeqLayout, UspLayout
    from ds_seqpar.memory import largest_seq_len

    budget = int(args.max_seq_len_search * 2**20)
    model_config = _model_config(args)
    resolved = args.section.validate(model_config, None)
    u = resolved.resolved_ulysses_degree
    kind, granularity = resolved.ring_layout
    multiple = UspLayout(SeqLayout(kind, resolved.size // u, granularity), u, resolved.ring_pieces).multiple
    best = largest_seq_len(model_config, args.section, budget, multiple=multiple, **_run_sizes(args, world))
    print(
        f"max-seq-len-search: {args.max_seq_len_search:g} MiB per rank, {world} ranks, memory "
        f"{args.section.memory.model_dump()}: largest --seq-len {best} (a multiple of {multiple})",
        flush=True,
    )
    if best:
        print(memory_report(args, world, best).table(), flush=True)
    return best


def model_path(args: argparse.Namespace) -> str | Path:
    """``--model``, else the shipped tiny model of ``--objective``."""
    return args.model or (DEFAULT_MLM_MODEL if args.objective == "mlm" else DEFAULT_MODEL)


def _check_objective(args: argparse.Namespace, config: Any, parser: argparse.ArgumentParser) -> None:
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
    if args.objective == "mlm":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path(args), trust_remote_code=args.trust_remote_code)
        if tokenizer.mask_token_id is None:
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


def _model_config(args: argparse.Namespace) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path(args), trust_remote_code=args.trust_remote_code)
    if args.rope_scaling:
        # transformers 5 reads RoPE settings from config.rope_parameters (rope_scaling is deprecated)
        params = dict(getattr(config, "rope_parameters", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
        params.update(args.rope_scaling)
        if params["rope_type"] == "yarn":
            params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
        config.rope_parameters = params
    return config


def _build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    config = _model_config(args)
    auto = AutoModelForMaskedLM if args.objective == "mlm" else AutoModelForCausalLM
    if args.model is None or args.random_init:
        torch.manual_seed(args.seed)
        return auto.from_config(config, dtype=torch.float32)
    return auto.from_pretrained(
        args.model, config=config, trust_remote_code=args.trust_remote_code, dtype=torch.float32
    )


def _datasets(args: argparse.Namespace, tokenizer: Any, num_train: int) -> tuple[list[Any], Any]:
    """One training dataset per curriculum phase, and the held-out set (at ``--seq-len``); masked per
    sample for ``--objective mlm`` (the held-out set with another seed)."""
    train, held = _token_datasets(args, tokenizer, num_train)
    if args.objective != "mlm":
        return train, held
    from ds_seqpar.tasks.masking import MaskedAnswers, MaskedLMDataset

    if args.data is None:  # the passkey rows: mask the answers, fill them from the far-away passkey
        return [MaskedAnswers(d, mask_token_id=tokenizer.mask_token_id) for d in train], MaskedAnswers(
            held, mask_token_id=tokenizer.mask_token_id
        )

    def masked(data: Any, seed: int) -> MaskedLMDataset:
        return MaskedLMDataset(
            data,
            mask_token_id=tokenizer.mask_token_id,
            vocab_size=len(tokenizer),
            probability=MLM_PROBABILITY,
            special_ids=tokenizer.all_special_ids,
            seed=seed,
        )

    return [masked(d, args.seed * 7 + i) for i, d in enumerate(train)], masked(held, 10**6 + args.seed)


def _token_datasets(args: argparse.Namespace, tokenizer: Any, num_train: int) -> tuple[list[Any], Any]:
    from ds_seqpar.tasks.passkey import PasskeyDataset, PasskeyTask
    from ds_seqpar.tasks.text import PackedTextDataset

    if args.data is None:
        task = PasskeyTask(
            tokenizer, num_questions=PASSKEY_QUESTIONS, num_keys=PASSKEYS, prefix=PASSKEY_PREFIX
        )
        train = [
            PasskeyDataset(task, num_train, seq_len, seed=args.seed * 1_000_003 + 7919 * i)
            for i, (seq_len, _) in enumerate(args.phases)
        ]
        return train, PasskeyDataset(task, args.eval_samples, args.seq_len, seed=10**9 + args.seed)
    train, held = [], None
    for seq_len, _ in args.phases:
        data = PackedTextDataset(args.data, tokenizer, seq_len, args.text_field)
        n_eval = min(args.eval_samples, max(1, len(data) // 10))
        train.append(torch.utils.data.Subset(data, range(len(data) - n_eval)) if len(data) > n_eval else data)
        if seq_len == args.seq_len:
            held = torch.utils.data.Subset(data, range(len(data) - n_eval, len(data)))
    return train, held


def _batches(loader: Any, skip: int) -> Iterator[dict[str, Any]]:
    """Endless batches of ``loader`` (one epoch after another), the first ``skip`` ones dropped (resume)."""
    epoch, index = divmod(skip, len(loader))
    while True:
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            if index:
                index -= 1
                continue
            yield batch
        epoch += 1


# DeepSpeed's monitor sections that need a package: key -> (module to import, what to pip install)
MONITOR_PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "comet": ("comet_ml", "comet_ml>=3.41.0"),
}
MONITOR_KEYS = ("tensorboard", "csv_monitor", "wandb", "comet")
EVENT_PREFIX = "ds_seqpar/"  # metrics.jsonl column X is the monitor event ds_seqpar/X


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


class _Log:
    """Rank-0 progress bar / lines, the metrics file and the DeepSpeed monitor events.

    With a monitor section enabled (``engine.monitor.enabled``), every numeric column X of a metrics
    row (``step`` included) is also written as the event ``ds_seqpar/X`` through
    ``engine.monitor.write_events`` (TensorBoard, CSV, W&B, Comet; DeepSpeed writes on global rank 0
    only), at DeepSpeed's x-axis, ``engine.global_samples``, like its own ``Train/Samples/*`` events
    (W&B drops events at a step below one already logged; Comet's interval counts samples).
    """

    def __init__(self, args: argparse.Namespace, rank: int, start_step: int, engine: Any = None) -> None:
        self.rank = rank
        self.bar = None
        self.file = None
        self.engine = engine if getattr(getattr(engine, "monitor", None), "enabled", False) else None
        if rank != 0:
            return
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.file = open(out / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if not args.no_progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=args.max_steps, initial=start_step, desc="train", dynamic_ncols=True, file=sys.stdout
            )

    def record(self, row: dict[str, Any]) -> None:
        """Append ``row`` to metrics.jsonl and send its numbers to the monitor (rank 0)."""
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        if self.engine is not None and self.rank == 0:
            samples = int(self.engine.global_samples)  # step x train_batch_size (DeepSpeed keeps a float)
            events = [
                (EVENT_PREFIX + key, value, samples)
                for key, value in row.items()
                if isinstance(value, (int, float)) and not isinstance(value, bool)
            ]
            self.engine.monitor.write_events(events)

    def step(self, row: dict[str, Any]) -> None:
        self.record(row)
        if self.rank != 0:
            return
        text = f"loss {row['loss']:.4f} | {row['tokens_per_s']:.0f} tok/s | S {row['seq_len']} | comm {row['comm_MiB']:.1f} MiB"
        for key in ("peak_memory_MiB", "max_rss_MiB"):
            if key in row:
                text += f" | {'peak' if key == 'peak_memory_MiB' else 'max RSS'} {row[key]:.0f} MiB"
        if "sparse_rho_s_max" in row:
            text += f" | sparse density {row['sparse_density']:.3f}, rho_s {row['sparse_rho_s_max']:.2f}"
        if self.bar is not None:
            self.bar.set_postfix_str(text)
            self.bar.update(1)
        else:
            print(f"step {row['step']}: {text}", flush=True)

    def say(self, text: str) -> None:
        if self.rank == 0:
            (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()


def _memory_metrics(device: torch.device) -> dict[str, float]:
    """This rank's memory for the step row: on CUDA ``peak_memory_MiB`` (``max_memory_allocated`` since
    the previous row, then reset; allocator counters, no device sync), elsewhere ``max_rss_MiB`` (the
    process's peak resident set so far, ``getrusage`` ``ru_maxrss``; it never goes down)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
        return {"peak_memory_MiB": peak}
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"max_rss_MiB": rss / (2**20 if sys.platform == "darwin" else 2**10)}


def _sparse_metrics(mesh: Any) -> dict[str, float]:
    """Worst imbalance ratio and mean density over the sparse layers of the last step (sparse_ring only)."""
    import ds_seqpar

    stats = ds_seqpar.sparse_stats(mesh)
    if not stats:
        return {}
    values = list(stats.values())
    stats.clear()  # the next step reports its own layers (dense warm-up steps report none)
    return {
        "sparse_rho_s_max": max(v.rho_s for v in values),
        "sparse_density": sum(v.density for v in values) / len(values),
        "sparse_layers": len(values),
    }


def _evaluate(engine: Any, loader: Any) -> dict[str, float]:
    engine.eval()
    totals = torch.zeros(3)
    for batch in loader:
        res = engine.module.evaluate(**batch)
        totals += torch.stack([res["loss"] * res["count"], res["correct"], res["count"]]).cpu()
    engine.train()
    count = max(totals[2].item(), 1.0)
    return {"eval_loss": totals[0].item() / count, "eval_accuracy": totals[1].item() / count}


def _export(engine: Any, model: torch.nn.Module, tokenizer: Any, out_dir: Path, rank: int) -> None:
    """Save the trained model in HF format, gathering ZeRO-3 partitions onto rank 0."""
    if engine.zero_optimization_stage() == 3:
        state = engine._zero3_consolidated_16bit_state_dict()
    else:
        state = engine.module.state_dict()
    if rank == 0:
        state = {k.removeprefix("model."): v for k, v in state.items()}
        model.save_pretrained(out_dir, state_dict=state)
        tokenizer.save_pretrained(out_dir)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run training; returns a summary (final metrics and output paths) on every rank."""
    # DeepSpeed calls torch.distributed functions that torch 2.13 renamed; one warning per call is noise
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use", category=FutureWarning)
    args = parse_args(argv)
    if args.max_seq_len_search is not None:
        best = max_seq_len_search(args, int(os.environ.get("WORLD_SIZE", str(args.section.size))))
        return {"max_seq_len": best}
    import torch.distributed as dist
    from transformers import AutoTokenizer

    import ds_seqpar
    from ds_seqpar.checkpoint_resume import SampleHistory, client_state, prepare_resume, resumed_history
    from ds_seqpar.comm.step_watch import StepWatch
    from ds_seqpar.integrations.deepspeed import init_distributed

    init_distributed(args.section.fault_timeout_s)
    rank = dist.get_rank()
    out_dir = Path(args.output_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_path(args), trust_remote_code=args.trust_remote_code)
    model = _build_model(args)
    ds_config = dict(args.ds_config_dict)
    ds_config["sequence_parallel"] = args.section.model_dump(
        exclude_unset=True
    )  # re-parsed: keep "unset" unset
    lr = (
        args.lr
        if args.lr is not None
        else (DEFAULT_TASK_LR if args.model is None and args.data is None else None)
    )
    if lr is not None and isinstance(ds_config.get("optimizer"), dict):
        ds_config["optimizer"] = {
            **ds_config["optimizer"],
            "params": {**ds_config["optimizer"].get("params", {}), "lr": lr},
        }
    dp = dist.get_world_size() // args.section.size
    micro = int(ds_config.get("train_micro_batch_size_per_gpu", 1))
    train_sets, eval_set = _datasets(args, tokenizer, num_train=args.max_steps * micro * dp)
    optimizer = None
    if "optimizer" not in ds_config:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr or 1e-4, weight_decay=0.0)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # --resume on another world size: rank 0 converts the checkpoint to DeepSpeed's universal format
    resume = prepare_resume(out_dir / "checkpoints") if args.resume else None
    if resume is not None:
        ds_config = resume.configure(ds_config)
    engine, _, _, _ = ds_seqpar.initialize(model=model, config=ds_config, optimizer=optimizer)
    mesh = engine.seqpar_mesh

    def loader_for(dataset: Any, shuffle: bool, drop_last: bool = True) -> Any:
        return ds_seqpar.seqpar_dataloader(
            dataset,
            mesh,
            micro,
            shuffle=shuffle,
            seed=args.seed,
            pad_token_id=pad,
            drop_last=drop_last,
            objective=engine.module.objective,
        )

    eval_loader = loader_for(eval_set, shuffle=False, drop_last=False)
    watch = StepWatch()  # a failed, dead or hung rank is named with its step instead of a bare comm error
    ckpt_dir = out_dir / "checkpoints"
    start = 0
    history = SampleHistory.fresh(micro * dp)  # samples per step over the run, for the data position
    if resume is not None:
        path, client = engine.load_checkpoint(str(ckpt_dir), tag=resume.tag)
        if path is None:
            raise MissingFileError(f"--resume: no checkpoint under {ckpt_dir}; run without --resume first")
        start = int(client["step"])
        history = resumed_history(client, start, micro * dp)
        if args.data is None and history.samples(0, args.max_steps) > args.max_steps * micro * dp:
            train_sets, _ = _datasets(args, tokenizer, num_train=history.samples(0, args.max_steps))

    def ckpt_state(at: int) -> dict[str, Any]:
        shape = {"world_size": dist.get_world_size(), "dp_size": dp, "sp_size": mesh.sp_size}
        return client_state(at, history, micro_batch=micro, **shape)

    log = _Log(args, rank, start, engine)
    log.say(
        f"ds_seqpar: {mesh.describe()} | {args.section.attention}, layout {args.section.ring_layout[0]}, "
        f"S={args.seq_len}, {mesh.sp_size} ranks per sequence, lr {engine.optimizer.param_groups[0]['lr']:g}, "
        f"output in {out_dir}"
    )
    if rank == 0:
        estimate = memory_report(args, dist.get_world_size())
        log.say(
            f"memory: {engine.module.memory.describe()}; predicted peak per rank at S={args.seq_len} "
            f"({estimate.phase}):\n{estimate.table()}"
        )
    first_eval = _evaluate(engine, eval_loader)
    log.record({"step": start, **first_eval})
    log.say(
        f"step {start}: eval loss {first_eval['eval_loss']:.4f}, accuracy {first_eval['eval_accuracy']:.3f}"
    )
    step, last, phase_start = start, first_eval, 0
    for (seq_len, phase_steps), dataset in zip(args.phases, train_sets):
        phase_end = phase_start + phase_steps
        if step < phase_end:
            if seq_len != args.seq_len:
                log.say(f"curriculum: steps {step + 1}-{phase_end} at {seq_len} tokens, then {args.seq_len}")
            skip = history.skip(phase_start, step, micro * dp)  # in samples: dp may have changed
            batches = _batches(loader_for(dataset, shuffle=args.data is not None), skip=skip)
        while step < phase_end:
            batch = next(batches)
            engine.module.step = step  # sparse.dense_warmup_steps counts optimizer steps
            t0 = time.perf_counter()
            with watch.step(step + 1), mesh.comm_stats.measure() as comm:
                loss = engine(**batch)
                engine.backward(loss)
                engine.step()
            step += 1
            dt = time.perf_counter() - t0
            tokens = batch["seq_len"] * batch["input_ids"].shape[0] * dp
            log.step(
                {
                    "step": step,
                    "loss": loss.item(),
                    "tokens_per_s": tokens / dt,
                    "seq_len": batch["seq_len"],
                    "comm_MiB": comm.total_bytes / 2**20,
                    "step_time_s": dt,
                    **_memory_metrics(loss.device),
                    **_sparse_metrics(mesh),
                }
            )
            if args.save_every and step % args.save_every == 0 and step < args.max_steps:
                engine.save_checkpoint(str(ckpt_dir), tag=f"step{step}", client_state=ckpt_state(step))
            if (args.eval_every and step % args.eval_every == 0) or step == args.max_steps:
                last = _evaluate(engine, eval_loader)
                log.record({"step": step, **last})
                log.say(
                    f"step {step}: eval loss {last['eval_loss']:.4f}, accuracy {last['eval_accuracy']:.3f}"
                )
        phase_start = phase_end
    if start < args.max_steps:
        engine.save_checkpoint(str(ckpt_dir), tag=f"step{step}", client_state=ckpt_state(step))
    if not args.no_export:
        _export(engine, model, tokenizer, out_dir / "hf_model", rank)
    watch.close()
    log.close()
    summary = {
        "step": step,
        **{f"start_{k}": v for k, v in first_eval.items()},
        **last,
        "output_dir": str(out_dir),
        "metrics": str(out_dir / "metrics.jsonl"),
        "checkpoints": str(ckpt_dir),
        "hf_model": None if args.no_export else str(out_dir / "hf_model"),
    }
    if rank == 0:
        print(
            f"done: {step} steps; accuracy {first_eval['eval_accuracy']:.3f} -> {last['eval_accuracy']:.3f}"
            + (
                f" (passkey retrieval{', masked answers' if args.objective == 'mlm' else ''}, chance {1 / PASSKEYS:.3f})"
                if args.data is None
                else " (masked tokens)"
                if args.objective == "mlm"
                else ""
            )
            + f"; metrics {summary['metrics']}, checkpoints {ckpt_dir}"
            + ("" if args.no_export else f", HF model {summary['hf_model']}"),
            flush=True,
        )
    return summary
