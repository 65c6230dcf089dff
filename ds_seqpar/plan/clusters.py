"""Modelled clusters: a node type and its network (the presets of docs/comm_model.md "Projection"), and
what the planner assumes about their compute and memory (docs/plan.md "Clusters").

Units: bandwidths in bytes/s per direction, latencies in seconds, throughputs in FLOP/s per GPU, memory
in bytes. Every number of a preset is an assumption, not a measurement; ``--cluster local`` measures
this machine instead (``plan/profile.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CLUSTERS", "GB", "GIB", "PRESET_COMPUTE", "US", "Cluster", "PresetCompute"]

GB = 1e9
GIB = 2**30
US = 1e-6


@dataclass(frozen=True)
class Cluster:
    """A node type and its network; bandwidths in bytes/s per direction, latencies in seconds."""

    name: str
    gpus_per_node: int
    intra: str  # "switch": one injection bandwidth to every peer; "mesh": one direct link per peer
    intra_bw: float  # switch: injection bandwidth per GPU; mesh: bandwidth of one link
    inter_bw: float  # the GPU's NIC
    lat_intra: float
    lat_inter: float
    flops: float  # effective attention throughput per GPU (FLOP/s), an assumption
    note: str


CLUSTERS = {
    "h100-ib": Cluster(
        "h100-ib", 8, "switch", 450 * GB, 50 * GB, 1 * US, 5 * US, 400e12,
        "8×H100 SXM per node, NVSwitch ~450 GB/s per direction per GPU, 400 Gb/s InfiniBand per GPU, "
        "1 µs / 5 µs latency, 400 TFLOP/s effective bf16 attention",
    ),
    "a100-eth": Cluster(
        "a100-eth", 8, "switch", 300 * GB, 12.5 * GB, 1 * US, 10 * US, 150e12,
        "8×A100 SXM per node, NVSwitch 300 GB/s per direction per GPU, 100 Gb/s Ethernet (RoCE) per GPU, "
        "1 µs / 10 µs latency, 150 TFLOP/s effective bf16 attention",
    ),
    "mi300x-ib": Cluster(
        "mi300x-ib", 8, "mesh", 64 * GB, 50 * GB, 1.5 * US, 5 * US, 500e12,
        "8×MI300X per node, Infinity Fabric full mesh (7 links of ~64 GB/s per direction each), "
        "400 Gb/s per GPU, 1.5 µs / 5 µs latency, 500 TFLOP/s effective bf16 attention",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class PresetCompute:
    """What the planner assumes of a preset's GPU beyond its links (bf16): dense matmul throughput, the
    bytes/s of elementwise ops, a causal block's cost relative to a full one, the attention backward's
    time over its forward, device memory, and host <-> device copy bandwidth (offload)."""

    matmul_flops: float
    memory_bw: float
    causal_cost: float
    attention_backward: float
    memory_bytes: float
    host_bw: float


PRESET_COMPUTE = {
    "h100-ib": PresetCompute(600e12, 2.5e12, 0.55, 2.5, 80 * GIB, 25 * GB),
    "a100-eth": PresetCompute(230e12, 1.5e12, 0.55, 2.5, 80 * GIB, 12 * GB),
    "mi300x-ib": PresetCompute(700e12, 4.0e12, 0.55, 2.5, 192 * GIB, 25 * GB),
}
