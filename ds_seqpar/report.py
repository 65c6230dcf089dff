"""``python -m ds_seqpar.report``: what this environment offers ds_seqpar, and the mesh a config builds.

In the spirit of DeepSpeed's ``ds_report``; nothing here starts torch.distributed or imports an
optional package (versions come from ``importlib.metadata``)::

    python -m ds_seqpar.report                                   # versions, devices, kernels
    python -m ds_seqpar.report --config ds_configs/usp_zero3.json --world 8 [--model-config DIR]
        [--seq-len 4096]                                         # + mesh, groups, bytes per layer

Sections:

1. versions: python, torch (and its CUDA / cuDNN / NCCL build), DeepSpeed, the HF stack, the optional
   fast paths ("not installed" when absent);
2. devices: CPU / CUDA devices, the torch.distributed backends built in, and the one ds_seqpar starts
   (``integrations.deepspeed.init_distributed``: NCCL on CUDA, gloo on CPU);
3. attention kernels: every kernel of the dense (``ops.attention.KERNELS``) and sparse
   (``ops.sparse_kernels.SPARSE_KERNELS``) registries per (device, dtype): "yes" or why not (the
   kernel's ``unavailable``), and what ``auto`` resolves to;
4. with ``--config``: the mesh ``SeqParMesh.from_config`` would build (``mesh.plan_from_config``):
   dp, P, U, R, R_inner x R_outer, layout, schedule, kernel, every group's members, and the bytes one
   rank sends per attention layer (``parallel.comm_volume``, the formulas the distributed tests check).

Errors (a missing file, a bad config or model config) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds_seqpar.comm import model as comm_model
from ds_seqpar.comm.all_to_all import HeadPlan
from ds_seqpar.comm.hamiltonian import hamiltonian_decomposition
from ds_seqpar.comm.schedule import team_parts
from ds_seqpar.config import SequenceParallelConfig, head_counts, load_config
from ds_seqpar.layout import SeqLayout, UspLayout
from ds_seqpar.mesh import GROUP_KINDS, MeshPlan, plan_from_config
from ds_seqpar.ops.attention import KERNELS, resolve_kernel
from ds_seqpar.ops.sparse_kernels import SPARSE_KERNELS, resolve_sparse_kernel
from ds_seqpar.parallel.comm_volume import LayerBytes, acc_bytes, attention_layer_bytes, model_arguments

__all__ = [
    "PACKAGES",
    "backend_info",
    "build_parser",
    "device_info",
    "kernel_columns",
    "kernel_matrix",
    "load_model_config",
    "main",
    "mesh_report",
    "package_versions",
    "report",
]

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_CONFIG = REPO / "assets" / "tiny-llama"
DEFAULT_SEQ_LEN = 4096
NOT_INSTALLED = "not installed"
MAX_FULL_WORLD = 64  # larger worlds print the first few groups and members only
SHOWN_GROUPS = 4
SHOWN_MEMBERS = 8

# (label, distribution names tried in order): the first one installed gives the version
PACKAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ds_seqpar", ("ds_seqpar",)),
    ("torch", ("torch",)),
    ("deepspeed", ("deepspeed",)),
    ("transformers", ("transformers",)),
    ("accelerate", ("accelerate",)),
    ("peft", ("peft",)),
    ("trl", ("trl",)),
    ("pydantic", ("pydantic",)),
    ("flash-attn", ("flash-attn",)),
    ("flash-attn 3", ("flash_attn_3",)),
    ("triton", ("triton",)),
    ("flash-linear-attention (fla)", ("flash-linear-attention", "fla-core")),
)


class ReportError(Exception):
    """A problem with the report's inputs; the message is printed as one line (exit status 2)."""


# ---------------------------------------------------------------------------------------------- versions


def package_versions(packages: Sequence[tuple[str, tuple[str, ...]]] = PACKAGES) -> dict[str, str | None]:
    """``{label: version or None}`` from ``importlib.metadata`` (nothing is imported)."""
    found: dict[str, str | None] = {}
    for label, names in packages:
        found[label] = None
        for name in names:
            try:
                found[label] = metadata.version(name)
                break
            except metadata.PackageNotFoundError:
                continue
    return found


def torch_build() -> str:
    """The CUDA / cuDNN / NCCL versions this torch was built with ("CPU build" when none)."""
    cuda = torch.version.cuda
    hip = getattr(torch.version, "hip", None)
    if not cuda and not hip:
        return "CPU build, no CUDA"
    parts = [f"CUDA {cuda}" if cuda else f"ROCm {hip}"]
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    parts.append(f"cuDNN {cudnn}" if cudnn else "no cuDNN")
    try:
        nccl = torch.cuda.nccl.version()
        parts.append("NCCL " + (".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)))
    except (AttributeError, RuntimeError):
        parts.append("no NCCL")
    return ", ".join(parts)


def versions_section() -> list[str]:
    """Lines of the versions section."""
    rows = [("python", f"{platform.python_version()} ({sys.executable})")]
    for label, version in package_versions().items():
        text = version or NOT_INSTALLED
        if label == "torch" and version:
            text += f" ({torch_build()})"
        rows.append((label, text))
    return _section("versions", rows)


# ---------------------------------------------------------------------------------------------- devices


def default_backend() -> str:
    """The torch.distributed backend ds_seqpar starts: NCCL on CUDA, gloo on CPU (``init_distributed``)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def device_info() -> dict[str, Any]:
    """CPU cores and CUDA devices (name, memory, compute capability)."""
    cuda: list[str] = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            cuda.append(
                f"cuda:{i} {props.name}, {props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}"
            )
    return {"cpu": f"{os.cpu_count()} cores ({platform.machine()})", "cuda": cuda}


def backend_info() -> dict[str, bool]:
    """Which torch.distributed backends this torch was built with."""
    if not dist.is_available():
        return {}
    return {
        name: bool(getattr(dist, f"is_{name}_available", lambda: False)())
        for name in ("gloo", "nccl", "mpi", "ucc")
    }


def devices_section() -> list[str]:
    """Lines of the devices and backend section."""
    info = device_info()
    rows = [("cpu", info["cpu"])]
    if info["cuda"]:
        rows += [("cuda", dev) for dev in info["cuda"]]
    else:
        why = "torch is a CPU build" if not torch.version.cuda else "no CUDA device visible"
        rows.append(("cuda", f"not available ({why})"))
    backends = backend_info()
    rows.append(
        (
            "torch.distributed",
            ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in backends.items()) or "not available",
        )
    )
    rows.append(("ds_seqpar backend", f"{default_backend()} (NCCL on CUDA, gloo on CPU)"))
    interpret = os.environ.get("TRITON_INTERPRET", "unset")
    rows.append(("TRITON_INTERPRET", f"{interpret} (1 runs the triton sparse kernel on CPU)"))
    return _section("devices and backend", rows)


# ---------------------------------------------------------------------------------------------- kernels

Column = tuple[str, torch.dtype]


def kernel_columns(cuda: bool | None = None) -> list[Column]:
    """``(device, dtype)`` columns of the kernel table: CPU fp32 / bf16 / fp64, and CUDA fp16 / bf16 /
    fp32 when CUDA is available (or ``cuda=True``)."""
    cols: list[Column] = [("cpu", torch.float32), ("cpu", torch.bfloat16), ("cpu", torch.float64)]
    if torch.cuda.is_available() if cuda is None else cuda:
        cols += [("cuda", torch.float16), ("cuda", torch.bfloat16), ("cuda", torch.float32)]
    return cols


def _reason(check: Callable[[torch.device, torch.dtype], str | None], device: str, dtype: torch.dtype) -> str:
    """``"yes"`` or why not; a check that itself fails (a broken optional package) says so."""
    try:
        why = check(torch.device(device), dtype)
    except Exception as exc:  # e.g. flash-attn built for another torch: report it, never crash
        why = f"its availability check failed ({type(exc).__name__}: {_one_line(exc)})"
    return "yes" if why is None else why


def _auto(resolve: Callable[[], str]) -> str:
    try:
        return resolve()
    except Exception as exc:
        return f"none ({_one_line(exc)})"


def kernel_matrix(columns: Sequence[Column] | None = None) -> dict[str, dict[Column, str]]:
    """``{row: {(device, dtype): "yes" | reason | kernel name}}``: every dense kernel, ``auto`` (and
    ``auto`` with a softcap), every sparse kernel (``sparse <name>``) and sparse ``auto``."""
    cols = kernel_columns() if columns is None else list(columns)
    rows: dict[str, dict[Column, str]] = {}
    for name, kern in KERNELS.items():
        rows[name] = {c: _reason(kern.unavailable, *c) for c in cols}
    rows["auto"] = {c: _auto(lambda c=c: resolve_kernel("auto", c[0], c[1])) for c in cols}
    rows["auto + softcap"] = {c: _auto(lambda c=c: resolve_kernel("auto", c[0], c[1], 30.0)) for c in cols}
    for name, sparse in SPARSE_KERNELS.items():
        rows[f"sparse {name}"] = {c: _reason(sparse.unavailable, *c) for c in cols}
    rows["sparse auto"] = {c: _auto(lambda c=c: resolve_sparse_kernel("auto", c[0], c[1]).name) for c in cols}
    return rows


def kernels_section(columns: Sequence[Column] | None = None) -> list[str]:
    """The kernel table; reasons are numbered notes under it, so the table stays narrow."""
    cols = kernel_columns() if columns is None else list(columns)
    matrix = kernel_matrix(cols)
    names = set(KERNELS) | {"auto", "auto + softcap", "sparse auto"}
    notes: dict[str, int] = {}
    body: list[list[str]] = []
    for row, cells in matrix.items():
        line = [row]
        for col in cols:
            text = cells[col]
            if text != "yes" and text not in names and text not in SPARSE_KERNELS:
                text = f"no ({notes.setdefault(text, len(notes) + 1)})"
            line.append(text)
        body.append(line)
    header = ["kernel", *(f"{dev} {str(dtype).removeprefix('torch.')}" for dev, dtype in cols)]
    lines = _title("attention kernels (sequence_parallel.kernel, sequence_parallel.sparse.kernel)")
    lines += _table([header, *body])
    lines += [f"  ({i}) {why}" for why, i in notes.items()]
    return lines


# ---------------------------------------------------------------------------------------------- mesh


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
        raise ReportError(f"model config '{path}' cannot be loaded: {_one_line(exc)}") from None


def _text_config(model_config: Any) -> Any:
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def head_dim(model_config: Any) -> int:
    """``head_dim`` of the (text) config, else ``hidden_size / num_attention_heads``."""
    text = _text_config(model_config)
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


def _runs_as(name: str, resolve: Callable[[], str], where: str) -> str:
    """``"auto -> sdpa on cpu float32"``, or why the configured kernel cannot run here."""
    try:
        return f"{name} -> {resolve()} on {where}"
    except ValueError as exc:
        return f"{name}: cannot run on {where} ({_one_line(exc)})"


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({n:,} B)"
    return f"{n:,} B"


def bytes_lines(layer: LayerBytes) -> list[str]:
    """The per-kind forward / backward table of one layer's bytes."""
    kinds = list(dict.fromkeys([*layer.forward, *layer.backward]))
    if not kinds:
        return ["  nothing is communicated (one rank per sequence)"]
    rows = [["kind", "forward", "backward"]]
    rows += [[k, _fmt_bytes(layer.forward.get(k, 0)), _fmt_bytes(layer.backward.get(k, 0))] for k in kinds]
    rows.append(["total", _fmt_bytes(sum(layer.forward.values())), _fmt_bytes(sum(layer.backward.values()))])
    return _table(rows)


def ranks_per_node(resolved: SequenceParallelConfig, world: int) -> int:
    """``sequence_parallel.ranks_per_node``, "auto" read from LOCAL_WORLD_SIZE (all ranks when unset)."""
    wanted = resolved.ranks_per_node
    if wanted == "auto":
        wanted = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return max(1, min(int(wanted), world))


def schedule_rows(resolved: SequenceParallelConfig, ring: int, u: int, world: int) -> list[tuple[str, str]]:
    """What a topology-aware schedule builds on the ring axis (ring ranks; ring rank q = SP rank q·U)."""
    cfg, rows = resolved.ring, [("ranks per node", str(ranks_per_node(resolved, world)))]
    if not resolved.enabled or ring == 1:
        return rows
    if cfg.schedule == "tasp":
        domain = cfg.inner_size or ring
        if domain > 1:
            cycles = hamiltonian_decomposition(domain)
            rows.append(("TASP cycles", f"{len(cycles)} over each domain of {domain}: " + " ".join(
                "→".join(str(x) for x in c) for c in cycles[:4]
            ) + (" ..." if len(cycles) > 4 else "")))  # fmt: skip
    if cfg.schedule == "startrail":
        c = cfg.team_size
        teams = team_parts(ring, c)
        rows.append(
            ("StarTrail", f"C {c}: {len(teams)} teams of {c} ring ranks, sub-rings of {ring // (c * c)}")
        )
    if cfg.schedule == "attention2d":
        rows.append(
            (
                "ATTENTION2D grid",
                f"{cfg.grid[0]} rows x {cfg.grid[1]} columns (ring rank = row x {cfg.grid[1]} + col)",
            )
        )
    return rows


def link_lines(resolved: SequenceParallelConfig, seq_len: int, heads: int, kv_heads: int, dim: int, batch: int,
               element_bytes: int, world: int) -> list[str]:  # fmt: skip
    """Intra- / inter-node bytes (forward + backward) of the ring rank that sends the most inter-node."""
    u = resolved.resolved_ulysses_degree
    r = resolved.size // u
    if not resolved.enabled or r == 1:
        return []
    cfg, plan = resolved.ring, HeadPlan.build(heads, kv_heads, u)
    shape, kw = model_arguments(resolved, comm_model.LayerShape(
        batch, seq_len // r, plan.q_counts[0], plan.kv_counts[0], dim, element_bytes, acc_bytes(element_bytes)
    ))  # fmt: skip
    nodes = comm_model.node_map(r, ranks_per_node(resolved, world), stride=u)
    best = None
    for rank in range(r):
        traffic = [
            comm_model.classify(
                comm_model.peer_bytes(cfg.schedule, shape, r, rank, backward=b, **kw), rank, nodes
            )
            for b in (False, True)
        ]
        inter = sum(t.inter for t in traffic)
        if best is None or inter > best[0]:
            best = (inter, rank, traffic)
    _, rank, (fwd, bwd) = best
    return [
        f"ring axis by link (ring rank {rank}, the most inter-node; ranks_per_node {nodes.count(0) * u}, docs/comm_model.md):",
        f"  intra-node  forward {_fmt_bytes(fwd.intra)}, backward {_fmt_bytes(bwd.intra)}",
        f"  inter-node  forward {_fmt_bytes(fwd.inter)}, backward {_fmt_bytes(bwd.inter)}",
        f"  busiest link forward {_fmt_bytes(fwd.busiest_link)}, backward {_fmt_bytes(bwd.busiest_link)}",
    ]


def busiest_rank_bytes(
    resolved: SequenceParallelConfig, seq_len: int, heads: int, kv_heads: int, dim: int, **kwargs: Any
) -> tuple[LayerBytes, bool]:
    """The layer bytes of the Ulysses rank that sends the most, and whether ranks differ (uneven heads)."""
    u = resolved.resolved_ulysses_degree if resolved.enabled else 1
    per_rank = [
        attention_layer_bytes(resolved, seq_len, heads, kv_heads, dim, ulysses_rank=r, **kwargs)
        for r in range(u)
    ]
    busiest = max(per_rank, key=lambda b: b.total)
    return busiest, any(b != busiest for b in per_rank)


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
        world = section.size * (getattr(section, "data_parallel_size", None) or 1)
    model = load_model_config(model_config)
    resolved, plan = plan_from_config(section, world, model)
    heads, kv_heads = head_counts(model)
    dim = head_dim(model)
    dtype, element_bytes = _element(ds_config)
    batch = int(ds_config.get("train_micro_batch_size_per_gpu", 1))
    model_name = model_config or DEFAULT_MODEL_CONFIG.relative_to(REPO)
    lines = _title(f"mesh: {config} on {world} ranks, model {model_name}")
    p, u, r = plan.sp_size, plan.ulysses_size, plan.ring_size
    rows = [
        ("world", f"{world} = dp {plan.dp_size} x P {p}"),
        ("P (sequence_parallel.size)", f"{p} = U {u} x R {r}" + ("" if resolved.enabled else " (disabled)")),
        ("U (ulysses_degree)", f"{u}{_auto_note(section, heads, kv_heads)}"),
        ("R (ring degree)", f"{r} = R_outer {plan.ring_outer_size} x R_inner {plan.ring_inner_size}"),
        ("attention", resolved.attention),
    ]  # fmt: skip
    kind, granularity = resolved.ring_layout
    rows.append(("layout", kind + (f" (granularity {granularity})" if kind == "stripe" else "")))
    rows.append(
        ("ring schedule", f"{resolved.ring.schedule}, overlap {'on' if resolved.ring.overlap else 'off'}")
    )
    rows += schedule_rows(resolved, r, u, plan.world_size)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    softcap = getattr(_text_config(model), "attn_logit_softcapping", None)
    where = f"{device} {str(dtype).removeprefix('torch.')}" + (f", softcap {softcap}" if softcap else "")
    rows.append(
        (
            "kernel",
            _runs_as(resolved.kernel, lambda: resolve_kernel(resolved.kernel, device, dtype, softcap), where),
        )
    )
    if resolved.attention == "sparse_ring":
        sparse = resolved.sparse.kernel
        rows.append(
            (
                "sparse kernel",
                _runs_as(sparse, lambda: resolve_sparse_kernel(sparse, device, dtype).name, where),
            )
        )
    lines += _rows(rows)
    lines += ["", "groups (global ranks):", *group_lines(plan)]
    padded = seq_len
    if resolved.enabled:
        multiple = UspLayout(SeqLayout(kind, r, granularity), u, resolved.ring_pieces).multiple
        padded = -(-seq_len // multiple) * multiple
    lines += [
        "",
        "bytes one rank sends per attention layer (parallel/comm_volume.py):",
        f"  S={padded}, B={batch}, H={heads}, H_kv={kv_heads}, D={dim}, {str(dtype).removeprefix('torch.')} "
        f"({element_bytes} B/element), n = S/P = {padded // p} tokens per rank",
    ]
    if padded != seq_len:
        lines.append(f"  (S={seq_len} padded to a multiple of {multiple} for layout '{kind}' x U {u})")
    layer, uneven = busiest_rank_bytes(
        resolved, padded, heads, kv_heads, dim, batch=batch, element_bytes=element_bytes
    )
    lines += bytes_lines(layer)
    lines += link_lines(resolved, padded, heads, kv_heads, dim, batch, element_bytes, plan.world_size)
    if uneven:
        lines.append("  (heads split unevenly over the Ulysses ranks: the rank that sends the most)")
    if resolved.attention == "sparse_ring":
        lines.append(
            "  (sparse_ring: plus the pattern estimation's all-reduces and, when dbsp reassigns blocks, "
            "the rows it moves; docs/sparse.md)"
        )
    return lines


# ---------------------------------------------------------------------------------------------- output


def _one_line(exc: BaseException) -> str:
    return "; ".join(part.strip() for part in str(exc).splitlines() if part.strip()) or type(exc).__name__


def _title(text: str) -> list[str]:
    return ["", text, "-" * len(text)]


def _rows(rows: Sequence[tuple[str, str]]) -> list[str]:
    width = max(len(k) for k, _ in rows) + 2
    return [f"{k + ' ':.<{width}} {v}" for k, v in rows]


def _section(title: str, rows: Sequence[tuple[str, str]]) -> list[str]:
    return _title(title) + _rows(rows)


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def report(
    config: str | None = None,
    world: int | None = None,
    model_config: str | None = None,
    seq_len: int = DEFAULT_SEQ_LEN,
) -> str:
    """The whole report as text (the mesh section only with ``config``)."""
    lines = ["ds_seqpar environment report"]
    lines += versions_section() + devices_section() + kernels_section()
    if config is not None:
        lines += mesh_report(config, world, model_config, seq_len)
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ds_seqpar.report",
        description="Versions, devices, attention kernels and (with --config) the mesh ds_seqpar would build.",
    )
    p.add_argument("--config", help="DeepSpeed JSON with a sequence_parallel section (prints the mesh)")
    p.add_argument("--world", type=int, help="ranks in the world (default: WORLD_SIZE, else dp x size)")
    p.add_argument(
        "--model-config",
        help=f"HF config.json or model directory, for the head counts (default: {DEFAULT_MODEL_CONFIG.relative_to(REPO)})",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=DEFAULT_SEQ_LEN,
        help=f"tokens per sequence (default: {DEFAULT_SEQ_LEN})",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Print the report; 0 on success, 2 (one line on stderr) on a bad input."""
    args = build_parser().parse_args(argv)
    if args.config is None and (args.world is not None or args.model_config is not None):
        print("ds_seqpar.report: error: --world and --model-config need --config", file=sys.stderr)
        return 2
    try:
        text = report(args.config, args.world, args.model_config, args.seq_len)
    except (ValueError, ReportError) as exc:  # SeqParConfigError and LayoutError are ValueErrors
        print(f"ds_seqpar.report: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
