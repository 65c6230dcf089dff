"""Passkey retrieval by generation under SP: sharded prefill, then one greedy token, over P gloo ranks.

::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.passkey_generate --model outputs/default/hf_model \\
        --seq-len 4096 8192 16384 32768 --samples 16 --ranks 4

For each length S, ``--samples`` held-out passkey rows of the embedded task (``ds_seqpar.tasks.passkey``
with ``train.py``'s settings: 8 passkeys, 8 copies, 64 questions; seeds ``--seed + i``, far from the
training and ``train.py`` eval seeds; sample i asks passkey ``i mod 8``, so 16 samples ask each one twice).
A row is made ``S + 127`` tokens long and the prompt is its first S tokens: the passkey somewhere in the
first half, filler, and the first ``?`` question as the prompt's last token. ``ds_seqpar.generate`` prefills
the prompt over the SP group (the ``sequence_parallel`` section of ``--ds-config``, size ``--ranks``) in
prefill mode ``--mode`` and picks one token greedily; it is right when it is the passkey. Chance is 1/8.

Per S: accuracy, chance, the mean probability of the right passkey, how many answers were a passkey at
all, and the prefill time (``generate`` with one new token runs the prefill only, then the choice: the
slowest rank's seconds between barriers, median and total over the samples; one short warm-up call first).
Rank 0 prints a markdown table and writes ``benchmarks/results/<--name>.{json,md}``.

Prefill modes: ``--mode`` is a name of ``ds_seqpar.integrations.prefill.PREFILL_MODES`` (``exact``);
``--mode-param KEY=VALUE`` (repeatable) is recorded and handed to ``generate_kwargs``, the one place that
turns a mode and its parameters into ``ds_seqpar.generate`` arguments (``exact`` takes none).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_SEED = 2_000_000_000  # train.py's rows use seeds < 10**8 at its defaults, its eval rows 10**9 + seed
WARMUP_TOKENS = 256

_MODELS: dict[str, Any] = {}  # per rank process: model dir -> HF model
_MESHES: dict[str, Any] = {}  # per rank process: section JSON -> SeqParMesh


def passkey_prompts(
    model_dir: str, seq_len: int, samples: int, seed: int
) -> tuple[torch.Tensor, list[int], int]:
    """``[samples, seq_len]`` prompts (each ending on the first ``?``), their answer token ids, and the number
    of passkeys (chance = 1 / that)."""
    from transformers import AutoTokenizer

    from ds_seqpar.cli.args import PASSKEY_PREFIX, PASSKEY_QUESTIONS, PASSKEYS
    from ds_seqpar.tasks.passkey import PasskeyTask

    task = PasskeyTask(
        AutoTokenizer.from_pretrained(model_dir),
        num_questions=PASSKEY_QUESTIONS, num_keys=PASSKEYS, prefix=PASSKEY_PREFIX,
    )  # fmt: skip
    row_len = seq_len + 2 * PASSKEY_QUESTIONS - 1  # the first "?" lands at seq_len - 1
    prompts, answers = [], []
    for i in range(samples):
        row = task.sample(row_len, torch.Generator().manual_seed(seed + i), key_index=i % PASSKEYS)
        first = int(torch.nonzero(row["input_ids"] == task.question)[0])
        assert first == seq_len - 1, (first, seq_len)
        prompts.append(row["input_ids"][:seq_len])
        answers.append(int(row["labels"][first + 1]))  # HF convention: the label after the "?"
    return torch.stack(prompts), answers, PASSKEYS


def generate_kwargs(mode: str, params: dict[str, str]) -> dict[str, Any]:
    """``ds_seqpar.generate`` arguments for prefill ``mode`` with ``--mode-param`` values ``params``.

    A mode with parameters adds its branch here (e.g. the APB budget); ``exact`` takes none."""
    if params:
        raise SystemExit(f"passkey_generate: --mode {mode} takes no --mode-param (got {sorted(params)})")
    return {"prefill_mode": mode}


def _model(model_dir: str) -> Any:
    if model_dir not in _MODELS:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.eval()
        _MODELS[model_dir] = model
    return _MODELS[model_dir]


def _mesh(section: dict[str, Any], model_config: Any) -> Any:
    key = json.dumps(section, sort_keys=True)
    if key not in _MESHES:
        from ds_seqpar import SeqParMesh

        _MESHES[key] = SeqParMesh.from_config(section, model_config)
    return _MESHES[key]


def _timed(call: Any) -> tuple[Any, float]:
    """``call()``'s result and the slowest rank's seconds between two barriers."""
    dist.barrier()
    start = time.perf_counter()
    out = call()
    seconds = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return out, float(seconds)


def evaluate_length(
    model_dir: str, section: dict[str, Any], prompts: torch.Tensor, answers: list[int], run: dict[str, Any]
) -> dict[str, Any]:
    """On every rank: greedy one-token answers to ``prompts`` under SP; rank 0's dict is the row."""
    import ds_seqpar
    from ds_seqpar import SeqParCausalLM

    hf = _model(model_dir)
    mesh = _mesh(section, hf.config)
    wrapper = SeqParCausalLM(hf, mesh)
    wrapper.eval()
    kwargs = {**generate_kwargs(run["mode"], run["params"]), "max_new_tokens": 1, "do_sample": False}
    kwargs["pad_token_id"] = hf.config.pad_token_id

    def answer(ids: torch.Tensor) -> Any:
        return ds_seqpar.generate(wrapper, ids, **kwargs)

    _timed(lambda: answer(prompts[:1, -WARMUP_TOKENS:]))
    chosen, probs, seconds = [], [], []
    for i in range(0, len(prompts), run["batch"]):
        out, sec = _timed(lambda i=i: answer(prompts[i : i + run["batch"]]))
        chosen += out.sequences[:, -1].tolist()
        want = torch.tensor(answers[i : i + run["batch"]])
        probs += torch.softmax(out.logits[0], dim=-1).gather(1, want[:, None])[:, 0].tolist()
        seconds.append(sec)
    right = [c == a for c, a in zip(chosen, answers, strict=True)]
    keys = set(answers)
    return {
        "seq_len": prompts.shape[1],
        "mesh": f"U{mesh.ulysses_size} x R{mesh.ring_size}, {mesh.settings.ring.layout}",
        "samples": len(prompts),
        "accuracy": sum(right) / len(right),
        "chance": 1 / run["num_keys"],
        "answer_prob": statistics.fmean(probs),
        "any_passkey": sum(c in keys for c in chosen) / len(chosen),
        "prefill_s_median": statistics.median(seconds) / run["batch"],
        "prefill_s_total": sum(seconds),
        "chosen": chosen,
        "answers": answers,
    }


def sp_section(ds_config: str, ranks: int) -> dict[str, Any]:
    """The config's ``sequence_parallel`` section with ``size`` = ``ranks`` (as ``train.py --sp-size``)."""
    section = dict(json.loads(Path(ds_config).read_text())["sequence_parallel"])
    section["size"] = ranks
    return section


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model directory (train.py's hf_model/ export)")
    p.add_argument("--seq-len", type=int, nargs="+", default=[4096], help="prompt lengths S")
    p.add_argument(
        "--samples", type=int, default=16, help="held-out rows per S (a multiple of 8: each passkey)"
    )
    p.add_argument("--ranks", type=int, default=4, help="gloo ranks = SP size")
    p.add_argument("--ds-config", default=str(ROOT / "ds_configs" / "usp_zero3.json"),
                   help="its sequence_parallel section (size set to --ranks)")  # fmt: skip
    p.add_argument("--mode", default="exact", help="prefill mode (ds_seqpar PREFILL_MODES)")
    p.add_argument(
        "--mode-param", action="append", default=[], metavar="KEY=VALUE", help="the mode's parameters"
    )
    p.add_argument("--batch", type=int, default=1, help="prompts per generate call")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="sample i uses seed SEED + i")
    p.add_argument(
        "--name", default="passkey_generate_cpu", help="results file stem under benchmarks/results/"
    )
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds per length before the ranks are stopped"
    )
    args = p.parse_args(argv)
    if any("=" not in kv for kv in args.mode_param):
        p.error("--mode-param takes KEY=VALUE")
    args.params = dict(kv.split("=", 1) for kv in args.mode_param)
    return args


def markdown(args: argparse.Namespace, rows: list[dict], command: str) -> str:
    lines = [
        f"# Passkey retrieval by generation, prefill mode `{args.mode}`",
        "",
        f"`{command}`",
        "",
        f"Model `{args.model}`; {args.ranks} gloo ranks, `sequence_parallel` of `{Path(args.ds_config).name}` "
        f"(size {args.ranks}); params {json.dumps(args.params)}; held-out seeds {args.seed}+i; greedy, 1 new token; "
        "prefill s = the slowest rank's seconds per prompt (median).",
        "",
        "| S | mesh | samples | accuracy | chance | p(answer) | answered a passkey | prefill s (median) | total s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['seq_len']} | {r['mesh']} | {r['samples']} | {r['accuracy']:.3f} | {r['chance']:.3f} | {r['answer_prob']:.3f} | "
        f"{r['any_passkey']:.3f} | {r['prefill_s_median']:.2f} | {r['prefill_s_total']:.1f} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(ROOT))
    from tests.helpers.harness import DistPool

    generate_kwargs(args.mode, args.params)  # a bad parameter fails before any rank starts
    section = sp_section(args.ds_config, args.ranks)
    command = "python -m benchmarks.passkey_generate " + " ".join(sys.argv[1:] if argv is None else argv)
    rows = []
    start = time.perf_counter()
    with DistPool(args.ranks, timeout=args.timeout) as pool:
        for seq_len in args.seq_len:
            prompts, answers, keys = passkey_prompts(args.model, seq_len, args.samples, args.seed)
            run = {"mode": args.mode, "params": args.params, "batch": args.batch, "num_keys": keys}
            row = pool.run(evaluate_length, args.model, section, prompts, answers, run)[0]
            rows.append(row)
            print(
                f"S={seq_len}: accuracy {row['accuracy']:.3f} (chance {row['chance']:.3f}), p(answer) "
                f"{row['answer_prob']:.3f}, prefill {row['prefill_s_median']:.2f} s/prompt, "
                f"{time.perf_counter() - start:.0f} s so far",
                flush=True,
            )
    table = markdown(args, rows, command)
    print(table, flush=True)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        meta = {"command": command, "model": args.model, "ranks": args.ranks, "section": section,
                "mode": args.mode, "params": args.params, "seed": args.seed, "torch": torch.__version__,
                "wall_s": time.perf_counter() - start}  # fmt: skip
        (RESULTS / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        (RESULTS / f"{args.name}.md").write_text(table)
        print(f"passkey_generate: wrote benchmarks/results/{args.name}.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
