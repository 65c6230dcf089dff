"""``python -m ds_seqpar.report``: what this environment offers ds_seqpar, and the mesh a config builds.

In the spirit of DeepSpeed's ``ds_report``; nothing here starts torch.distributed or imports an
optional package::

    python -m ds_seqpar.report                                   # versions, devices, kernels
    python -m ds_seqpar.report --config ds_configs/usp_zero3.json --world 8 [--model-config DIR]
        [--seq-len 4096]                                         # + mesh, groups, bytes per layer

The environment sections are ``report/environment.py``; the mesh section (what ``SeqParMesh.from_config``
would build, read from the settings, plan and schedule spec the library builds) is ``report/mesh.py``.
Errors (a missing file, a bad config or model config) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ds_seqpar.report.environment import (
    PACKAGES,
    backend_info,
    device_info,
    devices_section,
    kernel_columns,
    kernel_matrix,
    kernels_section,
    package_versions,
    versions_section,
)
from ds_seqpar.report.mesh import (
    DEFAULT_MODEL_CONFIG,
    DEFAULT_SEQ_LEN,
    REPO,
    ReportError,
    load_model_config,
    mesh_report,
)
from ds_seqpar.report.text import one_line

__all__ = [
    "PACKAGES",
    "ReportError",
    "backend_info",
    "build_parser",
    "device_info",
    "kernel_columns",
    "kernel_matrix",
    "kernels_section",
    "load_model_config",
    "main",
    "mesh_report",
    "package_versions",
    "report",
    "versions_section",
]


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
        print(f"ds_seqpar.report: error: {one_line(exc)}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0
