"""End-to-end and memory suite worker: a tiny Llama training step under each SP system.

Launched by ``python -m benchmarks.run --suite e2e|memory`` (one ``torchrun`` per P); writes JSON rows
to ``--out``. The model is ``assets/tiny-llama``'s config with random weights (seed 0), fp32; the
batch is one random sequence of S tokens. A step is: forward, token-weighted loss over the SP group,
backward, gradient all-reduce (sum) over the SP group, AdamW step. Both systems use the same loss
semantics, so their first-step losses must agree (reported as ``loss``).

Systems:
    ds_seqpar  ``SeqParCausalLM`` + ``shard_batch`` (ulysses_degree auto, zigzag ring), attention "ds_seqpar"
    alst       DeepSpeed ALST: ``UlyssesSPAttentionHF.register_with_transformers`` over HF "sdpa",
               contiguous shards with global position_ids

``e2e`` mode: time (median of slowest rank), tokens/s and peak memory per rank for each S.
``memory`` mode: for growing S, the peak memory per rank of one step, until it passes ``--budget-mib``;
then 3 bisection probes between the last S that fits and the first that does not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import measure
from benchmarks.common import gather_floats, sum_grads

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "assets" / "tiny-llama"


def _model(attn: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(MODEL_DIR)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)


def _ids(seq_len: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seq_len)
    return torch.randint(4, vocab, (1, seq_len), generator=g)


def _finish_step(model: torch.nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> float:
    """Backward, gradient sum over the ranks, optimizer step; the loss summed over the ranks."""
    loss.backward()
    sum_grads(model)
    opt.step()
    opt.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    if dist.get_world_size() > 1:
        dist.all_reduce(total)
    return float(total)


class DsSeqpar:
    name = "ds_seqpar auto (zigzag)"
    detail = "SeqParCausalLM + shard_batch, ulysses_degree=auto, zigzag ring, sdpa kernel"

    memory: dict = {}  # noqa: RUF012 - sequence_parallel.memory of this system

    def __init__(self) -> None:
        from ds_seqpar import SeqParCausalLM, SeqParMesh
        from ds_seqpar.settings import auto_ulysses_degree

        world = dist.get_world_size()
        model = _model("sdpa")
        u = auto_ulysses_degree(world, model.config.num_attention_heads, model.config.num_key_value_heads)
        section = {"size": world, "ulysses_degree": u, "ring": {"layout": "zigzag"}, "memory": self.memory}
        self.mesh = SeqParMesh.from_config(section)
        self.detail += f" (U={u}, R={world // u})"
        self.model = SeqParCausalLM(model, self.mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.vocab = model.config.vocab_size

    def step(self, ids: torch.Tensor) -> float:
        from ds_seqpar import shard_batch

        batch = shard_batch({"input_ids": ids}, self.mesh)
        loss = self.model(**batch)
        loss.backward()
        sum_grads(self.model)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss)


class Alst:
    mpu: Any = None
    name = "DeepSpeed ALST (UlyssesSPAttentionHF)"
    detail = "register_with_transformers(core 'sdpa'), contiguous shards, global position_ids"

    def __init__(self) -> None:
        import deepspeed
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        self.model = _model("sdpa")
        world = dist.get_world_size()
        if Alst.mpu is None:  # DeepSpeed builds its SP group once per process: the ALST systems share it
            Alst.mpu = UlyssesSPAttentionHF.register_with_transformers(
                model_name_or_path=self.model,
                core_attn_implementation="sdpa",
                sequence_parallel_size=world,
                micro_batch_size=1,
                seq_length_is_variable=True,
            )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.vocab = self.model.config.vocab_size

    def step(self, ids: torch.Tensor) -> float:
        world, rank = dist.get_world_size(), dist.get_rank()
        seq_len = ids.shape[1]
        labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)  # shifted before sharding
        n = seq_len // world
        part = slice(rank * n, (rank + 1) * n)
        positions = torch.arange(seq_len)[None, part]
        logits = self.model(input_ids=ids[:, part], position_ids=positions, use_cache=False).logits
        local = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels[:, part].reshape(-1), reduction="sum"
        )
        count = (labels != -100).sum().float()  # the whole sequence's labelled tokens
        loss = local / count
        return _finish_step(self.model, self.opt, loss)


class DsSeqparSavings(DsSeqpar):
    name = "ds_seqpar, all memory savings"
    detail = DsSeqpar.detail + "; memory: activation_checkpointing + offload + tiled_mlp + tiled_norms"
    memory = {  # noqa: RUF012
        "activation_checkpointing": True,
        "offload": True,
        "tiled_mlp": True,
        "tiled_norms": True,
    }


class AlstSavings(Alst):
    """ALST with every saving DeepSpeed and transformers ship for it: HF activation checkpointing with
    its host offload (on CUDA; on CPU the host is the device), DeepSpeed's ``TiledMLP`` on every MLP (shards = ceil(n / hidden), max over ranks)
    and ``TiledFusedLogitsLoss`` (shards of 1024 tokens, like ds_seqpar's loss chunks)."""

    name = "DeepSpeed ALST, all memory savings"
    detail = Alst.detail + "; HF checkpointing(offload=True) + TiledMLP + TiledFusedLogitsLoss"

    def __init__(self) -> None:
        super().__init__()
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

        # offload=True pins host memory, which needs an accelerator; on CPU the host is the device anyway
        self.model.activation_checkpointing_enable(offload=torch.cuda.is_available())
        self.model.train()

        def mlp_forward(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

        def tiled(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            shards = torch.tensor(-(-x.shape[1] // x.shape[2]))
            if dist.get_world_size() > 1:
                dist.all_reduce(shards, op=dist.ReduceOp.MAX)
            params = [mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight]
            return TiledMLP.apply(mlp_forward, mlp, x, int(shards), params)

        for layer in self.model.model.layers:
            layer.mlp.forward = lambda x, mlp=layer.mlp: tiled(mlp, x)

    def step(self, ids: torch.Tensor) -> float:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

        world, rank = dist.get_world_size(), dist.get_rank()
        seq_len = ids.shape[1]
        labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
        n = seq_len // world
        part = slice(rank * n, (rank + 1) * n)
        positions = torch.arange(seq_len)[None, part]
        hidden = self.model.model(input_ids=ids[:, part], position_ids=positions, use_cache=False)[0]

        def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = model.lm_head(x).float()
            return torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
            )

        shards = -(-n // 1024)
        local = TiledFusedLogitsLoss.apply(
            loss_fn, self.model, hidden, labels[:, part], None, shards, [self.model.lm_head.weight], "sum"
        )
        count = (labels != -100).sum().float()
        loss = local / count
        return _finish_step(self.model, self.opt, loss)


SYSTEMS = {
    "ds_seqpar": DsSeqpar,
    "alst": Alst,
    "ds_seqpar_savings": DsSeqparSavings,
    "alst_savings": AlstSavings,
}


def run_e2e(systems: list, seq_lens: list[int], reps: int) -> list[list[dict]]:
    """Per system, one row per S; the systems are timed round-robin on each S (like the attention suite)."""
    rows: list[list[dict]] = [[] for _ in systems]
    for seq_len in seq_lens:
        first: list[float] = []
        steps = []
        for system in systems:
            ids = _ids(seq_len, system.vocab)
            first.append(system.step(ids))  # warm-up; its loss is the first-step loss

            def step(system=system, ids=ids) -> None:
                system.step(ids)

            steps.append(step)
        times = measure.round_robin_times(steps, reps)
        for i, step in enumerate(steps):
            with measure.PeakMemory() as mem:
                step()
            t = statistics.median(times[i])
            rows[i].append(
                {
                    "S": seq_len,
                    "status": "ok",
                    "time_s": t,
                    "times_s": times[i],
                    "tokens_per_s": seq_len / t,
                    "peak_MiB": max(gather_floats(mem.peak_mib)),
                    "loss": first[i],
                }
            )
            if dist.get_rank() == 0:
                print(f"[e2e P={dist.get_world_size()}] {systems[i].name} S={seq_len}: {t:.3f} s", flush=True)
    return rows


def run_memory(
    system, start: int, growth: float, budget_mib: float, max_len: int, refine: int = 3
) -> list[dict]:
    """Probe S growing by ``growth`` until a step's peak passes the budget, then bisect ``refine`` times
    between the last length that fits and the first that does not (resolution growth^(1/2^refine))."""
    world = dist.get_world_size()
    multiple = 2 * world * 64
    rows: list[dict] = []

    def probe(seq_len: int) -> bool:
        ids = _ids(seq_len, system.vocab)
        system.step(ids)  # warm-up (optimizer state, caches)
        with measure.PeakMemory() as mem:
            system.step(ids)
        peak = max(gather_floats(mem.peak_mib))
        rows.append({"S": seq_len, "status": "ok", "peak_MiB": peak, "fits": peak <= budget_mib,
                     **(_predicted(system, seq_len) or {})})  # fmt: skip
        if dist.get_rank() == 0:
            print(f"[memory P={world}] {system.name} S={seq_len}: peak {peak:.1f} MiB/rank", flush=True)
        return peak <= budget_mib

    seq_len, fits, fails = start, 0, None
    while seq_len <= max_len:
        seq_len = max(multiple, seq_len // multiple * multiple)
        if not probe(seq_len):
            fails = seq_len
            break
        fits = seq_len
        seq_len = int(seq_len * growth) + multiple
    for _ in range(refine if fails is not None and fits else 0):
        mid = (fits + fails) // 2 // multiple * multiple
        if mid <= fits:
            break
        if probe(mid):
            fits = mid
        else:
            fails = mid
    return rows


def _predicted(system: Any, seq_len: int) -> dict | None:
    """The memory model's in-step bytes for a ds_seqpar system (None for peers): what one step allocates
    on top of the resting state (``MemoryEstimate.step_bytes``)."""
    if not isinstance(system, DsSeqpar):
        return None
    from ds_seqpar import memory_estimate

    est = memory_estimate(system.model.model.config, seq_len, system.mesh.settings, zero_stage=0)
    return {"predicted_MiB": est.step_bytes() / 2**20, "phase": est.phase}


def run_trace(system: Any, seq_lens: list[int]) -> list[dict]:
    """Per S: the live-tensor peak of one step (after a warm-up) by module and phase, with the memory
    model's prediction for ds_seqpar systems (``ds_seqpar/memory/trace.py``)."""
    from ds_seqpar.memory.trace import LiveBytes

    rows = []
    for seq_len in seq_lens:
        ids = _ids(seq_len, system.vocab)
        system.step(ids)
        mode = LiveBytes()
        mode.name_modules(system.model)
        with mode:
            system.step(ids)
        peak = max(gather_floats(mode.peak / 2**20))
        row = {"S": seq_len, "status": "ok", "traced_peak_MiB": peak,
               "breakdown_MiB": {k: v / 2**20 for k, v in mode.at_peak.most_common(12)}}  # fmt: skip
        row.update(_predicted(system, seq_len) or {})
        rows.append(row)
        if dist.get_rank() == 0:
            print(f"[trace P={dist.get_world_size()}] {system.name} S={seq_len}: {peak:.1f} MiB "
                  f"(predicted {row.get('predicted_MiB', float('nan')):.1f})\n{mode.table(12)}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=["e2e", "memory", "trace"], required=True)
    parser.add_argument("--systems", default="ds_seqpar,alst")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--budget-mib", type=float, default=512.0)
    parser.add_argument("--first-len", type=int, default=2048, help="memory mode: the first S probed")
    parser.add_argument("--growth", type=float, default=1.25)
    parser.add_argument("--max-len", type=int, default=262144)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    rows, ready = [], []
    for key in args.systems.split(","):
        try:
            system = SYSTEMS[key]()
        except Exception as exc:  # a peer that cannot start is reported
            why = f"{type(exc).__name__}: {exc}"[:300]
            rows.append({"system": key, "peer": key, "P": world, "status": "failed", "why": why})
            continue
        ready.append(({"system": system.name, "peer": key, "detail": system.detail, "P": world}, system))
    if args.mode == "e2e":
        results = run_e2e([system for _, system in ready], args.seq_lens, args.reps)
    elif args.mode == "trace":
        results = [run_trace(system, args.seq_lens) for _, system in ready]
    else:
        results = [
            run_memory(system, args.first_len, args.growth, args.budget_mib, args.max_len)
            for _, system in ready
        ]
    for (base, _), got in zip(ready, results):
        rows += [{**base, **r} for r in got]
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
