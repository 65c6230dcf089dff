"""The extension points are real: a schedule, a layout and a kernel written in this file alone (no library
file edited) are registered, configured by name through a ``sequence_parallel`` section, and give exact
attention at P = 4; the schedule's counted bytes equal its own spec's formula per peer.

Registration happens inside the ranks (the task functions below), so the registries of other test modules'
processes never see these toys.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Iterator
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
import torch.distributed as dist

import ds_seqpar
from ds_seqpar.comm import model
from ds_seqpar.comm.layer_bytes import LayerShape, PeerBytes, add_bytes
from ds_seqpar.comm.p2p import RingComm
from ds_seqpar.comm.schedules import RingParams, ScheduleSpec, register_schedule
from ds_seqpar.comm.schedules.ring import RingSchedule
from ds_seqpar.config import load_config
from ds_seqpar.layout import RingLayout, register_layout
from ds_seqpar.ops.attention import AttentionKernel, register_kernel, torch_chunked_kernel
from ds_seqpar.ops.backends import always_available
from ds_seqpar.parallel.linear_scan import linear_attention
from tests.helpers.cases import AttentionCase
from tests.helpers.meshes import mesh_for
from tests.helpers.references import TOL, H, assert_within, dense_reference, qkv_inputs

# ---------------------------------------------------------------------------------------------- a schedule


class ReversedRing:
    """The single ring turned around: every K/V block travels to the PREVIOUS rank (a ``RingSchedule`` over
    the ring's members in reverse order), so ring rank r holds the block of r + s at step s."""

    def __init__(self, comm: RingComm, overlap: bool) -> None:
        self.ring, self.world = RingSchedule(comm, None, overlap), comm.size

    @property
    def size(self) -> int:
        return self.world

    @property
    def ring_rank(self) -> int:
        return self.world - 1 - self.ring.ring_rank

    def incoming(self) -> Any:
        return self.ring.incoming()

    def forward(self, kv: tuple) -> Iterator[tuple[int, tuple]]:
        for owner, block in self.ring.forward(kv):
            yield self.world - 1 - owner, block

    def backward(self, kv: tuple) -> Generator[tuple[int, tuple], list, tuple]:
        steps = self.ring.backward(kv)
        try:
            owner, block = next(steps)
            while True:
                grads = yield self.world - 1 - owner, block
                owner, block = steps.send(grads)
        except StopIteration as done:
            return done.value


class ReversedRingSpec(ScheduleSpec):
    name = "reversed_ring"
    summary = "the ring the other way round (a test of the extension point)"

    def build(self, mesh: Any, params: RingParams) -> ReversedRing:
        r, me = mesh.ring_size, mesh.coords.ring_rank
        members = list(reversed(mesh.members["ring"]))
        return ReversedRing(
            RingComm(mesh.group("ring"), members, r - 1 - me, mesh.comm_stats), params.overlap
        )

    def peer_bytes(self, shape: LayerShape, params: RingParams, rank: int, backward: bool) -> PeerBytes:
        """To the previous rank: (R − 1)·2E_kv·b forward; backward the same + R·2E_kv·a (accumulators)."""
        ring, kv, out = params.ring, 2 * shape.kv_elements, {}
        sent = (ring - 1) * kv * shape.element_bytes + (ring * kv * shape.acc_bytes if backward else 0)
        add_bytes(out, rank, (rank - 1) % ring, "p2p", sent)
        return out

    def rounds(self, params: RingParams, backward: bool) -> int:
        return params.ring - 1 + int(backward)


# ---------------------------------------------------------------------------------------------- a layout


@dataclass(frozen=True)
class ReversedContiguousLayout(RingLayout):
    """Contiguous blocks in reverse rank order: rank r holds tokens [(P-1-r)·n, (P-r)·n)."""

    name: ClassVar[str] = "reversed_contiguous"
    summary: ClassVar[str] = "contiguous, last block on rank 0 (a test of the extension point)"

    def _positions(self, seq_len: int, rank: int) -> torch.Tensor:
        n = seq_len // self.world
        return torch.arange((self.world - 1 - rank) * n, (self.world - rank) * n)


# ---------------------------------------------------------------------------------------------- a kernel

CALLS = {"forward": 0, "backward": 0}
_CHUNKED = torch_chunked_kernel(chunk=5)


def _counted_forward(*args, **kwargs):
    CALLS["forward"] += 1
    return _CHUNKED.forward(*args, **kwargs)


def _counted_backward(*args, **kwargs):
    CALLS["backward"] += 1
    return _CHUNKED.backward(*args, **kwargs)


TOY_KERNEL = AttentionKernel(
    "counted_torch",
    _counted_forward,
    _counted_backward,
    always_available,
    softcap=True,
    summary="a test kernel",
)


def _register_toys() -> None:
    register_schedule(ReversedRingSpec())
    register_layout(ReversedContiguousLayout)
    register_kernel(TOY_KERNEL)


# ---------------------------------------------------------------------------------------------- the runs


def run_toy_cases(cases: list[AttentionCase]) -> list[dict]:
    """Every case on this rank: its section (loaded as a DeepSpeed JSON dict) names the toys; errors of this
    rank's shard against the dense fp64 reference, bytes per peer sent forward and backward, kernel calls."""
    _register_toys()
    world = dist.get_world_size()
    results = []
    for case in cases:
        section, _ = load_config({"sequence_parallel": case.section(world)}, world)
        mesh = mesh_for(section)
        layout = ds_seqpar.input_layout(mesh)
        q, k, v, dout = qkv_inputs(case.seq_len, case.h_kv, case.dtype, case.seed)
        ref = dense_reference(q, k, v, dout, case.spec, None)
        me = mesh.coords.sp_rank
        ql, kl, vl = (layout.shard(t, me).detach().clone().requires_grad_() for t in (q, k, v))
        before = dict(CALLS)
        with mesh.comm_stats.measure() as fwd:
            out = ds_seqpar.attention(ql, kl, vl, mesh=mesh, causal=case.causal)
        with mesh.comm_stats.measure() as bwd:
            out.backward(layout.shard(dout, me))
        errors = {
            name: (got.double() - layout.shard(want, me)).abs().max().item()
            for name, got, want in (("out", out, ref[0]), ("dq", ql.grad, ref[2]), ("dk", kl.grad, ref[3]),
                                    ("dv", vl.grad, ref[4]))
        }  # fmt: skip
        calls = {kind: CALLS[kind] - before[kind] for kind in CALLS}
        model_bytes = {key: _model_peers(case, world, me, key == "bwd") for key in ("fwd", "bwd")}
        results.append(
            {
                "errors": errors,
                "fwd": dict(fwd.peers),
                "bwd": dict(bwd.peers),
                "calls": calls,
                "model": model_bytes,
            }
        )
    return results


def _cases(base: AttentionCase) -> list[AttentionCase]:
    """Causal and not, MHA and MQA, of one mesh (``base``) at S = 64."""
    return [
        replace(base, causal=causal, h_kv=h_kv, seq_len=64, seed=i)
        for i, (causal, h_kv) in enumerate(itertools.product((True, False), (H, 1)))
    ]


def _check_exact(cases: list[AttentionCase], per_rank: list[list[dict]]) -> None:
    for i, case in enumerate(cases):
        for rank, results in enumerate(per_rank):
            assert_within(results[i]["errors"], TOL[torch.float64], f"{case} rank {rank}")


def _model_peers(
    case: AttentionCase, world: int, ring_rank: int, backward: bool
) -> dict[tuple[str, int], int]:
    """The byte model of the case's schedule (for the toy: its own formula, found by name in the registry),
    keyed like CommStats; with U = 1 ring rank = global rank. Called inside the ranks, where the toys are
    registered."""
    shape = LayerShape.of(2, case.seq_len // world, H, case.h_kv, 8, case.dtype.itemsize)
    peers = model.peer_bytes(case.schedule, shape, world, ring_rank, backward=backward)
    return {(kind, peer): n for peer, kinds in peers.items() for kind, n in kinds.items()}


def test_a_schedule_registered_here_is_exact_and_sends_its_own_formula(dist_pool):
    world = 4
    ring = _cases(AttentionCase(schedule="reversed_ring"))
    usp = _cases(AttentionCase(schedule="reversed_ring", u=2, layout="contiguous"))
    per_rank = dist_pool(world).run(run_toy_cases, ring + usp)
    _check_exact(ring + usp, per_rank)
    for i, case in enumerate(ring):  # U = 1: every byte is the schedule's
        for rank, results in enumerate(per_rank):
            for key in ("fwd", "bwd"):
                assert results[i][key] == results[i]["model"][key], (case, rank, key)


def test_a_layout_registered_here_is_exact_for_attention_and_the_state_scan(dist_pool):
    cases = _cases(AttentionCase(u=2, layout="reversed_contiguous"))
    _check_exact(cases, dist_pool(4).run(run_toy_cases, cases))
    errors = dist_pool(4).run(run_linear_toy_layout)
    assert all(e <= 1e-10 for e in errors) and len(errors) == 4


def run_linear_toy_layout() -> float:
    """Linear attention over the toy layout: the All-Scan follows the layout's chain (3, 2, 1, 0)."""
    from ds_seqpar.ops.linear import linear_attention_reference

    _register_toys()
    world = dist.get_world_size()
    mesh = mesh_for({"size": world, "ulysses_degree": 1, "ring": {"layout": "reversed_contiguous"}})
    layout = ds_seqpar.input_layout(mesh)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 32, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    decay = -torch.rand(2, generator=g, dtype=torch.float64) * 0.3
    ref, _ = linear_attention_reference(q, k, v, decay, scale=0.5)
    me = mesh.coords.sp_rank
    out = linear_attention(*(layout.shard(t, me) for t in (q, k, v)), mesh=mesh, log_decay=decay, scale=0.5)
    return (out - layout.shard(ref, me)).abs().max().item()


def test_a_kernel_registered_here_is_exact_and_is_the_one_that_runs(dist_pool):
    cases = _cases(AttentionCase(u=2, kernel="counted_torch"))
    per_rank = dist_pool(4).run(run_toy_cases, cases)
    _check_exact(cases, per_rank)
    for results in per_rank:
        for result in results:
            assert result["calls"]["forward"] > 0 and result["calls"]["backward"] > 0, result
