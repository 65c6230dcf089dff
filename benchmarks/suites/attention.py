"""Attention suite worker: one gloo group of P ranks times every system on every (S, H_kv) case.

Launched by ``python -m benchmarks.run --suite attention`` (one ``torchrun`` per P); writes its rows
as JSON to ``--out``. Every system gets the same global q, k, v, dout ``[1, S, H, D]`` (fp32), sharded
the way that system expects, and is first checked against a single-process reference at a small S
(max abs error of out, dq, dk, dv is reported). Per case, the systems are timed round-robin (median fwd+bwd wall time of the
slowest rank), then bytes sent per rank (max over ranks), attention work balance (max / mean score pairs
per rank) and peak resident memory per rank (max over ranks). Two references are timed in the same
round-robin: the local kernel alone in one process (T_single) and on every rank at once with nothing
sent (T_ceiling).

Systems (a builder returns a runner, or raises ``Unsupported`` with the reason):
    ds_seqpar      ``ds_seqpar.attention`` (auto factorisation, Ulysses, ring zigzag, U x R)
    deepspeed      ``deepspeed.sequence.layer.DistributedAttention`` (Ulysses) + flash local attention
    yunchang       ``yunchang.LongContextAttention`` (USP; zigzag ring), flash-attn via the shim
    ring-flash-attn  ``zigzag_ring_flash_attn_func`` / ``ring_flash_attn_func`` via the shim
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from benchmarks import measure, peers
from benchmarks.common import gather_floats

Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Unsupported(Exception):
    """This system cannot run this case; the message says why (it goes into the table)."""


@dataclass
class System:
    name: str  # row label
    peer: str  # ds_seqpar | deepspeed | yunchang | ring-flash-attn
    detail: str  # what exactly ran
    build: Callable[[int, int], tuple[Runner, Callable[[torch.Tensor], torch.Tensor]]]
    # build(H, H_kv) -> (run(q, k, v) -> out, shard(x_global [B, S, ...]) -> this rank's tokens)


def _zigzag(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    chunks = x.chunk(2 * world, dim=1)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=1).contiguous()


def _contiguous(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return x.chunk(world, dim=1)[rank].contiguous()


# ---------------------------------------------------------------------------------------------- systems


def _auto(world: int, h: int, h_kv: int) -> int:
    from ds_seqpar.config import auto_ulysses_degree

    return auto_ulysses_degree(world, h, h_kv)


def _pipelined(world: int, h: int, h_kv: int) -> bool:
    """Whether ``ulysses_degree="auto"`` pipelines head groups here (R = 1 and the heads split)."""
    from ds_seqpar.comm.all_to_all import HeadPlan
    from ds_seqpar.parallel.ulysses_pipeline import HeadGroups

    u = _auto(world, h, h_kv)
    return u == world and u > 1 and HeadGroups.build(HeadPlan.build(h, h_kv, u), 4) is not None


def _ds_seqpar(ulysses: int | str, ctx: dict, chunks: int | str = "auto") -> Callable:
    def build(h: int, h_kv: int):
        import ds_seqpar
        import ds_seqpar.parallel.ring.execute as ring
        from ds_seqpar import SeqParMesh

        world = dist.get_world_size()
        u = _auto(world, h, h_kv) if ulysses == "auto" else ulysses
        if world % u or u > h:
            raise Unsupported(f"U={u} does not divide P={world} or exceeds H={h}")
        key = f"mesh{u}"
        if key not in ctx:  # systems with the same U share the process groups
            ctx[key] = SeqParMesh.build(world, u)
        section = {"size": world, "ulysses_degree": u, "ulysses_chunks": chunks, "ring": {"layout": "zigzag"}}
        mesh = ctx[f"{key}:{chunks}"] = ctx[key].with_section(section)
        _count_ds_seqpar_pairs(ring)
        layout = ds_seqpar.input_layout(mesh)
        rank = mesh.coords.sp_rank

        def run(q, k, v):
            return ds_seqpar.attention(q, k, v, mesh=mesh, causal=True)

        return run, lambda x: layout.shard(x, rank, dim=1).contiguous()

    build.ulysses, build.chunks = ulysses, chunks
    return build


def _count_ds_seqpar_pairs(ring) -> None:
    """Count ds_seqpar's kernel calls (score pairs) the way the flash shim counts the peers'."""
    if getattr(ring, "_bench_counted", False):
        return
    from flash_attn import flash_attn_interface as shim

    for name in ("block_attn_forward", "block_attn_backward"):
        original = getattr(ring, name)
        q_arg = 0 if name == "block_attn_forward" else 1

        def counted(*args, _original=original, _q=q_arg, **kwargs):
            q, k = args[_q], args[_q + 1]
            causal = kwargs.get("causal", False)
            shim.PAIRS[0] += measure.attention_pairs(q.shape[1], k.shape[1], q.shape[2], q.shape[0], causal)
            return _original(*args, **kwargs)

        setattr(ring, name, counted)
    ring._bench_counted = True


def _deepspeed_ulysses(ctx: dict) -> Callable:
    def build(h: int, h_kv: int):
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention
        from flash_attn import flash_attn_func

        world, rank = dist.get_world_size(), dist.get_rank()
        if h % world:
            raise Unsupported(
                f"DistributedAttention splits heads evenly: H={h} is not a multiple of P={world}"
            )
        if not ctx.get("ds_comm"):
            deepspeed.init_distributed(dist_backend="gloo", verbose=False)
            ctx["ds_comm"] = True

        def local(q, k, v, *args, **kwargs):
            return flash_attn_func(q, k, v, causal=True)

        attn = DistributedAttention(local, dist.group.WORLD, scatter_idx=2, gather_idx=1)

        def run(q, k, v):
            return attn(q, k, v, 0)

        return run, lambda x: _contiguous(x, rank, world)

    return build


def _yunchang(u: int, ring_impl: str, ctx: dict) -> Callable:
    def build(h: int, h_kv: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        if ctx["missing"].get("yunchang"):
            raise Unsupported(ctx["missing"]["yunchang"])
        import yunchang
        from yunchang.comm.extract_local import EXTRACT_FUNC_DICT
        from yunchang.globals import PROCESS_GROUP
        from yunchang.kernels import AttnType

        r = world // u
        if h % u or h_kv % u:
            raise Unsupported(
                f"yunchang's all-to-all splits q and k/v heads evenly: H={h}, H_kv={h_kv}, U={u}"
            )
        key = f"yunchang{u}"
        if ctx.get("yunchang_pg") != key:
            yunchang.set_seq_parallel_pg(u, r, rank, world)
            ctx["yunchang_pg"] = key
        if r == 1:
            # LongContextAttention with a ring of one sends K/V to itself, which gloo refuses
            # ("Pair is not connected"); yunchang's own Ulysses layer is the U = P system
            attn = yunchang.UlyssesAttention(PROCESS_GROUP.ULYSSES_PG, attn_type=AttnType.FA)
        else:
            attn = yunchang.LongContextAttention(ring_impl_type=ring_impl, attn_type=AttnType.FA)
        extract = EXTRACT_FUNC_DICT[ring_impl]

        def run(q, k, v):
            return attn(q, k, v, causal=True)

        groups = (PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG)

        def shard(x: torch.Tensor) -> torch.Tensor:
            # yunchang's extract reads its global groups: give it this system's (others may have replaced them)
            PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = groups
            return extract(x, rank, world, r, u).contiguous()

        return run, shard

    return build


def _ring_flash_attn(kind: str, ctx: dict) -> Callable:
    def build(h: int, h_kv: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        if ctx["missing"].get("ring_flash_attn"):
            raise Unsupported(ctx["missing"]["ring_flash_attn"])
        import ring_flash_attn

        fn = {
            "zigzag": ring_flash_attn.zigzag_ring_flash_attn_func,
            "basic": ring_flash_attn.ring_flash_attn_func,
        }[kind]
        shard = _zigzag if kind == "zigzag" else _contiguous

        def run(q, k, v):
            return fn(q, k, v, causal=True, group=dist.group.WORLD)

        return run, lambda x: shard(x, rank, world)

    return build


# ---------------------------------------------------------------------------------------------- packed rows

PACKED_ROWS = {  # document boundaries as fractions of S (S = 4096: 512 + 1024 + 2560, and 16 x 256)
    "3 documents (512, 1024, 2560)": [0.0, 0.125, 0.375, 1.0],
    "16 documents of S/16": [i / 16 for i in range(17)],
}


def _cu(fractions: list[float] | None, seq_len: int) -> list[int] | None:
    return None if fractions is None else [round(f * seq_len) for f in fractions]


def _ds_seqpar_packed(ulysses: int | str, ctx: dict, fractions: list[float]) -> Callable:
    def build(h: int, h_kv: int):
        import ds_seqpar
        from ds_seqpar.layout import doc_ids_from_cu_seqlens

        _run_dense, shard = _ds_seqpar(ulysses, ctx)(h, h_kv)
        u = _auto(dist.get_world_size(), h, h_kv) if ulysses == "auto" else ulysses
        mesh = ctx[f"mesh{u}:auto"]
        docs: dict[int, torch.Tensor] = {}

        def run(q, k, v):
            s = q.shape[1] * dist.get_world_size()
            if s not in docs:
                docs[s] = doc_ids_from_cu_seqlens(_cu(fractions, s), s)
            return ds_seqpar.attention(q, k, v, mesh=mesh, causal=True, doc_ids=docs[s])

        return run, shard

    build.ulysses, build.chunks = ulysses, "auto"
    return build


def _per_document_zigzag(x: torch.Tensor, cu: list[int], rank: int, world: int) -> torch.Tensor:
    """ring-flash-attn's varlen zigzag layout: every document split in 2P chunks, chunks r and 2P-1-r."""
    parts = []
    for a, b in itertools.pairwise(cu):
        chunks = x[:, a:b].chunk(2 * world, dim=1)
        parts += [chunks[rank], chunks[2 * world - 1 - rank]]
    return torch.cat(parts, dim=1).contiguous()


def _ring_flash_attn_varlen(kind: str, ctx: dict, fractions: list[float]) -> Callable:
    def build(h: int, h_kv: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        if ctx["missing"].get("ring_flash_attn"):
            raise Unsupported(ctx["missing"]["ring_flash_attn"])
        import ring_flash_attn

        def run(q, k, v):
            s = q.shape[1] * world
            cu = torch.tensor(_cu(fractions, s), dtype=torch.int32)
            if kind == "zigzag":
                local = cu // world
                longest = int((local[1:] - local[:-1]).max())
                out = ring_flash_attn.zigzag_ring_flash_attn_varlen_func(
                    q[0], k[0], v[0], local, longest, causal=True, group=dist.group.WORLD
                )
            else:
                cu_q, cu_k, max_q, max_k, k_slice = ring_flash_attn.llama3_flash_attn_prepare_cu_seqlens(
                    cu, True, rank, world
                )
                out = ring_flash_attn.llama3_flash_attn_varlen_func(
                    q[0], k[0], v[0], cu_q, cu_k, max_q, max_k, heads_k_stride=1, local_k_slice=k_slice,
                    causal=True, group=dist.group.WORLD,
                )  # fmt: skip
            return out[None]

        def shard(x: torch.Tensor) -> torch.Tensor:
            if kind == "zigzag":
                return _per_document_zigzag(x, _cu(fractions, x.shape[1]), rank, world)
            return _contiguous(x, rank, world)

        return run, shard

    return build


def packed_systems(world: int, ctx: dict, fractions: list[float]) -> list[System]:
    """The systems of a packed-documents row: ds_seqpar (default and pure ring) and ring-flash-attn's
    varlen functions (zigzag per document, and the Llama-3 all-gather)."""
    return [
        System("ds_seqpar auto", "ds_seqpar", "ds_seqpar.attention(doc_ids=...), ulysses_degree=auto", _ds_seqpar_packed("auto", ctx, fractions)),
        System(f"ds_seqpar ring 1x{world} zigzag", "ds_seqpar", "U=1, R=P, zigzag, doc_ids", _ds_seqpar_packed(1, ctx, fractions)),
        System("ring-flash-attn zigzag varlen", "ring-flash-attn", "zigzag_ring_flash_attn_varlen_func (documents zigzagged)", _ring_flash_attn_varlen("zigzag", ctx, fractions)),
        System("ring-flash-attn llama3 varlen", "ring-flash-attn", "llama3_flash_attn_varlen_func (contiguous shards)", _ring_flash_attn_varlen("llama3", ctx, fractions)),
    ]  # fmt: skip


def systems(world: int, ctx: dict) -> list[System]:
    rows = [
        System(
            "ds_seqpar auto",
            "ds_seqpar",
            "ds_seqpar.attention, ulysses_degree=auto, zigzag ring",
            _ds_seqpar("auto", ctx),
        ),
        System(f"ds_seqpar ulysses {world}x1", "ds_seqpar", "U=P, R=1", _ds_seqpar(world, ctx)),
        System(f"ds_seqpar ring 1x{world} zigzag", "ds_seqpar", "U=1, R=P, zigzag", _ds_seqpar(1, ctx)),
    ]
    rows.append(
        System(
            "ds_seqpar auto, one exchange",
            "ds_seqpar",
            "as auto, ulysses_chunks=1 (no pipelined head groups)",
            _ds_seqpar("auto", ctx, chunks=1),
        )
    )
    if world == 4:
        rows.append(System("ds_seqpar usp 2x2 zigzag", "ds_seqpar", "U=2, R=2, zigzag", _ds_seqpar(2, ctx)))
    rows += [
        System(
            "deepspeed DistributedAttention",
            "deepspeed",
            "Ulysses all-to-all + flash_attn_func (shim)",
            _deepspeed_ulysses(ctx),
        ),
        System(
            f"yunchang ulysses {world}x1",
            "yunchang",
            "UlyssesAttention, U=P",
            _yunchang(world, "zigzag", ctx),
        ),
        System(
            f"yunchang ring 1x{world} zigzag",
            "yunchang",
            "LongContextAttention, U=1, zigzag ring",
            _yunchang(1, "zigzag", ctx),
        ),
    ]
    if world == 4:
        rows.append(
            System(
                "yunchang usp 2x2 zigzag",
                "yunchang",
                "LongContextAttention, U=2, R=2, zigzag",
                _yunchang(2, "zigzag", ctx),
            )
        )
    rows += [
        System(
            "ring-flash-attn zigzag",
            "ring-flash-attn",
            "zigzag_ring_flash_attn_func",
            _ring_flash_attn("zigzag", ctx),
        ),
        System(
            "ring-flash-attn ring",
            "ring-flash-attn",
            "ring_flash_attn_func (contiguous)",
            _ring_flash_attn("basic", ctx),
        ),
    ]
    return rows


# ---------------------------------------------------------------------------------------------- measuring


def _inputs(seq_len: int, h: int, h_kv: int, d: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seq_len + h_kv)
    return [torch.randn(1, seq_len, n, d, generator=g).to(dtype) for n in (h, h_kv, h_kv, h)]


def _reference(q, k, v, dout, cu: list[int] | None = None):
    """Single-process causal attention with gradients, on the full sequence (packed documents ``cu``)."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    mask = None
    if cu is not None:
        from ds_seqpar.layout import doc_ids_from_cu_seqlens
        from ds_seqpar.ops.masks import MaskSpec, token_mask

        pos, docs = torch.arange(q.shape[1]), doc_ids_from_cu_seqlens(cu, q.shape[1])
        mask = token_mask(pos, pos, MaskSpec(), docs, docs)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(rep, 2).transpose(1, 2),
        v.repeat_interleave(rep, 2).transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None,
    ).transpose(1, 2)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _max_error(
    run: Runner, shard, global_inputs: list[torch.Tensor], fractions: list[float] | None = None
) -> float:
    q, k, v, dout = global_inputs
    ref = _reference(q.double(), k.double(), v.double(), dout.double(), _cu(fractions, q.shape[1]))
    local = [shard(x).requires_grad_(i < 3) for i, x in enumerate((q, k, v, dout))]
    out = run(*local[:3])
    out.backward(local[3])
    got = (out.detach(), local[0].grad, local[1].grad, local[2].grad)
    err = max(float((g.double() - shard(r)).abs().max()) for g, r in zip(got, ref))
    t = torch.tensor([err])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _max_and_mean(value: float) -> tuple[float, float]:
    values = gather_floats(value)
    return max(values), sum(values) / len(values)


def _prepared(run: Runner, shard, global_inputs) -> Callable[[], None]:
    """One fwd+bwd step of this system on its shard of the inputs."""
    q, k, v, dout = (shard(x) for x in global_inputs)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def step() -> None:
        run(q, k, v).backward(dout)

    return step


WRONG_ABOVE = {"fp32": 1e-3, "bf16": 0.25}  # max abs error vs fp64 beyond which a row is "wrong result"
REFERENCE_ONE_PROCESS = "reference: one process"
REFERENCE_NO_COMM = "reference: no communication"


def reference_steps(
    seq_len: int, h: int, h_kv: int, d: int, dtype: torch.dtype, fractions: list[float] | None = None
) -> list[tuple[dict, Callable]]:
    """The machine's own numbers, timed round-robin with the systems: the local kernel (sdpa, fwd+bwd,
    causal) and nothing else. ``one process``: rank 0 alone on the whole sequence and all heads
    (T_single). ``no communication``: every rank at once on H/P heads of the whole sequence (the
    work of a perfect split with free communication: T_ceiling)."""
    from ds_seqpar.ops.attention import block_attn_backward, block_attn_forward

    world, rank = dist.get_world_size(), dist.get_rank()

    cu = _cu(fractions, seq_len) or [0, seq_len]

    def kernel_step(heads: int, kv_heads: int, active: bool) -> Callable[[], None]:
        g = torch.Generator().manual_seed(seq_len)
        q, dout = (torch.randn(1, seq_len, heads, d, generator=g).to(dtype) for _ in range(2))
        k, v = (torch.randn(1, seq_len, kv_heads, d, generator=g).to(dtype) for _ in range(2))

        def step() -> None:  # one causal call per document (one for the whole sequence without documents)
            if not active:
                return
            for a, b in itertools.pairwise(cu):
                qd, kd, vd, dd = (x[:, a:b] for x in (q, k, v, dout))
                out, lse = block_attn_forward(qd, kd, vd, causal=True, kernel="sdpa", out_dtype=dtype)
                block_attn_backward(dd, qd, kd, vd, out, lse, causal=True, kernel="sdpa", grad_dtype=dtype)

        return step

    return [
        (
            {
                "system": REFERENCE_ONE_PROCESS,
                "detail": "rank 0 alone: the local kernel, whole sequence, all heads",
            },
            kernel_step(h, h_kv, rank == 0),
        ),
        (
            {
                "system": REFERENCE_NO_COMM,
                "detail": "every rank at once: the local kernel on H/P heads, nothing sent",
            },
            kernel_step(max(1, h // world), max(1, h_kv // world), True),
        ),
    ]


def measure_interleaved(steps: list[Callable[[], None]], reps: int) -> list[dict]:
    """Time every system on one case, round-robin (rep 1 of each, then rep 2 of each, ...; the
    starting system rotates), so slow drifts of a shared machine hit every row alike. Then one
    more step each for bytes sent, work pairs and peak memory."""
    from flash_attn import flash_attn_interface as shim

    for step in steps:
        measure.slowest_rank_times(step, reps=0, warmup=1)
    times: list[list[float]] = [[] for _ in steps]
    for rep in range(reps):
        for j in range(len(steps)):
            i = (j + rep) % len(steps)
            times[i] += measure.slowest_rank_times(steps[i], reps=1, warmup=0)
    results = []
    for step, ts in zip(steps, times):
        shim.PAIRS[0] = 0
        with measure.PeakMemory() as mem, measure.SentBytes() as sent:
            step()
        pairs_max, pairs_mean = _max_and_mean(shim.PAIRS[0])
        results.append(
            {
                "time_s": statistics.median(ts),
                "times_s": ts,
                "sent_MiB": _max_and_mean(sent.total / 2**20)[0],
                "balance": pairs_max / pairs_mean if pairs_mean else float("nan"),
                "pairs_per_rank_max": pairs_max,
                "peak_MiB": _max_and_mean(mem.peak_mib)[0],
            }
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", required=True)
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--check-len", type=int, default=512)
    parser.add_argument("--only", default=None, help="comma-separated peers to run (default: all)")
    parser.add_argument(
        "--packed", action="store_true", help="packed-documents rows (PACKED_ROWS) at the first --seq-lens"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    ctx: dict = {"missing": peers.activate()}
    only = None if args.only is None else set(args.only.split(","))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    rows = []
    cases = (
        [(h_kv, args.seq_lens, None, None) for h_kv in args.kv_heads]
        if not args.packed
        else [(args.kv_heads[0], args.seq_lens[:1], name, f) for name, f in PACKED_ROWS.items()]
    )
    for h_kv, seq_lens, docs_name, fractions in cases:
        ready = []  # (row base, run, shard) of every system that passed its check
        listed = systems(world, ctx) if fractions is None else packed_systems(world, ctx, fractions)
        for system in listed:
            if only is not None and system.peer not in only:
                continue
            if (
                system.peer == "ds_seqpar"
                and system.name != "ds_seqpar auto"
                and system.build.ulysses == _auto(world, args.heads, h_kv)
            ):
                continue  # the same run as the "ds_seqpar auto" row
            if (
                system.peer == "ds_seqpar"
                and system.build.chunks == 1
                and not _pipelined(world, args.heads, h_kv)
            ):
                continue  # auto runs one exchange here anyway
            base = {
                "system": system.name,
                "peer": system.peer,
                "detail": system.detail,
                "P": world,
                "H": args.heads,
                "H_kv": h_kv,
                "D": args.dim,
                "dtype": args.dtype,
                "docs": docs_name,
            }
            try:
                run, shard = system.build(args.heads, h_kv)
                base["max_abs_err"] = _max_error(
                    run, shard, _inputs(args.check_len, args.heads, h_kv, args.dim, dtype), fractions
                )
            except Unsupported as why:
                rows += [{**base, "S": s, "status": "unsupported", "why": str(why)} for s in seq_lens]
                continue
            except Exception as exc:
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                rows += [{**base, "S": s, "status": "failed", "why": why} for s in seq_lens]
                continue
            if not base["max_abs_err"] <= WRONG_ABOVE[args.dtype]:  # timed, but never a "fastest peer"
                base["status"] = "wrong result"
                base["why"] = f"max abs err {base['max_abs_err']:.1e} vs the fp64 reference"
            if system.peer == "ds_seqpar":
                u = _auto(world, args.heads, h_kv) if system.build.ulysses == "auto" else system.build.ulysses
                base["detail"] += f" (U={u}, R={world // u})"
            ready.append((base, run, shard))
        for seq_len in seq_lens:
            inputs = _inputs(seq_len, args.heads, h_kv, args.dim, dtype)
            references = reference_steps(seq_len, args.heads, h_kv, args.dim, dtype, fractions)
            bases = [base for base, _, _ in ready] + [
                {
                    **ref,
                    "peer": "reference",
                    "P": world,
                    "H": args.heads,
                    "H_kv": h_kv,
                    "D": args.dim,
                    "dtype": args.dtype,
                    "docs": docs_name,
                }
                for ref, _ in references
            ]
            steps = [_prepared(run, shard, inputs) for _, run, shard in ready] + [
                step for _, step in references
            ]
            for base, result in zip(bases, measure_interleaved(steps, args.reps)):
                if base["peer"] == "reference":  # no kernel-call counting, no correctness check: no balance
                    result = {k: v for k, v in result.items() if k not in ("balance", "pairs_per_rank_max")}
                rows.append({"status": "ok", **base, "S": seq_len, **result})
                if rank == 0:
                    err = f"  (err {base['max_abs_err']:.1e})" if "max_abs_err" in base else ""
                    print(
                        f"[attention P={world}] {base['system']} H_kv={h_kv} S={seq_len}: {result['time_s']:.3f} s{err}",
                        flush=True,
                    )
            del steps, inputs
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # peers leave process groups behind; do not wait on their teardown


if __name__ == "__main__":
    main()
