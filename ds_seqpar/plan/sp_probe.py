"""The local profile's SP-path probe, one process of ``ranks`` (``plan/measure.py`` starts them):
``python -m ds_seqpar.plan.sp_probe RANK RANKS PORT CONFIG_JSON DTYPE``; rank 0 prints one JSON line
(docs/plan.md "Clusters and calibrating"). Gloo over loopback, one thread per process, as a multi-rank
CPU run has.

    sp_step_s   the fixed seconds a step of the real SP path costs beyond the model's own step: the
                wrapped model (``SeqParCausalLM``, ``shard_batch``, the SP-group loss, the gradient
                all-reduce, AdamW) on a tiny sequence of ``TINY`` tokens per rank, minus the unwrapped
                model's step on the same per-rank tokens, timed in the same processes; per kind: ``ring``
                (U = 1, R = ranks) and ``ulysses`` (U = ranks, when the heads allow it). Only for a model
                small enough to build (``measure.MAX_PROBE_PARAMS``)
    attention_probes
                per kind, ``ds_seqpar.attention`` (ring: U = 1, R = ranks through the ring engine;
                ulysses: U = ranks, the all-to-alls around one causal block), forward and backward, at
                ``PROBE_TOKENS`` tokens per rank: the planner compares the slope with the block model's of
                the same work (``predict.sp_calibration``)

Every figure is the median over ``REPS`` of the slowest rank's seconds.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

TINY = 64  # tokens per rank of the fixed-cost step: attention and MLP cost about nothing
PROBE_TOKENS = (512, 2048)  # tokens per rank of the attention probes
PROBE_HEADS = 4
REPS = 5


def _slowest(fn: Callable[[], None], reps: int = REPS) -> float:
    """The median over ``reps`` of the slowest rank's seconds of ``fn`` (after one warm-up)."""
    import torch
    import torch.distributed as dist

    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times)


def _config(path: str) -> Any:
    from transformers import AutoConfig

    data = json.loads(open(path).read())  # noqa: SIM115 - read once
    return AutoConfig.for_model(data.pop("model_type"), **data)


def _mesh(ranks: int, ulysses: int, config: Any) -> Any:
    from ds_seqpar import SeqParMesh
    from ds_seqpar.plan.candidates import Candidate

    section = {**Candidate(ranks, ulysses).section(), "ranks_per_node": ranks}
    return SeqParMesh.from_config(section, config)


def _fixed_step(ranks: int, ulysses: int, config: Any, dt: Any) -> float:
    """The wrapped model's step on TINY tokens per rank minus the plain model's on the same tokens."""
    import copy

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from ds_seqpar import SeqParCausalLM, shard_batch

    mesh = _mesh(ranks, ulysses, config)
    vocab = int(config.vocab_size)
    ids = torch.randint(0, vocab, (1, TINY * ranks), generator=torch.Generator().manual_seed(0))
    local = ids[:, :TINY]

    def build() -> tuple[Any, Any]:
        torch.manual_seed(0)
        cfg = copy.deepcopy(config)  # wrapping routes the attention of its own config only
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dt)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    plain, plain_opt = build()
    model, opt = build()
    wrapped = SeqParCausalLM(model, mesh)

    def sp_step() -> None:
        wrapped(**shard_batch({"input_ids": ids}, mesh)).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in wrapped.parameters() if p.grad is not None])
        dist.all_reduce(flat)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def plain_step() -> None:
        plain(input_ids=local, labels=local).loss.backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    return max(_slowest(sp_step) - _slowest(plain_step), 0.0)


def _attention_probe(ranks: int, ulysses: int, config: Any, dt: Any) -> dict[str, Any]:
    """``ds_seqpar.attention`` (U = ``ulysses``, R = ranks / U, zigzag, causal) forward + backward at
    PROBE_TOKENS tokens per rank, ``heads`` query and K/V heads."""
    import torch

    from ds_seqpar import attention

    mesh = _mesh(ranks, ulysses, config)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    heads = PROBE_HEADS if PROBE_HEADS % ulysses == 0 else ulysses
    seconds = []
    for n in PROBE_TOKENS:
        gen = torch.Generator().manual_seed(n)
        q, k, v = (
            torch.randn(1, n, heads, head_dim, generator=gen, dtype=dt).requires_grad_() for _ in range(3)
        )
        dout = torch.randn(1, n, heads, head_dim, generator=gen, dtype=dt)

        def step(q=q, k=k, v=v, dout=dout) -> None:
            attention(q, k, v, mesh=mesh).backward(dout)
            q.grad = k.grad = v.grad = None

        seconds.append(_slowest(step))
    return {"ranks": ranks, "ulysses": ulysses, "heads": heads, "head_dim": head_dim,
            "tokens": list(PROBE_TOKENS), "seconds": seconds}  # fmt: skip


def main(rank: int, ranks: int, port: int, config_path: str, dtype: str, fixed: bool) -> None:
    import torch
    import torch.distributed as dist

    from ds_seqpar.plan.candidates import allowed_ulysses

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    config = _config(config_path)
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    kinds = {"ring": 1} | ({"ulysses": ranks} if ranks in allowed_ulysses(ranks, heads, kv or heads) else {})
    out: dict[str, Any] = {"attention_probes": {}, "sp_step_s": {}}
    for kind, ulysses in kinds.items():
        out["attention_probes"][kind] = _attention_probe(ranks, ulysses, config, dt)
        if fixed:
            out["sp_step_s"][kind] = _fixed_step(ranks, ulysses, config, dt)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), int(a[2]), a[3], a[4], a[5] == "1")
