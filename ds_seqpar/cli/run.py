"""``train.py``: long-context fine-tuning of a HuggingFace causal LM with sequence parallelism.

    deepspeed --num_gpus N train.py --ds_config ds_configs/usp_zero3.json [--model PATH] [--data PATH]
    torchrun --nproc_per_node N train.py --ds_config ds_configs/usp_zero3.json ...

Without ``--model`` / ``--data`` it runs the embedded default: the shipped tiny Llama
(``assets/tiny-llama``, random init) learns passkey retrieval at 4096 tokens, where the answer sits
a whole sequence before the question (``ds_seqpar.tasks.passkey``); it prints retrieval accuracy
before and after. ``--objective mlm`` trains a masked-LM encoder instead (default: the shipped tiny
ModernBERT, ``assets/tiny-modernbert``, on the same passkey rows with every answer replaced by the mask
token, ``ds_seqpar.tasks.masking.MaskedAnswers``; with ``--data``, 15 % of the tokens masked per sample by
BERT's rule; accuracy is over the masked tokens). Outputs (``--output-dir``): ``metrics.jsonl`` (one line
per step and per eval), DeepSpeed checkpoints under ``checkpoints/`` every ``--save-every`` steps
(``--resume`` continues from the latest), and the final HF model in ``hf_model/`` (``save_pretrained``,
gathered from ZeRO-3). Every flag and the whole config are checked before any process group starts
(``cli/args.py``).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ds_seqpar.checkpoint_resume import CLIENT_KEY, SampleHistory
from ds_seqpar.cli.args import DEFAULT_TASK_LR, PASSKEYS, model_config, model_path, parse_args
from ds_seqpar.cli.data import batches, datasets
from ds_seqpar.cli.eval_generate import generate_accuracy
from ds_seqpar.cli.evaluation import evaluate, evaluate_heldout
from ds_seqpar.cli.health import StepHealth
from ds_seqpar.cli.heldout import heldout_dataset
from ds_seqpar.cli.log import RunLog, memory_metrics, sparse_metrics
from ds_seqpar.cli.run_dir import check_output_dir, training_flags
from ds_seqpar.cli.vlm.cli import copy_processor_files
from ds_seqpar.cli.vlm.loaders import vlm_dataloader, vlm_even_shares

__all__ = ["main", "max_seq_len_search", "memory_report"]


@dataclass
class _Run:
    """What the training loop works with, set up by :func:`_start`."""

    engine: Any
    mesh: Any
    model: torch.nn.Module
    tokenizer: Any
    train_sets: list[Any]
    eval_loader: Any
    loader_for: Any
    watch: Any
    health: StepHealth
    ckpt_dir: Path
    start: int
    history: Any
    dp: int
    micro: int
    rank: int
    world: int
    flags: dict[str, Any]  # training_flags: what a resume must keep (and the lr it honours)
    heldout_loader: Any = None  # --eval-data's batches (cli/heldout.py), None without it
    generate_set: Any = None  # --eval-generate's passkey rows (cli/eval_generate.py), None without it


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run training; returns a summary (final metrics and output paths) on every rank."""
    # DeepSpeed calls torch.distributed functions that torch 2.13 renamed; one warning per call is noise
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use", category=FutureWarning)
    args = parse_args(argv)
    if args.max_seq_len_search is not None:
        best = max_seq_len_search(args, int(os.environ.get("WORLD_SIZE", str(args.section.size))))
        return {"max_seq_len": best}
    check_output_dir(args)  # a run there is refused without --resume / --overwrite: before any process group
    run = _start(args)
    log = RunLog(args, run.rank, run.start, run.engine)
    _announce(args, run, log)
    first = _evaluations(run)
    log.record({"step": run.start, **first})
    log.say(_eval_line(run.start, first))
    step, last = _train(args, run, log, first)
    if not run.health.healthy:  # the run ended inside a bad streak: neither saved nor exported
        raise run.health.diverged()
    if run.start < args.max_steps:
        _save(run, step)
    if not args.no_export:
        _export(run.engine, run.model, run.tokenizer, Path(args.output_dir) / "hf_model", run.rank)
        if args.vlm_records is not None and run.rank == 0:  # the image / video processors' configs too
            copy_processor_files(str(model_path(args)), str(Path(args.output_dir) / "hf_model"))
    run.watch.close()
    log.close()
    return _summary(args, run, step, first, last)


def _ds_config(args: argparse.Namespace) -> tuple[dict[str, Any], float | None]:
    """The DeepSpeed dict for ``ds_seqpar.initialize`` (the section with the flags' overrides, the lr) and lr."""
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
    return ds_config, lr


def _start(args: argparse.Namespace) -> _Run:
    """torch.distributed, tokenizer, model, data, the DeepSpeed engine (resumed with --resume) and loaders."""
    import torch.distributed as dist

    import ds_seqpar
    from ds_seqpar.comm.step_watch import StepWatch
    from ds_seqpar.integrations.deepspeed import init_distributed

    init_distributed(args.settings.fault_timeout_s)
    rank, out_dir = dist.get_rank(), Path(args.output_dir)
    if args.overwrite:
        _move_old_run(out_dir, rank)
    tokenizer = args.tokenizer  # loaded (and checked) by parse_args
    model = _build_model(args)
    ds_config, lr = _ds_config(args)
    dp = dist.get_world_size() // args.section.size
    micro = int(ds_config.get("train_micro_batch_size_per_gpu", 1))
    train_sets, eval_set = datasets(args, tokenizer, num_train=args.max_steps * micro * dp, model=model)
    optimizer = None
    if "optimizer" not in ds_config:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr or 1e-4, weight_decay=0.0)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    resume = _resume_point(out_dir / "checkpoints") if args.resume else None
    if resume is not None:
        ds_config = resume.configure(ds_config)
    engine, _, _, _ = ds_seqpar.initialize(model=model, config=ds_config, optimizer=optimizer)
    mesh = engine.seqpar_mesh

    def loader_for(dataset: Any, shuffle: bool, drop_last: bool = True) -> Any:
        if args.vlm_records is not None:  # multimodal rows: cli/vlm/loaders.py
            return vlm_dataloader(dataset, mesh, micro, shuffle=shuffle, seed=args.seed, pad_token_id=pad)
        return ds_seqpar.seqpar_dataloader(
            dataset, mesh, micro, shuffle=shuffle, seed=args.seed, pad_token_id=pad, drop_last=drop_last,
            objective=engine.module.objective,
        )  # fmt: skip

    eval_loader = (
        vlm_even_shares(eval_set, mesh, micro, pad)  # multimodal rows: cli/vlm/loaders.py
        if args.vlm_records is not None
        else _eval_loader(eval_set, mesh, micro, pad, engine.module.objective)
    )
    watch = StepWatch()  # a failed, dead or hung rank is named with its step instead of a bare comm error
    flags = {**training_flags(args, ds_config.get("scheduler")), "lr": _configured_lr(ds_config, lr)}
    run = _Run(engine, mesh, model, tokenizer, train_sets, eval_loader, loader_for, watch,
               StepHealth(args.max_bad_steps, _lr_of(engine)), out_dir / "checkpoints", 0,
               SampleHistory.fresh(micro * dp), dp, micro, rank, dist.get_world_size(), flags)  # fmt: skip
    heldout = heldout_dataset(args, tokenizer)
    if heldout is not None:
        run.heldout_loader = _eval_loader(heldout, mesh, micro, pad, engine.module.objective)
    if args.eval_generate:
        run.generate_set = eval_set
    if resume is not None:
        _load(args, run, resume, tokenizer)
    return run


def _eval_loader(dataset: Any, mesh: Any, micro: int, pad: int, objective: str) -> Any:
    """Evaluation batches: each sample once over the dp replicas, the same count on every rank."""
    from ds_seqpar.evaluation import EvenShares

    return EvenShares(dataset, mesh, micro, pad_token_id=pad, objective=objective)


def _evaluations(run: _Run) -> dict[str, float]:
    """The held-out split's eval loss and accuracy, and --eval-data's loss and perplexity (with it)."""
    metrics = evaluate(run.engine, run.eval_loader, run.mesh)
    if run.heldout_loader is not None:
        metrics.update(evaluate_heldout(run.engine, run.heldout_loader, run.mesh))
    if run.generate_set is not None:
        metrics.update(generate_accuracy(run.engine, run.generate_set, run.mesh, run.micro))
    return metrics


def _eval_line(step: int, metrics: dict[str, float]) -> str:
    line = f"step {step}: eval loss {metrics['eval_loss']:.4f}, accuracy {metrics['eval_accuracy']:.3f}"
    if "heldout_loss" in metrics:
        line += f" | held-out loss {metrics['heldout_loss']:.4f}, ppl {metrics['heldout_ppl']:.3f}"
    if "generate_accuracy" in metrics:
        line += (
            f" | generated answers {metrics['generate_accuracy']:.3f} ({metrics['generate_samples']} rows)"
        )
    return line


def _configured_lr(ds_config: dict[str, Any], lr: float | None) -> float | None:
    """The lr this run asks for: ``--lr`` (or the embedded task's), else the config optimizer's."""
    if lr is not None:
        return lr
    params = (
        ds_config.get("optimizer", {}).get("params", {})
        if isinstance(ds_config.get("optimizer"), dict)
        else {}
    )
    return float(params["lr"]) if "lr" in params else None


def _lr_of(engine: Any) -> float:
    return float(engine.optimizer.param_groups[0]["lr"])


def _apply_lr(run: _Run, saved_lr: float | None, tag: str) -> None:
    """This run's lr (``--lr`` or the config's), not the one the loaded optimizer state carries; refused by
    name when an lr scheduler (resumed with its state) would override it."""
    from ds_seqpar.errors import SeqParConfigError

    lr, loaded = run.flags["lr"], _lr_of(run.engine)
    if lr is None:
        return
    if run.engine.lr_scheduler is not None:
        if saved_lr is None or lr == saved_lr:
            return
        raise SeqParConfigError(
            f"--resume from {tag}: the lr changes ({saved_lr!r} -> {lr:g}), but the lr scheduler's state is resumed "
            "and sets the lr itself: resume with the checkpoint's lr, or change the scheduler's params in a new run"
        )
    for group in run.engine.optimizer.param_groups:
        group["lr"] = lr
    if loaded != lr:
        print(f"resume: lr {lr:g} (the checkpoint's optimizer state had {loaded:g})", flush=True)
    run.health.lr = lr


def _move_old_run(out_dir: Path, rank: int) -> None:
    """``--overwrite``: rank 0 moves the old run aside while the others wait."""
    import torch.distributed as dist

    from ds_seqpar.cli.run_dir import move_aside

    if rank == 0:
        moved = move_aside(out_dir)
        if moved is not None:
            print(f"--overwrite: the previous run in {out_dir} was moved to {moved}", flush=True)
    dist.barrier()


def _resume_point(ckpt_dir: Path) -> Any:
    """The newest complete checkpoint (verified against its manifest) and how to load it."""
    from ds_seqpar.checkpoint_manifest import CheckpointError, resume_tag
    from ds_seqpar.checkpoint_resume import prepare_resume

    choice = resume_tag(ckpt_dir)
    if choice.tag is None:
        tags = sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir()) if ckpt_dir.is_dir() else []
        raise CheckpointError(
            f"--resume: no checkpoint to resume under {ckpt_dir} (no tag with a ds_seqpar manifest and no 'latest'; "
            f"directories there: {', '.join(tags) or 'none'}); start a new run with --overwrite"
        )
    return prepare_resume(ckpt_dir, choice.tag)


def _load(args: argparse.Namespace, run: _Run, resume: Any, tokenizer: Any) -> None:
    """Load ``resume`` into the engine; continue the sample history and the metrics; apply this run's lr."""
    from ds_seqpar.checkpoint_manifest import CheckpointError
    from ds_seqpar.checkpoint_resume import resumed_history
    from ds_seqpar.cli.run_dir import check_resumed_flags, truncate_metrics

    try:
        path, client = run.engine.load_checkpoint(str(run.ckpt_dir), tag=resume.tag)
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointError(
            f"--resume: loading checkpoint {run.ckpt_dir / resume.tag} failed ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:300]}); restore its files or start a new run with --overwrite"
        ) from exc
    if path is None:
        raise CheckpointError(f"--resume: DeepSpeed found no checkpoint {resume.tag!r} under {run.ckpt_dir}")
    run.start = int(client["step"])
    saved = dict(client.get(CLIENT_KEY, {}).get("training_flags") or {}) or None
    saved_lr = saved.pop("lr", None) if saved else None
    check_resumed_flags(saved, {k: v for k, v in run.flags.items() if k != "lr"}, resume.tag)
    _apply_lr(run, saved_lr, resume.tag)
    run.history = resumed_history(client, run.start, run.micro * run.dp)
    if args.data is None and run.history.samples(0, args.max_steps) > args.max_steps * run.micro * run.dp:
        run.train_sets, _ = datasets(args, tokenizer, num_train=run.history.samples(0, args.max_steps))
    if run.rank == 0:
        dropped = truncate_metrics(Path(args.output_dir) / "metrics.jsonl", run.start)
        if dropped:
            print(
                f"resume: metrics.jsonl: {dropped} rows after step {run.start} dropped (trained again)",
                flush=True,
            )


def _save(run: _Run, step: int) -> None:
    """Checkpoint ``step{step}``: visible and ``latest`` only once every rank's files are complete and hashed."""
    from ds_seqpar.checkpoint_manifest import save_verified
    from ds_seqpar.checkpoint_resume import client_state

    shape = {"world_size": run.world, "dp_size": run.dp, "sp_size": run.mesh.sp_size}
    state = client_state(step, run.history, micro_batch=run.micro, **shape)
    state[CLIENT_KEY]["training_flags"] = run.flags
    with run.watch.step(step, what="checkpoint save"):
        save_verified(run.engine, run.ckpt_dir, f"step{step}", state, step)


def _announce(args: argparse.Namespace, run: _Run, log: RunLog) -> None:
    """The run's mesh, algorithm and layout (the mesh's own settings), and the memory model's prediction."""
    settings = run.mesh.settings
    log.say(
        f"ds_seqpar: {run.mesh.describe()} | {settings.attention}, layout {settings.ring.layout}, "
        f"S={args.seq_len}, {run.mesh.sp_size} ranks per sequence, lr {run.engine.optimizer.param_groups[0]['lr']:g}, "
        f"output in {Path(args.output_dir)}"
    )
    if run.rank == 0:
        estimate = memory_report(args, run.world)
        log.say(
            f"memory: {run.engine.module.memory.describe()}; predicted peak per rank at S={args.seq_len} "
            f"({estimate.phase}):\n{estimate.table()}"
        )


def _train(args: argparse.Namespace, run: _Run, log: RunLog, first: dict[str, float]) -> tuple[int, dict]:
    """Every phase of the curriculum from ``run.start``; returns the last step and the last evaluation."""
    step, last, phase_start = run.start, first, 0
    for (seq_len, phase_steps), dataset in zip(args.phases, run.train_sets):
        phase_end = phase_start + phase_steps
        if step < phase_end:
            if seq_len != args.seq_len:
                log.say(f"curriculum: steps {step + 1}-{phase_end} at {seq_len} tokens, then {args.seq_len}")
            skip = run.history.skip(phase_start, step, run.micro * run.dp)  # in samples: dp may have changed
            stream = batches(run.loader_for(dataset, shuffle=args.data is not None), skip=skip)
        while step < phase_end:
            step = _step(run, log, next(stream), step)
            if (
                args.save_every
                and step % args.save_every == 0
                and step < args.max_steps
                and run.health.healthy
            ):
                _save(run, step)
            if (args.eval_every and step % args.eval_every == 0) or step == args.max_steps:
                last = _evaluations(run)
                log.record({"step": step, **last})
                run.health.check_eval(step, last)
                log.say(_eval_line(step, last))
        phase_start = phase_end
    return step, last


def _step(run: _Run, log: RunLog, batch: dict[str, Any], step: int) -> int:
    """One optimizer step on ``batch`` and its metrics row; returns the new step count."""
    engine = run.engine
    engine.module.step = step  # sparse.dense_warmup_steps counts optimizer steps
    t0 = time.perf_counter()
    skipped = engine.skipped_steps
    with run.watch.step(step + 1), run.mesh.comm_stats.measure() as comm:
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        value = loss.item()
        verdict = run.health.reduce(
            value, float(engine.module.last_num_tokens), engine.skipped_steps > skipped
        )
    dt = time.perf_counter() - t0
    run.health.judge(step + 1, verdict, batch["seq_len"])  # the same on every rank: all raise together
    tokens = batch["seq_len"] * batch["input_ids"].shape[0] * run.dp
    log.step(
        {
            "step": step + 1,
            "loss": value,
            "lr": _lr_of(engine),
            "tokens_per_s": tokens / dt,
            "seq_len": batch["seq_len"],
            "comm_MiB": comm.total_bytes / 2**20,
            "step_time_s": dt,
            **memory_metrics(loss.device),
            **sparse_metrics(run.mesh),
        }
    )
    return step + 1


def _summary(args: argparse.Namespace, run: _Run, step: int, first: dict, last: dict) -> dict[str, Any]:
    """The run's summary on every rank; rank 0 prints its line."""
    out_dir = Path(args.output_dir)
    summary = {
        "step": step,
        **{f"start_{k}": v for k, v in first.items()},
        **last,
        "output_dir": str(out_dir),
        "metrics": str(out_dir / "metrics.jsonl"),
        "checkpoints": str(run.ckpt_dir),
        "hf_model": None if args.no_export else str(out_dir / "hf_model"),
    }
    if run.rank == 0:
        task = ""
        if args.data is None:
            masked = ", masked answers" if args.objective == "mlm" else ""
            task = f" (passkey retrieval{masked}, chance {1 / PASSKEYS:.3f})"
        elif args.objective == "mlm":
            task = " (masked tokens)"
        print(
            f"done: {step} steps; accuracy {first['eval_accuracy']:.3f} -> {last['eval_accuracy']:.3f}{task}"
            + _generated(first, last)
            + f"; metrics {summary['metrics']}, checkpoints {run.ckpt_dir}"
            + ("" if args.no_export else f", HF model {summary['hf_model']}"),
            flush=True,
        )
    return summary


def _generated(first: dict, last: dict) -> str:
    """The summary's ``--eval-generate`` part: the passkey answered by generation, before and after."""
    if "generate_accuracy" not in last:
        return ""
    return f"; by generation {first['generate_accuracy']:.3f} -> {last['generate_accuracy']:.3f}"


def memory_report(args: argparse.Namespace, world: int, seq_len: int | None = None) -> Any:
    """The memory model's estimate for this run (per rank), from the config, model and world."""
    from ds_seqpar.memory import memory_estimate

    return memory_estimate(
        model_config(args), seq_len or args.seq_len, args.section, **_run_sizes(args, world)
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
    from ds_seqpar.memory import largest_seq_len

    budget = int(args.max_seq_len_search * 2**20)
    multiple = args.settings.input_layout().multiple
    sizes = _run_sizes(args, world)
    best = largest_seq_len(model_config(args), args.section, budget, multiple=multiple, **sizes)
    print(
        f"max-seq-len-search: {args.max_seq_len_search:g} MiB per rank, {world} ranks, memory "
        f"{args.section.memory.model_dump()}: largest --seq-len {best} (a multiple of {multiple})",
        flush=True,
    )
    if best:
        print(memory_report(args, world, best).table(), flush=True)
    return best


def _build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The model of --model (random weights for the embedded task or --random-init), in float32."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForMaskedLM

    config = model_config(args)
    auto = AutoModelForMaskedLM if args.objective == "mlm" else AutoModelForCausalLM
    if args.vlm_records is not None:  # a vision-language model with multimodal --data (cli/vlm)
        auto = AutoModelForImageTextToText
    if args.model is None or args.random_init:
        torch.manual_seed(args.seed)
        return auto.from_config(config, dtype=torch.float32)
    return auto.from_pretrained(
        args.model, config=config, trust_remote_code=args.trust_remote_code, dtype=torch.float32
    )


def _export(engine: Any, model: torch.nn.Module, tokenizer: Any, out_dir: Path, rank: int) -> None:
    """Save the trained model in HF format, gathering ZeRO-3 partitions onto rank 0."""
    if engine.zero_optimization_stage() == 3:
        state = engine._zero3_consolidated_16bit_state_dict()
    else:
        state = engine.module.state_dict()
    if rank == 0:
        # the HF model's entries (a wrapper may hold more references to its modules: SeqParVisionLM's _base)
        state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
        model.save_pretrained(out_dir, state_dict=state)
        tokenizer.save_pretrained(out_dir)
