"""The environment sections of ``python -m ds_seqpar.report``: versions, devices, attention kernels.

In the spirit of DeepSpeed's ``ds_report``; nothing here starts torch.distributed or imports an optional
package (versions come from ``importlib.metadata``; kernel availability from the registries' own checks).

1. versions: python, torch (and its CUDA / cuDNN / NCCL build), DeepSpeed, the HF stack, the optional
   fast paths ("not installed" when absent);
2. devices: CPU / CUDA devices, the torch.distributed backends built in, and the one ds_seqpar starts
   (``integrations.deepspeed.init_distributed``: NCCL on CUDA, gloo on CPU);
3. attention kernels: every kernel of the dense and sparse registries per (device, dtype): "yes" or why
   not (the kernel's ``unavailable``), and what ``auto`` resolves to.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

import torch
import torch.distributed as dist

from ds_seqpar.ops.attention import KERNELS, resolve_kernel
from ds_seqpar.ops.sparse.kernels import SPARSE_KERNELS, resolve_sparse_kernel
from ds_seqpar.report.text import one_line, section, table, title

__all__ = [
    "PACKAGES",
    "backend_info",
    "default_backend",
    "device_info",
    "devices_section",
    "kernel_columns",
    "kernel_matrix",
    "kernels_section",
    "package_versions",
    "torch_build",
    "versions_section",
]

NOT_INSTALLED = "not installed"

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
    return section("versions", rows)


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
    return section("devices and backend", rows)


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
        why = f"its availability check failed ({type(exc).__name__}: {one_line(exc)})"
    return "yes" if why is None else why


def _auto(resolve: Callable[[], str]) -> str:
    try:
        return resolve()
    except Exception as exc:
        return f"none ({one_line(exc)})"


def kernel_matrix(columns: Sequence[Column] | None = None) -> dict[str, dict[Column, str]]:
    """``{row: {(device, dtype): "yes" | reason | kernel name}}``: every dense kernel, ``auto`` (and
    ``auto`` with a softcap), every sparse kernel (``sparse <name>``) and sparse ``auto``."""
    cols = kernel_columns() if columns is None else list(columns)
    rows: dict[str, dict[Column, str]] = {}
    for name in KERNELS:
        rows[name] = {c: _reason(lambda d, t, n=name: KERNELS.why_unavailable(n, d, t), *c) for c in cols}
    rows["auto"] = {c: _auto(lambda c=c: resolve_kernel("auto", c[0], c[1])) for c in cols}
    rows["auto + softcap"] = {c: _auto(lambda c=c: resolve_kernel("auto", c[0], c[1], 30.0)) for c in cols}
    for name in SPARSE_KERNELS:
        rows[f"sparse {name}"] = {
            c: _reason(lambda d, t, n=name: SPARSE_KERNELS.why_unavailable(n, d, t), *c) for c in cols
        }
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
    lines = title("attention kernels (sequence_parallel.kernel, sequence_parallel.sparse.kernel)")
    lines += table([header, *body])
    lines += [f"  ({i}) {why}" for why, i in notes.items()]
    return lines
