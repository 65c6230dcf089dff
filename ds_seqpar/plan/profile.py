"""Compute profiles: what one rank's kernels cost, from a preset's assumptions or measured on this machine
(``--cluster local``; docs/plan.md "Calibrating").

The local profile times, with one thread (as every rank of a multi-rank CPU run has), for the model's
widths and dtype: the attention kernel on a full and on a causal block (forward and backward) and on a
small block (the per-call overhead), and one decoder layer without its attention core (norms, q/k/v/o
projections, a RoPE-like product, SwiGLU MLP, residuals) and the LM head with its loss, at two token
counts (seconds per token and per call). It takes a few seconds and is cached as JSON under
``~/.cache/ds_seqpar/`` (or the path given), keyed by the widths, dtype, device and torch version.
"""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ds_seqpar.plan.clusters import GB, PRESET_COMPUTE, US, Cluster
from ds_seqpar.plan.compute import ModelDims

__all__ = [
    "ComputeProfile",
    "local_cluster",
    "local_profile",
    "preset_profile",
    "profile_key",
    "sp_profile_key",
]

CACHE = Path("~/.cache/ds_seqpar")
LOCAL_LINK_BW = 2 * GB  # gloo over loopback TCP: an assumption (its bytes are small next to CPU compute)
LOCAL_LATENCY = 50 * US
PROFILE_VERSION = 5


@dataclass(frozen=True)
class ComputeProfile:
    """What one rank's compute costs (seconds, FLOP/s, bytes/s).

    ``attention_flops``: forward FLOP/s of a full block (4·D FLOPs per query-key pair); ``causal_cost``: a
    causal block's time over a full block's of the same size; ``attention_backward``: backward over
    forward time; ``call_overhead_s``: seconds per kernel call. ``layer_token_s`` / ``layer_call_s``: one
    decoder layer without its attention core, forward + backward, seconds per token and per call
    (None: from ``matmul_flops`` and ``memory_bw``); ``head_token_s``: the LM head and its loss per token;
    ``step_call_s``: a step's fixed seconds outside the layers (embedding, loss, optimizer, Python).
    ``round_s`` / ``allreduce_s``: one message round / one small all-reduce among the ranks of a node
    (None: the cluster's latency). ``host_bw``: host <-> device copies (offload); ``memory_bytes``: one rank's memory; ``source``: where
    the numbers come from. ``causal_costs``: the causal cost by block side (``causal_cost_at``);
    ``sp_step_s``: the SP path's fixed seconds per step by kind (``ring``, ``ulysses``) and
    ``attention_probes``: ``ds_seqpar.attention`` of each kind timed at two sizes (``plan/sp_probe.py``), both among the node's ranks."""

    source: str
    attention_flops: float
    causal_cost: float
    attention_backward: float
    call_overhead_s: float
    matmul_flops: float
    memory_bw: float
    host_bw: float
    memory_bytes: float
    layer_token_s: float | None = None
    layer_call_s: float = 0.0
    head_token_s: float | None = None
    step_call_s: float = 0.0
    round_s: float | None = None
    allreduce_s: float = 0.0
    threads: int = 1
    causal_costs: dict | None = field(default=None, compare=False, hash=False)
    sp_step_s: dict | None = field(default=None, compare=False, hash=False)
    attention_probes: dict | None = field(default=None, compare=False, hash=False)

    def causal_cost_at(self, side: float) -> float:
        """A causal block's cost over a full one's at ``side`` tokens a side: the measured sides
        interpolated in log2(side), the end slopes extended, kept within [0.5, 1] (``causal_cost`` when
        not measured or ``side`` unknown)."""
        if not self.causal_costs or side <= 0:
            return self.causal_cost
        pts = sorted((math.log2(float(k)), v) for k, v in self.causal_costs.items())
        x = math.log2(side)
        if len(pts) == 1:
            return pts[0][1]
        i = (
            1
            if x <= pts[0][0]
            else len(pts) - 1
            if x >= pts[-1][0]
            else next(j for j in range(1, len(pts)) if x <= pts[j][0])
        )
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return min(1.0, max(0.5, y0 + (y1 - y0) * (x - x0) / (x1 - x0)))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def preset_profile(name: str, cluster: Cluster) -> ComputeProfile:
    """The assumptions of a preset (``plan/clusters.py``): attention at the cluster's throughput."""
    c = PRESET_COMPUTE[name]
    return ComputeProfile(
        f"preset {name} (assumed)", cluster.flops, c.causal_cost, c.attention_backward, 5 * US,
        c.matmul_flops, c.memory_bw, c.host_bw, c.memory_bytes,
    )  # fmt: skip


def local_cluster(ranks_per_node: int, profile: ComputeProfile) -> Cluster:
    """This machine as a 'cluster' of ``ranks_per_node`` ranks per node: gloo over loopback both ways, at
    the measured round latency (the assumed one when not measured)."""
    latency = profile.round_s if profile.round_s is not None else LOCAL_LATENCY
    return Cluster(
        "local", ranks_per_node, "switch", LOCAL_LINK_BW, LOCAL_LINK_BW, latency, latency,
        profile.attention_flops, f"this machine ({profile.source}); links: gloo over loopback",
    )  # fmt: skip


def profile_key(dims: ModelDims, dtype: str, device: str) -> str:
    """The cache key of a local profile: widths, dtype, device, torch version, host."""
    import torch

    widths = (
        f"E{dims.hidden}-H{dims.heads}-K{dims.kv_heads}-D{dims.head_dim}-I{dims.intermediate}-V{dims.vocab}"
    )
    return f"v{PROFILE_VERSION}-{platform.node()}-{device}-{dtype}-torch{torch.__version__}-{widths}"


def sp_profile_key(dims: ModelDims, dtype: str, device: str, ranks: int) -> str:
    """The cache key of the SP-path probe of ``ranks`` processes (``plan/sp_probe.py``)."""
    return f"sp2-{profile_key(dims, dtype, device)}-{ranks}"


def local_profile(
    dims: ModelDims,
    dtype: str = "fp32",
    path: str | Path | None = None,
    *,
    ranks: int = 1,
    model_config: Any = None,
    device: str = "cpu",
    refresh: bool = False,
) -> ComputeProfile:
    """The measured profile of this machine for ``dims`` and ``ranks`` processes (cached at ``path``, default
    ``~/.cache/ds_seqpar/profile.json``; ``refresh`` measures again). ``model_config``: the model's own
    config, whose one- and two-layer versions are timed when small (else a stand-in layer).

    The latencies of ``ranks`` > 1 processes are measured by spawning them, except inside a distributed
    job (then the cached ones, or the assumed latency)."""
    from ds_seqpar.plan import measure

    file = Path(path or CACHE / "profile.json").expanduser()
    key, lat_key = profile_key(dims, dtype, device), f"latency-{platform.node()}-{ranks}"
    sp_key = sp_profile_key(dims, dtype, device, ranks)
    with _locked(file):
        cache = _read(file)
        if key not in cache or refresh:
            cache[key] = ComputeProfile(
                **measure.compute_profile(dims, dtype, device, model_config)
            ).to_json()
        if ranks > 1 and (lat_key not in cache or refresh) and not _in_distributed_job():
            cache[lat_key] = measure.latencies(ranks)
        if (
            ranks > 1
            and device == "cpu"
            and model_config is not None
            and (sp_key not in cache or refresh)
            and not _in_distributed_job()
        ):
            cache[sp_key] = measure.sp_costs(ranks, model_config, dims, dtype)
        _write(file, cache)
    latency = cache.get(lat_key, {}) if ranks > 1 else {"round_s": 0.0, "allreduce_s": 0.0}
    sp = cache.get(sp_key, {}) if ranks > 1 else {}
    known = {f.name for f in fields(ComputeProfile)}
    stored = {k: v for k, v in cache[key].items() if k in known and k not in sp}
    return replace(ComputeProfile(**stored), **latency, **sp)


def _in_distributed_job() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


@contextmanager
def _locked(file: Path) -> Iterator[None]:
    """An exclusive lock beside ``file``: the ranks of a node measure once and all read the same profile."""
    import fcntl

    file.parent.mkdir(parents=True, exist_ok=True)
    with open(file.with_name(file.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read(file: Path) -> dict[str, Any]:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return {}


def _write(file: Path, cache: dict[str, Any]) -> None:
    tmp = file.with_name(f"{file.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=1) + "\n")
    tmp.replace(file)
