"""The mesh section of ``python -m ds_seqpar.report --config ...``: the mesh a config builds, without
starting torch.distributed.

Everything is read from the objects the library itself builds: the resolved settings and plan of
``mesh.plan_from_config`` (dp, P, U, R, R_inner x R_outer, every group's members), the settings' input
layout (the padded length), the schedule's spec (its report rows and bytes per peer), the kernel
registries (what the configured kernel runs as here), and ``parallel.comm_volume`` (the bytes one rank
sends per attention layer, the formulas the distributed tests check).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ds_seqpar.comm import model as comm_model
from ds_seqpar.comm.all_to_all import HeadPlan
from ds_seqpar.comm.layer_bytes import LayerShape
from ds_seqpar.config import SequenceParallelConfig, load_config
from ds_seqpar.layout import LAYOUTS
from ds_seqpar.mesh import GROUP_KINDS, MeshPlan, plan_from_config
from ds_seqpar.ops.attention import resolve_kernel
from ds_seqpar.ops.precision import accumulator_bytes
from ds_seqpar.ops.sparse.kernels import resolve_sparse_kernel
from ds_seqpar.parallel.comm_volume import LayerBytes, attention_layer_bytes
from ds_seqpar.report.text import fmt_bytes, one_line, rows, table, title
from ds_seqpar.settings import SeqParSettings, head_counts, text_config

__all__ = [
    "DEFAULT_MODEL_CONFIG",
    "DEFAULT_SEQ_LEN",
    "ReportError",
    "busiest_rank_bytes",
    "bytes_lines",
    "group_lines",
    "head_dim",
    "link_lines",
    "load_model_config",
    "mesh_report",
]

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_CONFIG = REPO / "assets" / "tiny-llama"
DEFAULT_SEQ_LEN = 4096
MAX_FULL_WORLD = 64  # larger worlds print the first few groups and members only
SHOWN_GROUPS = 4
SHOWN_MEMBERS = 8


class ReportError(Exception):
    """A problem with the report's inputs; the message is printed as one line (exit status 2)."""


def load_model_config(path: str | os.PathLike[str] | None) -> Any:
    """A HF config from a ``config.json`` file or a model directory (local only; default the shipped
    tiny Llama); ``ReportError`` naming the path when it cannot be read."""
    path = Path(DEFAULT_MODEL_CONFIG if path is None else path)
    if path.is_dir() and not (path / "config.json").is_file():
        raise ReportError(
            f"model directory '{path}' has no config.json; valid: a HF model directory or config.json"
        )
    if not path.exists():
        raise ReportError(
            f"model config '{path}' does not exist; valid: a HF config.json file or a model directory such as "
            f"{DEFAULT_MODEL_CONFIG.relative_to(REPO)}"
        )
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise ReportError(f"model config '{path}' cannot be loaded: {one_line(exc)}") from None


def head_dim(model_config: Any) -> int:
    """``head_dim`` of the (text) config, else ``hidden_size / num_attention_heads``."""
    text = text_config(model_config)
    dim = getattr(text, "head_dim", None)
    if dim:
        return int(dim)
    heads, _ = head_counts(model_config)
    hidden = getattr(text, "hidden_size", None)
    if not isinstance(hidden, int):
        raise ReportError("model config has neither head_dim nor hidden_size; cannot size the attention")
    return hidden // heads


def _element(ds_config: dict[str, Any]) -> tuple[torch.dtype, int]:
    """The activation dtype of a DeepSpeed config (bf16 / fp16 when enabled, else fp32) and its bytes."""
    if ds_config.get("bf16", {}).get("enabled"):
        return torch.bfloat16, 2
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16, 2
    return torch.float32, 4


def _world_from_env() -> int | None:
    value = os.environ.get("WORLD_SIZE")
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ReportError(
            f"WORLD_SIZE={value!r} in the environment is not a positive integer; pass --world N"
        )
    return int(value)


def _ranks(members: list[int], full: bool) -> str:
    if full or len(members) <= SHOWN_MEMBERS:
        return "[" + ", ".join(map(str, members)) + "]"
    return "[" + ", ".join(map(str, members[:SHOWN_MEMBERS])) + f", ... +{len(members) - SHOWN_MEMBERS}]"


def group_lines(plan: MeshPlan) -> list[str]:
    """One line per group kind with its members; worlds above 64 ranks show the first groups only."""
    full = plan.world_size <= MAX_FULL_WORLD
    lines = []
    for kind in GROUP_KINDS:
        groups = plan.groups(kind)
        shown = groups if full else groups[:SHOWN_GROUPS]
        text = " ".join(_ranks(g, full) for g in shown)
        if len(shown) < len(groups):
            text += f" ... ({len(groups)} groups of {len(groups[0])})"
        lines.append(f"  {kind:<11} {text}")
    return lines


def _auto_note(section: SequenceParallelConfig, heads: int, kv_heads: int) -> str:
    """How ``ulysses_degree: "auto"`` was resolved (nothing for an integer degree)."""
    if section.ulysses_degree != "auto":
        return ""
    if section.attention in ("usp", "sparse_ring"):
        return f' ("auto": H={heads}, H_kv={kv_heads})'
    return f' ("auto": attention={section.attention})'


def _runs_as(name: str, resolve: Any, where: str) -> str:
    """``"auto -> sdpa on cpu float32"``, or why the configured kernel cannot run here."""
    try:
        return f"{name} -> {resolve()} on {where}"
    except ValueError as exc:
        return f"{name}: cannot run on {where} ({one_line(exc)})"


def bytes_lines(layer: LayerBytes) -> list[str]:
    """The per-kind forward / backward table of one layer's bytes."""
    kinds = list(dict.fromkeys([*layer.forward, *layer.backward]))
    if not kinds:
        return ["  nothing is communicated (one rank per sequence)"]
    lines = [["kind", "forward", "backward"]]
    lines += [[k, fmt_bytes(layer.forward.get(k, 0)), fmt_bytes(layer.backward.get(k, 0))] for k in kinds]
    lines.append(["total", fmt_bytes(sum(layer.forward.values())), fmt_bytes(sum(layer.backward.values()))])
    return table(lines)


def link_lines(settings: SeqParSettings, shape: LayerShape) -> list[str]:
    """Intra- / inter-node bytes (forward + backward) of the ring rank that sends the most inter-node, for
    the ring axis of one rank of ``shape`` (tokens S / R, the rank's heads)."""
    r, u = settings.ring_degree, settings.ulysses_degree
    if not settings.enabled or r == 1:
        return []
    spec, params = settings.schedule, settings.ring_params()
    nodes = comm_model.node_map(r, settings.ranks_per_node, stride=u)
    best = None
    for rank in range(r):
        traffic = [
            comm_model.classify(spec.peer_bytes(shape, params, rank, backward=b), rank, nodes)
            for b in (False, True)
        ]
        inter = sum(t.inter for t in traffic)
        if best is None or inter > best[0]:
            best = (inter, rank, traffic)
    _, rank, (fwd, bwd) = best
    return [
        f"ring axis by link (ring rank {rank}, the most inter-node; ranks_per_node {nodes.count(0) * u}, docs/comm_model.md):",
        f"  intra-node  forward {fmt_bytes(fwd.intra)}, backward {fmt_bytes(bwd.intra)}",
        f"  inter-node  forward {fmt_bytes(fwd.inter)}, backward {fmt_bytes(bwd.inter)}",
        f"  busiest link forward {fmt_bytes(fwd.busiest_link)}, backward {fmt_bytes(bwd.busiest_link)}",
    ]


def busiest_rank_bytes(
    settings: SeqParSettings, seq_len: int, heads: int, kv_heads: int, dim: int, **kwargs: Any
) -> tuple[LayerBytes, bool]:
    """The layer bytes of the Ulysses rank that sends the most, and whether ranks differ (uneven heads)."""
    u = settings.ulysses_degree if settings.enabled else 1
    per_rank = [
        attention_layer_bytes(settings, seq_len, heads, kv_heads, dim, ulysses_rank=r, **kwargs)
        for r in range(u)
    ]
    busiest = max(per_rank, key=lambda b: b.total)
    return busiest, any(b != busiest for b in per_rank)


def _setting_rows(
    section: SequenceParallelConfig, settings: SeqParSettings, plan: MeshPlan, model: Any, dtype: torch.dtype
) -> list[tuple[str, str]]:
    """The sizes, algorithm, layout, schedule and kernels of the mesh."""
    heads, kv_heads = head_counts(model)
    p, u, r, ring = plan.sp_size, plan.ulysses_size, plan.ring_size, settings.ring
    out = [
        ("world", f"{plan.world_size} = dp {plan.dp_size} x P {p}"),
        ("P (sequence_parallel.size)", f"{p} = U {u} x R {r}" + ("" if settings.enabled else " (disabled)")),
        ("U (ulysses_degree)", f"{u}{_auto_note(section, heads, kv_heads)}"),
        ("R (ring degree)", f"{r} = R_outer {plan.ring_outer_size} x R_inner {plan.ring_inner_size}"),
        ("attention", settings.attention),
        ("layout", ring.layout + (f" (granularity {ring.granularity})" if LAYOUTS[ring.layout].takes_granularity else "")
         + (", dynamic_degree: each batch in groups of the smallest p | P that balances" if settings.dynamic_degree else "")),
        ("ring schedule", f"{ring.schedule}, overlap {'on' if ring.overlap else 'off'}"),
        ("ranks per node", str(settings.ranks_per_node)),
    ]  # fmt: skip
    if settings.enabled and r > 1:
        out += settings.schedule.report_rows(settings.ring_params())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    softcap = getattr(text_config(model), "attn_logit_softcapping", None)
    where = f"{device} {str(dtype).removeprefix('torch.')}" + (f", softcap {softcap}" if softcap else "")
    kernel = settings.kernel
    out.append(("kernel", _runs_as(kernel, lambda: resolve_kernel(kernel, device, dtype, softcap), where)))
    if settings.attention == "sparse_ring":
        sparse = settings.sparse.kernel
        resolve = lambda: resolve_sparse_kernel(sparse, device, dtype).name  # noqa: E731
        out.append(("sparse kernel", _runs_as(sparse, resolve, where)))
    return out


def _bytes_section(
    settings: SeqParSettings, seq_len: int, model: Any, ds_config: dict[str, Any], plan: MeshPlan
) -> list[str]:
    """The bytes one rank sends per attention layer at ``seq_len`` (padded to the layout's multiple)."""
    heads, kv_heads = head_counts(model)
    dim, (dtype, element_bytes) = head_dim(model), _element(ds_config)
    batch = int(ds_config.get("train_micro_batch_size_per_gpu", 1))
    padded = seq_len
    if settings.enabled:
        multiple = settings.input_layout().multiple
        padded = -(-seq_len // multiple) * multiple
    lines = [
        "",
        "bytes one rank sends per attention layer (parallel/comm_volume.py):",
        f"  S={padded}, B={batch}, H={heads}, H_kv={kv_heads}, D={dim}, {str(dtype).removeprefix('torch.')} "
        f"({element_bytes} B/element), n = S/P = {padded // plan.sp_size} tokens per rank",
    ]
    if padded != seq_len:
        lines.append(
            f"  (S={seq_len} padded to a multiple of {multiple} for layout '{settings.ring.layout}' x U {plan.ulysses_size})"
        )
    layer, uneven = busiest_rank_bytes(
        settings, padded, heads, kv_heads, dim, batch=batch, element_bytes=element_bytes
    )
    lines += bytes_lines(layer)
    if settings.enabled:
        r, heads_of = settings.ring_degree, HeadPlan.build(heads, kv_heads, settings.ulysses_degree)
        shape = LayerShape(batch, padded // r, heads_of.q_counts[0], heads_of.kv_counts[0], dim, element_bytes,
                           accumulator_bytes(element_bytes))  # fmt: skip
        lines += link_lines(settings, shape)
    if uneven:
        lines.append("  (heads split unevenly over the Ulysses ranks: the rank that sends the most)")
    if settings.attention == "sparse_ring":
        lines.append(
            "  (sparse_ring: plus the pattern estimation's all-reduces and, when dbsp reassigns blocks, "
            "the rows it moves; docs/sparse.md)"
        )
    return lines


def mesh_report(
    config: str | os.PathLike[str],
    world: int | None = None,
    model_config: str | os.PathLike[str] | None = None,
    seq_len: int = DEFAULT_SEQ_LEN,
) -> list[str]:
    """Lines of the mesh section for a DeepSpeed JSON: sizes, settings, groups and bytes per layer.

    ``world`` defaults to ``WORLD_SIZE`` in the environment, else dp x size of the section. Raises
    ``SeqParConfigError`` / ``ReportError`` with a one-line message on bad inputs.
    """
    world = _world_from_env() if world is None else world
    if world is not None and world < 1:
        raise ReportError(f"--world {world} must be a positive number of ranks")
    if seq_len < 1:
        raise ReportError(f"--seq-len {seq_len} must be a positive number of tokens")
    section, ds_config = load_config(config, world)
    if world is None:
        world = section.size * (section.data_parallel_size or 1)
    model = load_model_config(model_config)
    settings, plan = plan_from_config(section, world, model)
    model_name = model_config or DEFAULT_MODEL_CONFIG.relative_to(REPO)
    lines = title(f"mesh: {config} on {world} ranks, model {model_name}")
    lines += rows(_setting_rows(section, settings, plan, model, _element(ds_config)[0]))
    lines += ["", "groups (global ranks):", *group_lines(plan)]
    return lines + _bytes_section(settings, seq_len, model, ds_config, plan)
