"""Scale-out projection: per-layer attention time (forward + backward) of each schedule on a modelled cluster.

Nothing is measured: the bytes come from ``ds_seqpar.comm.model.peer_bytes`` (Ulysses: from
``ds_seqpar.parallel.comm_volume.ulysses_bytes``), the time from the simple cluster model below
(docs/comm_model.md "Projection"). Deterministic; no torch.distributed, no GPU. The presets, the link model
and the per-schedule time of a layer are the library's (``ds_seqpar/plan/``: clusters.py, links.py,
attention_time.py), shared with the planner (docs/plan.md); this script chooses the settings and writes
the tables.

    python -m benchmarks.project --cluster h100-ib --model llama3-8b --seq-len 1M --world 64 [--out DIR]
    python -m benchmarks.project --table [--out DIR]     # results/project.{md,json,png}

Time model, per layer, slowest rank:
    compute      causal attention forward 2·2·B·S²·H·D / 2 FLOPs over N ranks at the preset's
                 effective throughput; backward 2.5× forward
    link time    bytes / bandwidth per link class, classes in parallel: inter-node = all this rank's
                 cross-node bytes through its NIC; switch node = all its same-node bytes through its
                 injection bandwidth; mesh node = the bytes to its busiest same-node peer over one link
    ring steps   a chain of K transfer steps beside K' ≥ K compute steps: K·max(c, t) + (K' − K)·c
                 + the latency of each hop (c, t = compute and link time of one step)
    exposed      collectives (one phase per kind, ⌈log2 p⌉ latencies for a group of p) and the
                 hops nothing can hide (StarTrail's skew / un-skew, the last accumulator return)
    a phase's time is the maximum over the ranks of node 0 and of the last node; phases add up.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ds_seqpar.comm.model import (
    attention2d_grids,
    startrail_backward_choice,
    startrail_team_sizes,
    tasp_domains,
)
from ds_seqpar.plan.attention_time import (
    BWD_FACTOR,
    ZIGZAG_SEGMENTS,
    AttentionSetting,
    Phases,
    Result,
    collective_only,
    ring_family,
    slowest,
    startrail,
    traffic_of,
    ulysses_bytes_of,
    ulysses_phases,
)
from ds_seqpar.plan.clusters import CLUSTERS
from ds_seqpar.plan.links import Ring

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class ModelConfig:
    """The attention shape of one layer: query heads H, K/V heads H_kv, head dim D."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int
    note: str


MODELS = {
    "llama3-8b": ModelConfig(
        "llama3-8b", 32, 8, 128, "Llama-3 8B: 32 query heads, 8 K/V heads (GQA), D = 128"
    ),
    "gpt-7b": ModelConfig("gpt-7b", 32, 32, 128, "GPT-3 6.7B-like: 32 heads MHA, D = 128 (hidden 4096)"),
    "gpt-3b": ModelConfig("gpt-3b", 32, 32, 80, "GPT-3 2.7B-like: 32 heads MHA, D = 80 (hidden 2560)"),
}

SCHEDULE_NAMES = ("ring", "double ring", "USP", "StarTrail", "TASP", "ATTENTION2D")
Setting = AttentionSetting  # one projected case: cluster, model, S, N (= world), batch, bytes per element


def project(st: Setting) -> tuple[list[Result], dict[str, dict[str, float]]]:
    """Every schedule of SCHEDULE_NAMES for one setting (best C / grid where there is a choice), and
    the ms of every candidate of the schedules that have a choice ({schedule: {choice: ms}})."""
    n_world, g, m = st.world, st.cluster.gpus_per_node, st.model
    if st.seq_len % (2 * n_world):
        raise ValueError(f"seq_len={st.seq_len} is not a multiple of 2·world={2 * n_world} (zigzag layout)")
    n = st.seq_len // n_world
    shape = st.shape(n, m.heads, m.kv_heads)
    ring = Ring.on(st.cluster, n_world)
    out = []
    candidates: dict[str, dict[str, float]] = {"StarTrail": {}, "ATTENTION2D": {}}

    def ring_result(name: str, schedule: str, inner: int | None, choice: str) -> Result:
        kw = {"inner": inner} | ({"segments": ZIGZAG_SEGMENTS} if schedule == "tasp" else {})
        return slowest(
            name,
            choice,
            ring,
            lambda q: ring_family(st, ring, shape, q, schedule=schedule, inner=inner),
            traffic_of(ring, shape, schedule, **kw),
        )

    out.append(ring_result("ring", "p2p", None, f"R={n_world}"))
    inner = g if n_world > g and n_world % g == 0 else None
    out.append(ring_result("double ring", "p2p", inner, f"R_in={inner or n_world}"))
    out.append(usp(st))
    best = None
    for c in startrail_team_sizes(n_world):
        variant = startrail_backward_choice(shape, c)
        res = slowest(
            "StarTrail",
            f"C={c} ({variant})",
            ring,
            lambda q, c=c, v=variant: startrail(st, ring, shape, q, team_size=c, variant=v),
            traffic_of(ring, shape, "startrail", team_size=c, startrail_backward=variant),
        )
        candidates["StarTrail"][res.choice] = res.ms
        best = res if best is None or res.ms < best.ms else best
    out.append(best)
    d = g if n_world % g == 0 else None
    if d is None and n_world in tasp_domains(n_world):
        d = n_world
    if d is not None and d in tasp_domains(n_world):
        out.append(ring_result("TASP", "tasp", d if d < n_world else None, f"d={d}"))
    best = None
    for grid in attention2d_grids(n_world):
        res = slowest(
            "ATTENTION2D",
            f"{grid[0]}×{grid[1]}",
            ring,
            lambda q, grid=grid: collective_only(st, ring, shape, q, schedule="attention2d", grid=grid),
            traffic_of(ring, shape, "attention2d", grid=grid),
        )
        candidates["ATTENTION2D"][res.choice] = res.ms
        best = res if best is None or res.ms < best.ms else best
    out.append(best)
    return out, candidates


def usp(st: Setting) -> Result:
    """USP: Ulysses U = min(ranks per node, H_kv) (largest such U dividing H, H_kv, N and the node)
    inside the node, a single ring of N/U ranks (stride U, across nodes) on H/U, H_kv/U heads."""
    m, g = st.model, st.cluster.gpus_per_node
    u = max(
        x
        for x in range(1, min(g, m.kv_heads) + 1)
        if m.heads % x == 0 and m.kv_heads % x == 0 and st.world % x == 0 and g % x == 0
    )
    r = st.world // u
    ring = Ring.on(st.cluster, r, stride=u)
    shape = st.shape(st.seq_len // r, m.heads // u, m.kv_heads // u)
    a2a_f, a2a_b = ulysses_phases(st, u)

    def evaluate(q: int) -> tuple[Phases, Phases]:
        f, b = ring_family(st, ring, shape, q, schedule="p2p", inner=None)
        return a2a_f | f, a2a_b | b

    res = slowest("USP", f"U={u}, R={r}", ring, evaluate, traffic_of(ring, shape, "p2p"))
    a2a = sum(ulysses_bytes_of(st, u))
    res.intra_mb += a2a / 1e6
    return res


def compute_only_ms(st: Setting) -> float:
    """The floor: forward + backward compute with free communication."""
    return 1e3 * (1 + BWD_FACTOR) * st.forward_seconds


# ---------------------------------------------------------------------------------------------------
# output


def parse_tokens(text: str) -> int:
    """'128K' → 131072, '1M' → 1048576, '524288' → 524288 (K = 1024)."""
    found = re.fullmatch(r"(\d+)([KkMm]?)", text.strip())
    if not found:
        raise argparse.ArgumentTypeError(f"sequence length {text!r}: expected e.g. 131072, 128K or 1M")
    return int(found[1]) * {"": 1, "k": 1024, "m": 1024**2}[found[2].lower()]


def tokens_label(s: int) -> str:
    if s % 1024**2 == 0:
        return f"{s // 1024**2}M"
    return f"{s // 1024}K" if s % 1024 == 0 else str(s)


def setting_rows(st: Setting) -> dict:
    results, candidates = project(st)
    ring_ms = results[0].ms
    return {
        "cluster": st.cluster.name,
        "model": st.model.name,
        "seq_len": st.seq_len,
        "world": st.world,
        "batch": st.batch,
        "element_bytes": st.element_bytes,
        "compute_only_ms": compute_only_ms(st),
        "schedules": [asdict(r) | {"ms": r.ms, "speedup_vs_ring": ring_ms / r.ms} for r in results],
        "candidates_ms": candidates,
    }


def single_markdown(row: dict) -> str:
    lines = [
        f"{row['cluster']}, {row['model']}, S = {tokens_label(row['seq_len'])}, N = {row['world']}, "
        f"B = {row['batch']}: ms per attention layer (forward + backward); compute only "
        f"{row['compute_only_ms']:.3f} ms",
        "",
        "| schedule | choice | forward ms | backward ms | total ms | vs ring | inter-node MB/rank (max) | intra-node MB/rank (max) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in row["schedules"]:
        lines.append(
            f"| {r['schedule']} | {r['choice']} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | {r['ms']:.3f} | "
            f"{r['speedup_vs_ring']:.2f}× | {r['inter_mb']:.1f} | {r['intra_mb']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def wide_table(rows: list[dict], with_model: bool = False, by_c: bool = False) -> list[str]:
    """One line per setting: ms per layer (speed-up vs ring) per schedule, the choices, the best;
    ``by_c``: also StarTrail's ms for every team size C."""
    head = ["cluster", *(["model"] if with_model else []), "N", "S", "compute only"]
    head += [*SCHEDULE_NAMES, "best", *(["StarTrail ms by C"] if by_c else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        by = {r["schedule"]: r for r in row["schedules"]}
        cells = [row["cluster"], *([row["model"]] if with_model else [])]
        cells += [str(row["world"]), tokens_label(row["seq_len"]), f"{row['compute_only_ms']:.2f}"]
        for name in SCHEDULE_NAMES:
            r = by.get(name)
            if r is None:
                cells.append("–")
                continue
            extra = f" {r['choice']}" if name in ("USP", "StarTrail", "ATTENTION2D") else ""
            cells.append(f"{r['ms']:.2f} ({r['speedup_vs_ring']:.2f}×){extra}")
        fastest = min(row["schedules"], key=lambda r: r["ms"])
        cells.append(f"{fastest['schedule']} {fastest['speedup_vs_ring']:.2f}×")
        if by_c:
            cells.append(", ".join(f"{k}: {v:.1f}" for k, v in row["candidates_ms"]["StarTrail"].items()))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


TABLE_CLUSTERS = ("h100-ib", "a100-eth", "mi300x-ib")
TABLE_WORLDS = (64, 512)
TABLE_SEQS = (128 * 1024, 1024**2)
PLOT_WORLDS = tuple(2**k for k in range(3, 11))  # 8 … 1024
PLOT_SEQS = (1024**2, 128 * 1024)
STARTRAIL_SETTINGS = [
    ("h100-ib", "gpt-3b", 512 * 1024, 16),
    ("h100-ib", "gpt-3b", 512 * 1024, 64),
    ("h100-ib", "gpt-7b", 512 * 1024, 16),
    ("h100-ib", "gpt-7b", 512 * 1024, 32),
    ("h100-ib", "gpt-7b", 512 * 1024, 64),
    ("h100-ib", "gpt-7b", 128 * 1024, 64),
    ("a100-eth", "gpt-7b", 512 * 1024, 64),
]


def setting(cluster: str, model: str, seq_len: int, world: int) -> Setting:
    return Setting(CLUSTERS[cluster], MODELS[model], seq_len, world)


def write_table(out: Path) -> str:
    """results/project.{md,json,png}: the standard table, StarTrail's setting, the scaling plot."""
    out.mkdir(parents=True, exist_ok=True)
    main = [
        setting_rows(setting(c, "llama3-8b", s, n))
        for c in TABLE_CLUSTERS
        for n in TABLE_WORLDS
        for s in TABLE_SEQS
    ]
    star = [setting_rows(setting(c, m, s, n)) for c, m, s, n in STARTRAIL_SETTINGS]
    plot = {
        tokens_label(s): [setting_rows(setting("h100-ib", "llama3-8b", s, n)) for n in PLOT_WORLDS]
        for s in PLOT_SEQS
    }
    meta = {
        "generated_by": "python -m benchmarks.project --table",
        "clusters": {name: asdict(c) for name, c in CLUSTERS.items()},
        "models": {name: asdict(m) for name, m in MODELS.items()},
        "batch": 1,
        "dtype": "bf16 (b = 2, accumulators fp32)",
        "backward_flops_factor": BWD_FACTOR,
        "layout": "zigzag (2 segments per rank; TASP sub-chunks cut per segment)",
    }
    (out / "project.json").write_text(
        json.dumps({"meta": meta, "table": main, "startrail_setting": star, "plot": plot}, indent=1) + "\n"
    )
    lines = [
        "# Scale-out projection (model, not measurement)",
        "",
        "Generated by `python -m benchmarks.project --table`; do not edit by hand. Formulas and assumptions:",
        "[docs/comm_model.md](../../docs/comm_model.md). Per attention layer, forward + backward, causal, B = 1,",
        "bf16, zigzag layout; each cell: ms (speed-up vs ring) and the chosen U / C / grid.",
        "",
        "Clusters (assumptions):",
        "",
        *[f"- `{c.name}`: {c.note}" for c in CLUSTERS.values()],
        "",
        "## llama3-8b (32 heads, 8 K/V heads, D = 128)",
        "",
        *wide_table(main),
        "",
        "## StarTrail's setting (GPT-style MHA, 512K tokens, up to 64 GPUs)",
        "",
        *wide_table(star, with_model=True, by_c=True),
        "",
        "## Scaling, h100-ib, llama3-8b (project.png)",
        "",
    ]
    for label, rows in plot.items():
        lines += [f"S = {label}:", "", *wide_table(rows), ""]
    text = "\n".join(lines)
    (out / "project.md").write_text(text)
    plot_png(plot, out / "project.png")
    return text


def plot_png(plot: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(plot), figsize=(6 * len(plot), 4.5))
    for ax, (label, rows) in zip(axes, plot.items(), strict=True):
        worlds = [r["world"] for r in rows]
        for name in SCHEDULE_NAMES:
            ms = [next((s["ms"] for s in r["schedules"] if s["schedule"] == name), math.nan) for r in rows]
            style = {"TASP": (0, (4, 3)), "double ring": (0, (1, 2))}.get(name, "-")  # equal on switch nodes
            ax.plot(worlds, ms, marker="o", markersize=3, linestyle=style, label=name)
        ax.plot(worlds, [r["compute_only_ms"] for r in rows], "k--", linewidth=1, label="compute only")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs N (8 per node)")
        ax.set_ylabel("ms per attention layer (fwd + bwd)")
        ax.set_title(f"h100-ib, llama3-8b, S = {label} (projection)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.project", description=__doc__.split("\n")[0])
    ap.add_argument("--cluster", choices=sorted(CLUSTERS), default="h100-ib")
    ap.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    ap.add_argument("--seq-len", type=parse_tokens, default=1024**2, help="tokens, e.g. 131072, 128K, 1M")
    ap.add_argument("--world", type=int, default=64, help="GPUs N = the SP degree")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--element-bytes", type=int, choices=(2, 4, 8), default=2, help="2 = bf16 / fp16")
    ap.add_argument("--table", action="store_true", help="write the standard table, JSON and plot")
    ap.add_argument(
        "--out", type=Path, default=None, help="folder for the files (default: none, or results/)"
    )
    args = ap.parse_args(argv)
    if args.table:
        sys.stdout.write(write_table(args.out or RESULTS))
        return 0
    st = Setting(
        CLUSTERS[args.cluster], MODELS[args.model], args.seq_len, args.world, args.batch, args.element_bytes
    )
    row = setting_rows(st)
    text = single_markdown(row)
    sys.stdout.write(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"project_{st.cluster.name}_{st.model.name}_S{tokens_label(st.seq_len)}_N{st.world}"
        (args.out / f"{stem}.json").write_text(json.dumps(row, indent=1) + "\n")
        (args.out / f"{stem}.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
