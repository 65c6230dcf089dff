"""Markdown tables, PNG plots and ``docs/performance.md`` from the suites' JSON results."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "performance.md"


def _fmt(value, spec: str) -> str:
    if value is None:
        return "–"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def _table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    lines = ["| " + " | ".join(c[0] for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(key), spec) for _, key, spec in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _not_run(rows: list[dict]) -> str:
    seen, lines = set(), []
    for r in rows:
        if r["status"] != "ok" and (r["system"], r.get("H_kv"), r["P"]) not in seen:
            seen.add((r["system"], r.get("H_kv"), r["P"]))
            extra = f", H_kv={r['H_kv']}" if "H_kv" in r else ""
            lines.append(f"- **{r['system']}** (P={r['P']}{extra}): {r['status']}: {r['why']}")
    return ("\nCould not run:\n\n" + "\n".join(lines) + "\n") if lines else ""


def attention_summary(result: dict) -> str:
    """ds_seqpar's default (ulysses_degree auto) against the fastest peer, per case."""
    ok = [r for r in result["rows"] if r["status"] == "ok"]
    lines = [
        "| P | H_kv | S | ds_seqpar auto | efficiency | no-communication reference: efficiency "
        "| fastest peer | ds_seqpar / fastest peer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for world, h_kv, seq_len in sorted({(r["P"], r["H_kv"], r["S"]) for r in ok}):
        case = [r for r in ok if (r["P"], r["H_kv"], r["S"]) == (world, h_kv, seq_len)]
        ours = [r for r in case if r["system"] == "ds_seqpar auto"]
        peers = [r for r in case if r["peer"] not in ("ds_seqpar", "reference")]
        bound = [r for r in case if r["system"] == "reference: no communication"]
        if not ours or not peers:
            continue
        best = min(peers, key=lambda r: r["time_s"])
        lines.append(
            f"| {world} | {h_kv} | {seq_len} | {ours[0]['time_s']:.3f} s | {ours[0]['efficiency']:.3f} | "
            f"{_fmt(bound[0]['efficiency'] if bound else None, '.3f')} | "
            f"{best['system']} {best['time_s']:.3f} s | {ours[0]['time_s'] / best['time_s']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def attention_markdown(result: dict) -> str:
    meta = result["meta"]
    rows = sorted(
        (r for r in result["rows"] if r["status"] == "ok"),
        key=lambda r: (r["P"], r["H_kv"], r["S"], r["time_s"]),
    )
    cols = [
        ("P", "P", "d"),
        ("H_kv", "H_kv", "d"),
        ("S", "S", "d"),
        ("system", "system", "s"),
        ("fwd+bwd (s)", "time_s", ".3f"),
        ("efficiency", "efficiency", ".3f"),
        ("vs ceiling", "vs_ceiling", ".3f"),
        ("vs fastest peer", "vs_fastest_peer", ".3f"),
        ("sent MiB/rank", "sent_MiB", ".1f"),
        ("balance", "balance", ".3f"),
        ("peak MiB/rank", "peak_MiB", ".0f"),
        ("max abs err", "max_abs_err", ".1e"),
    ]
    head = (
        f"Attention layer fwd+bwd, causal, B=1, H=8, D=64, {meta['dtype']}, gloo CPU ranks (1 thread each) on "
        f"{meta['machine']['cores']} cores ({meta['machine']['cpu']}, torch {meta['machine']['torch']}), median of "
        f"{meta['reps']} after a warm-up, slowest rank; every system and both references are timed "
        "round-robin within each case. efficiency = T_limit / T with T_limit = T_single / min(P, cores); "
        "T_single = the 'reference: one process' row (rank 0 alone runs the same kernel on the whole sequence, "
        "all heads): "
        + ", ".join(f"{k}: {v:.3f} s" for k, v in meta["T_single_s"].items())
        + ". vs ceiling = T_ceiling / T, with T_ceiling the 'reference: no communication' row: every rank at "
        "once runs the kernel on its 1/P of the heads and sends nothing, i.e. what the cores deliver together "
        "with free communication; its own efficiency is a practical upper bound for any SP system on this machine. "
        "vs fastest peer < 1 means faster than every peer row of that (P, H_kv, S). "
        "balance = max/mean score pairs per rank. "
        "max abs err: out, dq, dk, dv vs an fp64 single-process reference at S=512.\n\n"
    )
    summary = "Summary: ds_seqpar's default against the fastest peer of each case.\n\n" + attention_summary(
        result
    )
    return summary + "\nAll rows:\n\n" + head + _table(rows, cols) + _not_run(result["rows"])


def e2e_markdown(result: dict) -> str:
    rows = sorted(
        (r for r in result["rows"] if r["status"] == "ok"), key=lambda r: (r["P"], r["S"], r["system"])
    )
    cols = [
        ("P", "P", "d"),
        ("S", "S", "d"),
        ("system", "system", "s"),
        ("step (s)", "time_s", ".3f"),
        ("tokens/s", "tokens_per_s", ".0f"),
        ("peak MiB/rank", "peak_MiB", ".1f"),
        ("first-step loss", "loss", ".6f"),
    ]
    head = (
        f"Training step of {result['meta']['model']}: forward, SP-group loss, backward, gradient all-reduce, AdamW; "
        f"median of {result['meta']['reps']} after a warm-up, slowest rank; peak = resident memory growth during one step, max over ranks.\n\n"
    )
    return head + _table(rows, cols) + _not_run(result["rows"])


def memory_markdown(result: dict) -> str:
    cols = [
        ("system", "peer", "s"),
        ("P", "P", "d"),
        ("largest S within budget", "largest_S", "d"),
        ("vs P=1", "vs_P1", ".2f"),
        ("vs the ALST row of the same savings", "vs_alst", ".2f"),
    ]
    head = (
        f"Largest sequence whose training step ({result['meta']['model']}) stays within "
        f"{result['meta']['budget_MiB_per_rank']:.0f} MiB of peak resident memory growth per rank (S grows by 1.25x per probe, then 3 bisection probes). "
        "`_savings` rows: every memory saving each system ships (ds_seqpar: `sequence_parallel.memory` all on; ALST: "
        "checkpointing, TiledMLP, TiledFusedLogitsLoss). The memory model column is `ds_seqpar.memory_estimate(...)"
        ".step_bytes()` for the same step.\n\n"
    )
    probes = _table(
        sorted(result["rows"], key=lambda r: (r.get("peer", ""), r["P"], r.get("S", 0))),
        [
            ("system", "peer", "s"),
            ("P", "P", "d"),
            ("S", "S", "d"),
            ("peak MiB/rank", "peak_MiB", ".1f"),
            ("memory model MiB", "predicted_MiB", ".1f"),
            ("fits", "fits", ""),
        ],
    )
    return head + _table(result["summary"], cols) + "\nProbes:\n\n" + probes


def _plot_attention(result: dict, path: Path) -> None:
    """One panel per (P, H_kv): bars of T / T_ceiling per system, grouped by S."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [
        r for r in result["rows"] if r["status"] == "ok" and r.get("T_ceiling_s") and r["peer"] != "reference"
    ]
    panels = sorted({(r["P"], r["H_kv"]) for r in ok})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4.2), squeeze=False)
    for ax, (world, h_kv) in zip(axes[0], panels):
        rows = [r for r in ok if (r["P"], r["H_kv"]) == (world, h_kv)]
        lengths = sorted({r["S"] for r in rows})
        systems = sorted({r["system"] for r in rows}, key=lambda n: (not n.startswith("ds_seqpar"), n))
        width = 0.8 / len(systems)
        for j, system in enumerate(systems):
            xs, ys = [], []
            for i, seq_len in enumerate(lengths):
                hit = [r for r in rows if (r["system"], r["S"]) == (system, seq_len)]
                if hit:
                    xs.append(i + (j - len(systems) / 2 + 0.5) * width)
                    ys.append(hit[0]["time_s"] / hit[0]["T_ceiling_s"])
            hatch = "" if system.startswith("ds_seqpar") else "//"
            ax.bar(xs, ys, width, label=system, hatch=hatch, edgecolor="black", linewidth=0.3)
        ax.axhline(1.0, color="k", linestyle=":", linewidth=1)
        ax.set_xticks(range(len(lengths)), [f"S={s}" for s in lengths])
        ax.set(
            ylabel="time / no-communication reference (lower is better)",
            title=f"P={world}, H_kv={h_kv}",
            ylim=(0.8, None),
        )
        ax.legend(fontsize=5, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_e2e(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in result["rows"] if r["status"] == "ok"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for world, system in sorted({(r["P"], r["system"]) for r in ok}):
        pts = sorted(
            (r["S"], r["tokens_per_s"], r["peak_MiB"]) for r in ok if (r["P"], r["system"]) == (world, system)
        )
        style = "-o" if system.startswith("ds_seqpar") else "--x"
        a1.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{system} P={world}")
        a2.plot([p[0] for p in pts], [p[2] for p in pts], style, label=f"{system} P={world}")
    a1.set(xscale="log", xlabel="S", ylabel="tokens/s", title="training step throughput")
    a2.set(xscale="log", yscale="log", xlabel="S", ylabel="peak MiB per rank", title="peak memory per rank")
    a1.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_memory(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = [r for r in result["rows"] if r["status"] == "ok"]
    for peer, world in sorted({(r["peer"], r["P"]) for r in rows}):
        pts = sorted((r["S"], r["peak_MiB"]) for r in rows if (r["peer"], r["P"]) == (peer, world))
        ax.plot(*zip(*pts), "-o" if peer == "ds_seqpar" else "--x", label=f"{peer} P={world}")
    ax.axhline(result["meta"]["budget_MiB_per_rank"], color="k", linestyle=":", label="budget")
    ax.set(xscale="log", xlabel="S", ylabel="peak MiB per rank", title="memory per rank vs sequence length")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def packed_markdown(result: dict) -> str:
    """Packed-documents rows: ds_seqpar against ring-flash-attn's varlen functions and the references."""
    meta = result["meta"]
    rows = sorted(
        (r for r in result["rows"] if r["status"] == "ok"), key=lambda r: (r["P"], r["docs"], r["time_s"])
    )
    cols = [
        ("P", "P", "d"),
        ("documents", "docs", "s"),
        ("system", "system", "s"),
        ("fwd+bwd (s)", "time_s", ".3f"),
        ("vs no-comm reference", "vs_ceiling", ".3f"),
        ("vs fastest peer", "vs_fastest_peer", ".3f"),
        ("sent MiB/rank", "sent_MiB", ".1f"),
        ("max abs err", "max_abs_err", ".1e"),
    ]
    head = (
        f"Packed documents, causal attention fwd+bwd, B=1, S={meta['seq_len']}, H=H_kv=8, D=64, {meta['dtype']}, "
        f"gloo CPU ranks (1 thread each) on {meta['machine']['cores']} cores, median of {meta['reps']}, slowest "
        "rank, round-robin. 'reference: no communication': every rank at once runs one causal kernel call per "
        "document on H/P heads and sends nothing; 'vs no-comm reference' = its time / the row's time (1.0 = no "
        "SP overhead). vs fastest peer < 1: faster than every peer row. max abs err: out and gradients vs fp64 "
        "at S=512 with the same document fractions.\n\n"
    )
    return head + _table(rows, cols) + _not_run(result["rows"])


def write_suite(suite: str, name: str, result: dict) -> str:
    """Write ``results/<name>.md`` (and ``.png``); return the markdown."""
    writers = {
        "attention": attention_markdown,
        "packed": packed_markdown,
        "e2e": e2e_markdown,
        "memory": memory_markdown,
    }
    markdown = writers[suite](result)
    (RESULTS / f"{name}.md").write_text(markdown)
    plots = {"attention": _plot_attention, "e2e": _plot_e2e, "memory": _plot_memory}
    if suite in plots:
        plots[suite](result, RESULTS / f"{name}.png")
    return markdown


SECTIONS = [
    ("attention", "Attention layer: ds_seqpar vs DeepSpeed Ulysses, yunchang, ring-flash-attn"),
    ("attention_fp32", "Attention layer in fp32"),
    ("packed", "Packed documents: ds_seqpar vs ring-flash-attn's varlen functions"),
    ("packed_bf16", "Packed documents in bf16"),
    ("e2e", "Training step: ds_seqpar vs DeepSpeed ALST"),
    ("memory", "Memory: longest sequence per rank budget"),
    ("sparse_cpu", "Sparse ring"),
    ("sparse_cpu_rho", "Sparse ring: imbalance ratio per balancing"),
    ("linear_cpu", "Linear attention All-Scan"),
]


def write_performance_doc() -> None:
    """Regenerate ``docs/performance.md`` from the results present."""
    parts = [
        "# Performance\n",
        "Generated by `python -m benchmarks.run --suite all` (see [benchmarks](#how-to-run)); do not edit by hand.\n",
        "Everything below ran on the CPU development machine: gloo ranks, one thread each, on the cores listed in "
        "each table. It measures algorithms and their overheads, not GPU speed. Peers ran in the same run on the "
        "same machine; where a peer calls flash-attn, `benchmarks/peers/flash_attn_shim` serves the call with "
        "PyTorch's CPU flash attention op, the same op ds_seqpar's `sdpa` kernel uses.\n",
    ]
    for name, title in SECTIONS:
        md = RESULTS / f"{name}.md"
        if not md.exists():
            continue
        parts.append(f"\n## {title}\n")
        png = RESULTS / f"{name}.png"
        if png.exists():
            parts.append(f"\n![{name}](../benchmarks/results/{name}.png)\n")
        parts.append("\n" + md.read_text())
    parts.append(HOW_TO_RUN)
    DOC.write_text("\n".join(part.strip("\n") + "\n" for part in parts))


HOW_TO_RUN = """
## How to run

```bash
bash scripts/install.sh                 # ds_seqpar and its CPU dependencies (.venv)
bash benchmarks/peers/install.sh        # peers into benchmarks/.peers (yunchang 0.6.4, ring-flash-attn 0.1.8)
.venv/bin/python -m benchmarks.run --suite all          # or attention | packed | e2e | memory | sparse | linear
.venv/bin/python -m benchmarks.run --suite attention --quick   # smoke run, results *_quick.*
```

Two commits against each other (clones of both, this checkout's `.venv`):
`.venv/bin/python -m benchmarks.ab_commits OLD NEW` times the ds_seqpar rows of the attention suite (fp32),
`benchmarks.bench_schedules` and `benchmarks.bench_usp` on both, alternating the order every round, and writes
`benchmarks/results/ab_<old>_<new>.md`; `.venv/bin/python -m benchmarks.peer_bytes OUT.json --compare OLD.json`
checks that every byte each rank sends to each peer, for every ring schedule at P = 8, is unchanged.
`OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.op_trace OUT.json --compare OLD.json`
checks that one USP forward + backward calls the same aten ops, in the same order, on tensors of the same
shapes, strides and dtypes, for every U x R of 4 ranks (H_kv = 8 and 2); with `--nproc_per_node 8` and
`--schedules`, for every ring schedule of `benchmarks.bench_schedules` instead.

On this shared 2-core machine one benchmark's time drifts by 10–30 % within half an hour, more than
any code change of a few per cent, so a commit that only moves code is judged by the two exact checks
first. For the redesign (92352a5 → 2d0fec5, which split the ring engine and moved every schedule,
layout and kernel to one home) both agree: all 21 × 8 byte rows of `benchmarks.peer_bytes` are
identical ([new](../benchmarks/results/peer_bytes_p8.json), [old](../benchmarks/results/peer_bytes_p8_92352a5.json)),
and so are all 24 USP op traces ([new](../benchmarks/results/op_trace_p4.json),
[old](../benchmarks/results/op_trace_p4_92352a5.json)) and all 128 schedule op traces (8 variants × 2 H_kv × 8
ranks; [new](../benchmarks/results/op_trace_schedules_p8.json), [old](../benchmarks/results/op_trace_schedules_p8_92352a5.json)). Timed, `ab_commits --bench usp --rounds 4`
gave ratios of 0.98, 1.16 and 1.07 (geometric mean 1.07) while the old commit's own time for one row
went from 8.9 s to 10.8 s over the rounds ([table](../benchmarks/results/ab_92352a5_2d0fec5.md)): the
pairs straddle 1 in every row, and the op traces say the kernels are the same.

ds_seqpar's rows: `auto` is the default (`ulysses_degree: "auto"`, `ulysses_chunks: "auto"`: with R = 1 the
head exchange is pipelined against the attention in up to 4 head groups, [attention.md](attention.md#pipelined-ulysses));
`auto, one exchange` is the same with `ulysses_chunks: 1` (shown where `auto` pipelines); `ulysses Px1`,
`ring 1xP zigzag` and `usp 2x2 zigzag` are the other factorisations (a row equal to `auto` is not repeated).
Two references are timed in the same round-robin: `reference: one process` (T_single: rank 0 alone runs the
kernel on the whole sequence) and `reference: no communication` (every rank at once runs the kernel on its
1/P of the heads and sends nothing).

What each peer runs:

- **deepspeed DistributedAttention**: `deepspeed.sequence.layer.DistributedAttention` (DeepSpeed 0.19.8) around
  `flash_attn_func(causal=True)` (shim), scatter heads / gather sequence, contiguous shards.
- **yunchang** 0.6.4: `UlyssesAttention` for U = P (its `LongContextAttention` with a ring of one sends K/V to
  itself, which gloo refuses) and `LongContextAttention(ring_impl_type="zigzag", attn_type=AttnType.FA)` for
  R > 1, inputs sharded with yunchang's own `zigzag_extract_local`.
- **ring-flash-attn** 0.1.8: `zigzag_ring_flash_attn_func` (zigzag shards) and `ring_flash_attn_func`
  (contiguous shards). Its HF adapter imports a helper transformers 5 removed; the suite defines it before
  import (the adapter is not used).
- **DeepSpeed ALST**: `UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", P, 1)` on the same tiny
  Llama (same seed, same batch), contiguous shards with global `position_ids`, the same token-weighted loss.

The attention suite runs in bf16 by default (`--dtype fp32`: `attention_fp32.*`): the ring peers only produce
correct gradients in half precision (in fp32 `dq_buffer.to(torch.float32)` returns the buffer itself, which the
next block overwrites), which is also what flash-attn supports. The shim computes bf16 natively, as ds_seqpar's
`sdpa` kernel does. Every row's output and gradients are checked against an fp64 reference first; a row beyond
1e-3 (fp32) or 0.25 (bf16) max abs error is timed but listed as "wrong result" and never counts as the fastest peer.

The packed-documents suite (`--suite packed`, fp32 by default, `--dtype bf16`: `packed_bf16.*`) runs one row
of 512 + 1024 + 2560 tokens and one of 16 equal documents at S = 4096: ds_seqpar with `doc_ids` (default
`auto` and the pure zigzag ring) against ring-flash-attn's `zigzag_ring_flash_attn_varlen_func` (every document
zigzagged over the ranks) and `llama3_flash_attn_varlen_func` (contiguous shards, K/V all-gathered), whose
varlen calls the shim serves per document. Its no-communication reference runs one causal call per document on
H/P heads per rank.
"""
