"""xfuser 0.7.0 (xDiT) on the tiny DiT assets: its own USP / CFG / PipeFusion pipeline vs diffusers alone.

Run with PyTorch's launcher, one process per rank (gloo on CPU), after ``bash benchmarks/peers/install.sh``::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 2 -m benchmarks.peers.xfuser_dit \\
        --family pixart --mode usp --ulysses 2 --steps 8 --out /tmp/xfuser_pixart_u2.json

Every rank builds the pipeline from ``assets/tiny-<family>`` (seeded weights, :func:`build_parts`) and
feeds it :func:`make_inputs`; rank 0 first runs the same pipeline with diffusers alone (no xfuser
imported yet) for the one-process latents. The JSON holds the final latents (``<out>.pt`` next to it),
seconds per step, bytes sent per step (``benchmarks/peers/comm_count.py``), the one-process latents'
max abs / rel difference, and the CPU stand-ins used (``benchmarks/peers/xfuser_cpu.py``). A run that
xfuser cannot finish writes the exception and the xfuser frame that raised it instead, and says so.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.peers import comm_count, xfuser_cpu

ROOT = Path(__file__).resolve().parents[2]
TEXT_LEN = 8  # prompt tokens
FAMILIES = {  # family -> (asset, diffusers transformer, diffusers pipeline, xfuser pipeline, guidance)
    "pixart": (
        "tiny-pixart",
        "PixArtTransformer2DModel",
        "PixArtAlphaPipeline",
        "xFuserPixArtAlphaPipeline",
        4.5,
    ),
    "sd3": (
        "tiny-sd3",
        "SD3Transformer2DModel",
        "StableDiffusion3Pipeline",
        "xFuserStableDiffusion3Pipeline",
        7.0,
    ),
    "flux": ("tiny-flux", "FluxTransformer2DModel", "FluxPipeline", "xFuserFluxPipeline", 3.5),
}


def make_inputs(family: str, height: int, width: int, seed: int) -> dict[str, Any]:
    """The pipeline keyword inputs, drawn in this order from ``torch.Generator().manual_seed(seed)``:

    pixart: prompt_embeds [1, 8, 32], negative_prompt_embeds [1, 8, 32] (masks all ones [1, 8]),
    latents [1, 4, H/2, W/2]. sd3: prompt_embeds [1, 8, 32], pooled_prompt_embeds [1, 32],
    negative_prompt_embeds [1, 8, 32], negative_pooled_prompt_embeds [1, 32], latents [1, 4, H/2, W/2].
    flux: prompt_embeds [1, 8, 32], pooled_prompt_embeds [1, 32], latents packed [1, H/4 * W/4, 16].
    All float32 N(0, 1); ``generator`` (same seed) is passed too; the schedulers of the assets draw no noise.
    """
    if height % 4 or width % 4:
        raise ValueError(
            f"make_inputs: height={height} and width={width} must be multiples of 4 (VAE 2 x patch 2)"
        )
    g = torch.Generator().manual_seed(seed)
    h, w = height // 2, width // 2  # the tiny VAE downsamples by 2
    if family == "pixart":
        pe, npe = torch.randn(1, TEXT_LEN, 32, generator=g), torch.randn(1, TEXT_LEN, 32, generator=g)
        mask = torch.ones(1, TEXT_LEN, dtype=torch.long)
        out = {"prompt_embeds": pe, "prompt_attention_mask": mask, "negative_prompt_embeds": npe}
        out["negative_prompt_attention_mask"] = mask.clone()
        out["latents"] = torch.randn(1, 4, h, w, generator=g)
    elif family == "sd3":
        out = {"prompt_embeds": torch.randn(1, TEXT_LEN, 32, generator=g)}
        out["pooled_prompt_embeds"] = torch.randn(1, 32, generator=g)
        out["negative_prompt_embeds"] = torch.randn(1, TEXT_LEN, 32, generator=g)
        out["negative_pooled_prompt_embeds"] = torch.randn(1, 32, generator=g)
        out["latents"] = torch.randn(1, 4, h, w, generator=g)
    elif family == "flux":
        out = {"prompt_embeds": torch.randn(1, TEXT_LEN, 32, generator=g)}
        out["pooled_prompt_embeds"] = torch.randn(1, 32, generator=g)
        out["latents"] = torch.randn(1, (h // 2) * (w // 2), 16, generator=g)
    else:
        raise ValueError(f"make_inputs: family={family!r} is not one of {sorted(FAMILIES)}")
    out["generator"] = torch.Generator().manual_seed(seed)
    return out


def build_parts(family: str, seed: int) -> dict[str, Any]:
    """``transformer``, ``scheduler``, ``vae`` of ``assets/tiny-<family>``: each part built with
    ``Cls.from_config(Cls.load_config(part_dir))`` right after ``torch.manual_seed(seed)``, float32."""
    import diffusers

    asset = ROOT / "assets" / FAMILIES[family][0]
    parts = {}
    for part in ("transformer", "scheduler", "vae"):
        name = "config.json" if part != "scheduler" else "scheduler_config.json"
        cls = getattr(diffusers, json.loads((asset / part / name).read_text())["_class_name"])
        torch.manual_seed(seed)
        parts[part] = cls.from_config(cls.load_config(asset / part))
        if part != "scheduler":
            parts[part] = parts[part].float().eval()
    return parts


def diffusers_pipeline(family: str, seed: int) -> Any:
    """The plain diffusers pipeline (no text encoders or tokenizers: prompts come as embeddings)."""
    import diffusers

    parts = build_parts(family, seed)
    cls = getattr(diffusers, FAMILIES[family][2])
    encoders = {"pixart": ("tokenizer", "text_encoder"), "flux": ("tokenizer", "text_encoder")}
    encoders["flux"] += ("tokenizer_2", "text_encoder_2")
    encoders["sd3"] = tuple(f"{k}{s}" for s in ("", "_2", "_3") for k in ("tokenizer", "text_encoder"))
    return cls(**parts, **dict.fromkeys(encoders[family]))


def call_kwargs(family: str, args: argparse.Namespace, guidance: float) -> dict[str, Any]:
    """Keyword arguments of one generation (inputs from :func:`make_inputs` plus the run's settings)."""
    kw = make_inputs(family, args.height, args.width, args.seed)
    kw.update(height=args.height, width=args.width, num_inference_steps=args.steps, output_type="latent")
    # xfuser's Flux PipeFusion splits the joint sequence at max_sequence_length (its runtime state's
    # max_condition_sequence_length, transformer_flux.py:207), assuming padded T5 prompts: say 8
    kw["max_sequence_length"] = TEXT_LEN
    if family != "flux":
        kw["guidance_scale"] = guidance
    if family == "pixart":
        kw.update(use_resolution_binning=False, negative_prompt=None)
    return kw


def reference_latents(args: argparse.Namespace) -> tuple[torch.Tensor, float]:
    """Final latents of diffusers alone, one process (run before xfuser is imported), and its seconds
    per step (median over steps after the first)."""
    pipe = diffusers_pipeline(args.family, args.seed)
    stamps = _clock(pipe.scheduler)
    kwargs = call_kwargs(args.family, args, FAMILIES[args.family][4])
    stamps.append(time.perf_counter())  # the start; each scheduler call appends its end
    with torch.no_grad():
        out = pipe(**kwargs)
    steps = step_seconds(stamps, [1] * args.steps)
    return out.images.detach().clone(), float(torch.tensor(steps[1:]).median())


def check_args(args: argparse.Namespace, world: int) -> None:
    """Refuse, before any collective, a run whose settings the runner or xfuser would not honour."""
    u, r, c, p = args.ulysses, args.ring, args.cfg, args.pipefusion
    need = {"usp": u * r > 1 and c == 1 and p == 1, "cfg": c == 2, "pipefusion": p > 1}
    if not need[args.mode]:
        raise ValueError(
            f"--mode {args.mode} with ulysses={u} ring={r} cfg={c} pipefusion={p}: usp needs U*R > 1 with "
            "cfg = pipefusion = 1, cfg needs --cfg 2 (U, R, P free: hybrids), pipefusion needs --pipefusion > 1"
        )
    if c not in (1, 2):
        raise ValueError(f"--cfg {c}: classifier-free guidance splits 2 branches, use 1 or 2")
    if u * r * c * p != world:
        raise ValueError(f"ulysses*ring*cfg*pipefusion = {u * r * c * p} != {world} ranks: launch that many")
    if args.family == "flux" and c > 1:
        raise ValueError(
            "--family flux --cfg 2: xfuser's Flux pipeline has no negative-prompt (true CFG) branch, "
            "and the tiny Flux has no guidance embedding; use --cfg 1"
        )
    if 4 % u:
        raise ValueError(f"--ulysses {u}: the tiny transformers have 4 heads; use a divisor of 4")
    if args.steps < 2:
        raise ValueError(
            f"--steps {args.steps}: the time per step is the median over steps after the first; use >= 2"
        )
    if p > 1 and (args.patches is None or args.patches < p):
        raise ValueError(f"--patches {args.patches}: PipeFusion needs patches >= pipefusion degree ({p})")


def _engine(args: argparse.Namespace) -> tuple[Any, Any]:
    """xfuser's engine config for the run (its own argument dataclass; float32 p2p buffers)."""
    from xfuser import xFuserArgs

    engine_args = xFuserArgs(
        model=str(ROOT / "assets" / FAMILIES[args.family][0]),
        ulysses_degree=args.ulysses,
        ring_degree=args.ring,
        use_cfg_parallel=args.cfg == 2,
        pipefusion_parallel_degree=args.pipefusion,
        num_pipeline_patch=args.patches,
        warmup_steps=args.warmup,
        height=args.height,
        width=args.width,
        num_inference_steps=args.steps,
        output_type="latent",
        seed=args.seed,
        attention_backend=args.attention.upper(),
    )
    engine_config, input_config = engine_args.create_config()
    # RuntimeConfig.dtype (xfuser/config/config.py:59) defaults to float16 and sizes PipeFusion's p2p
    # buffers (runtime_state.py:1101): the tiny models run in float32, so say so.
    engine_config.runtime_config.dtype = torch.float32
    return engine_config, input_config


def _clock(sched: Any) -> list[float]:
    """Wrap a scheduler's ``step`` (for xfuser: its wrapper, whose flow-match ``step`` does not call the
    diffusers one): the returned list gets a timestamp per call. ``object.__setattr__`` because xfuser's
    wrapper forwards attribute writes to the scheduler it wraps."""
    stamps: list[float] = []
    step = sched.step

    def timed(*a: Any, **k: Any) -> Any:
        out = step(*a, **k)
        stamps.append(time.perf_counter())
        return out

    object.__setattr__(sched, "step", timed)
    return stamps


def run_xfuser(args: argparse.Namespace) -> dict[str, Any]:
    """One generation by xfuser's parallel pipeline; per-rank latents (or None), step times, bytes."""
    import xfuser
    from xfuser.core.distributed import init_distributed_environment

    xfuser_cpu.after_import()
    init_distributed_environment()
    engine_config, _ = _engine(args)
    pipe = getattr(xfuser, FAMILIES[args.family][3])(
        diffusers_pipeline(args.family, args.seed), engine_config
    )
    stamps = _clock(pipe.module.scheduler)
    kwargs = call_kwargs(args.family, args, FAMILIES[args.family][4])
    dist.barrier()
    before = comm_count.snapshot()
    start = time.perf_counter()
    out = pipe(**kwargs)
    wall = time.perf_counter() - start
    xfuser_cpu.drain()
    sent = comm_count.delta(before)
    latents = None if out is None else out.images.detach().clone()
    return {"latents": latents, "stamps": [start, *stamps], "wall": wall, "sent": sent}


def step_seconds(stamps: list[float], per_step: list[int]) -> list[float]:
    """Durations of the denoising steps from ``[start, t_call_1, ...]``: step i ends at its last
    scheduler call, ``per_step[i]`` calls per step (PipeFusion: 1 in its synchronous warmup steps, one
    per patch after). Empty when the rank made no scheduler calls (or not that many)."""
    if len(stamps) - 1 != sum(per_step):
        return []
    ends, at = [stamps[0]], 0
    for calls in per_step:
        at += calls
        ends.append(stamps[at])
    return [b - a for a, b in itertools.pairwise(ends)]


def calls_per_step(args: argparse.Namespace) -> list[int]:
    """Scheduler calls per denoising step on a rank that steps (PipeFusion's last stage, any rank else)."""
    if args.pipefusion == 1 or args.steps <= args.warmup:
        return [1] * args.steps
    return [1] * args.warmup + [args.patches] * (args.steps - args.warmup)


def _blocker(exc: BaseException) -> dict[str, Any]:
    """The exception and the innermost frames in xfuser (and overall) that raised it."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if "/.peers/xfuser/" in f.filename]
    where = mine[-1] if mine else frames[-1]
    inner = frames[-1]
    return {
        "exception": f"{type(exc).__name__}: {exc}",
        "xfuser_frame": f"{where.filename.split('.peers/')[-1]}:{where.lineno} ({where.name}): {where.line}",
        "innermost_frame": f"{inner.filename.split('site-packages/')[-1]}:{inner.lineno} ({inner.name})",
        "traceback": traceback.format_exception(exc)[-12:],
    }


def summarise(args: argparse.Namespace, ranks: list[dict[str, Any]], ref: torch.Tensor) -> dict[str, Any]:
    """Rank 0's JSON: latents of the returning rank vs one process, time and bytes per step."""
    outs = [r["latents"] for r in ranks if r["latents"] is not None]
    final = outs[0]
    diff = (final - ref).abs().max().item()
    per_rank = [sum(b for b, _ in r["sent"].values()) / args.steps for r in ranks]
    times = [step_seconds(r["stamps"], calls_per_step(args)) for r in ranks]
    medians = [float(torch.tensor(t[1:]).median()) for t in times if len(t) > 1]
    calls: dict[str, list[int]] = {}
    for r in ranks:
        for key, (b, c) in r["sent"].items():
            acc = calls.setdefault(key, [0, 0])
            acc[0], acc[1] = acc[0] + b, acc[1] + c
    return {
        "seconds_per_step": max(medians) if medians else None,
        "step_seconds_per_rank": times,
        "scheduler_calls_per_rank": [len(r["stamps"]) - 1 for r in ranks],
        "wall_seconds_per_rank": [r["wall"] for r in ranks],
        "bytes_per_step": sum(per_rank),
        "bytes_per_step_per_rank": per_rank,
        "calls_total": {k: {"bytes": b, "calls": c} for k, (b, c) in sorted(calls.items())},
        "returning_ranks": [i for i, r in enumerate(ranks) if r["latents"] is not None],
        "returning_ranks_agree": all(torch.equal(o, final) for o in outs),
        "max_abs_diff": diff,
        "max_rel_diff": diff / ref.abs().max().item(),
        "latents_shape": list(final.shape),
    }, final


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=sorted(FAMILIES), required=True)
    ap.add_argument("--mode", choices=("usp", "cfg", "pipefusion"), required=True)
    for name in ("ulysses", "ring", "cfg", "pipefusion"):
        ap.add_argument(f"--{name}", type=int, default=1)
    ap.add_argument(
        "--patches", type=int, default=None, help="PipeFusion patches (xfuser num_pipeline_patch)"
    )
    ap.add_argument(
        "--warmup", type=int, default=1, help="xfuser warmup_steps: PipeFusion's synchronous steps"
    )
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--height", type=int, default=64)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention", choices=("sdpa", "flash"), default="sdpa", help="xfuser attention backend")
    ap.add_argument("--hang-s", type=float, default=240.0, help="record a hang (and where) after this long")
    ap.add_argument("--out", type=Path, required=True)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    check_args(args, world)
    if rank == 0:
        for stale in (args.out, *args.out.parent.glob(f"{args.out.stem}.rank*.json")):
            stale.unlink(missing_ok=True)  # a stale result must not pass for this run's
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # xfuser's init_distributed_environment then only adds its groups
    ref, ref_step = reference_latents(args) if rank == 0 else (None, None)  # the others wait, idle
    dist.barrier()
    from benchmarks.peers import activate

    missing = {k: v for k, v in activate().items() if k in ("xfuser", "distvae", "yunchang") and v}
    if missing:
        raise SystemExit(f"xfuser_dit: {'; '.join(missing.values())}")
    xfuser_cpu.install(flash=args.attention == "flash")
    comm_count.install()
    record = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "world": world,
    }
    record["standins"] = xfuser_cpu.STANDINS + (
        [xfuser_cpu.FLASH_STANDIN] if args.attention == "flash" else []
    )
    timer = _watchdog(args.hang_s, record, args.out, rank)
    try:
        mine = run_xfuser(args)
    except Exception as exc:  # a blocker: say which, where, and stop every rank (torchrun ends the group)
        record.update(status="blocked", rank=rank, **_blocker(exc))
        _write_blocked(args.out, record)
        print(f"[rank {rank}] xfuser cannot run this case: {record['exception']} at {record['xfuser_frame']}")
        os._exit(3)
    ranks: list[Any] = [None] * world
    dist.all_gather_object(ranks, mine)
    timer.cancel()
    if rank == 0:
        result, final = summarise(args, ranks, ref)
        record.update(status="ok", one_process_seconds_per_step=ref_step, **result)
        pt = args.out.with_suffix(".pt")
        torch.save({"latents": final, "reference": ref}, pt)
        record["latents_file"] = str(pt)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(json.dumps({k: record[k] for k in ("seconds_per_step", "bytes_per_step", "max_abs_diff")}))
    dist.barrier()


def _watchdog(seconds: float, record: dict[str, Any], out: Path, rank: int) -> threading.Timer:
    """After ``seconds`` without finishing, record where the main thread is stuck (a hang) and exit."""
    main_id = threading.main_thread().ident

    def fire() -> None:
        stack = traceback.extract_stack(sys._current_frames()[main_id])
        mine = [f for f in stack if "/.peers/xfuser/" in f.filename]
        where = mine[-1] if mine else stack[-1]
        record.update(status="blocked", rank=rank, exception=f"hang: no progress for {seconds:.0f} s")
        record["xfuser_frame"] = (
            f"{where.filename.split('.peers/')[-1]}:{where.lineno} ({where.name}): {where.line}"
        )
        record["traceback"] = traceback.format_list(stack[-12:])
        _write_blocked(out, record)
        print(f"[rank {rank}] xfuser hangs in this case: stuck at {record['xfuser_frame']}", flush=True)
        os._exit(4)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def _write_blocked(out: Path, record: dict[str, Any]) -> None:
    """The first failing rank writes ``out``; later ones write ``out.rank<r>.json``."""
    path = out
    try:
        with open(out, "x") as fh:
            fh.write(json.dumps(record, indent=1) + "\n")
        return
    except FileExistsError:
        path = out.with_suffix(f".rank{record['rank']}.json")
    path.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
