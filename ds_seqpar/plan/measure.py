"""The local profile's measurements (``plan/profile.py``, docs/plan.md "Calibrating"): a few seconds,
one thread, the model's widths and dtype.

    attention   the attention kernel on n×n blocks (n = 2048, 4 heads, the model's D), full and causal,
                forward and backward; a 64-token block for the per-call overhead; full and causal forward
                at 512 to 8192 tokens a side (the causal cost per side)
    model       the model itself (its config with 1 and 2 layers, random weights, its attention core
                replaced by q + k + v) training steps of 512 and 2048 tokens: per layer and per step,
                seconds per token and fixed seconds; a large model (> 50 M
                parameters per layer and head) is replaced by a stand-in layer (``plan/probe.py``)
    matmul      a [2048, E] × [E, I] product
    latencies   ``ranks`` gloo processes on this machine: one ring round (batched isend / irecv) and one
                small all-reduce
    SP path     ``ranks`` gloo processes: the SP path's fixed seconds per step and the ring engine's
                attention at two sizes (``plan/sp_probe.py``)
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from typing import Any

from ds_seqpar.plan.clusters import GB, GIB
from ds_seqpar.plan.compute import ModelDims

__all__ = ["compute_profile", "latencies", "sp_costs"]

SMALL, LARGE = 512, 2048  # tokens of the model probe's two steps
BLOCK = 2048  # tokens a side of the attention probe's blocks
CAUSAL_SIDES = (512, 1024, 2048, 4096, 8192)  # sides at which a causal block's cost is measured
MAX_PROBE_PARAMS = 50e6


def _best(fn: Callable[[], Any], reps: int = 5) -> float:
    """The fastest of ``reps`` timed calls after one warm-up (seconds)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def compute_profile(dims: ModelDims, dtype: str, device: str, model_config: Any = None) -> dict[str, Any]:
    """Measure this machine (one thread) for ``dims``: the fields of a ``ComputeProfile``; see the module doc."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        attn = _attention_probe(dims, dt, device)
        small = model_config is not None and _probe_params(dims) <= MAX_PROBE_PARAMS
        model = _model_probe(model_config, dims, dt, device) if small else _layer_probe(dims, dt, device)
        matmul = _matmul_probe(dims, dt, device)
    finally:
        torch.set_num_threads(threads)
    what = "model" if small else "stand-in layer"
    return {
        "source": f"measured on {platform.node()} ({device}, {dtype}, 1 thread, {what} probe, "
        f"{time.strftime('%Y-%m-%d')})",
        "attention_flops": attn["flops"], "causal_cost": attn["causal_cost"],
        "attention_backward": attn["backward"], "call_overhead_s": attn["call_s"], "matmul_flops": matmul,
        "causal_costs": attn["causal_costs"],
        "memory_bw": model["memory_bw"], "host_bw": 10 * GB, "memory_bytes": _memory_bytes(),
        "layer_token_s": model["token_s"], "layer_call_s": model["call_s"],
        "head_token_s": model["head_token_s"], "step_call_s": model["step_s"],
    }  # fmt: skip


def _probe_params(dims: ModelDims) -> float:
    e = dims.hidden
    return (
        2 * (e * dims.head_dim * (2 * dims.heads + 2 * dims.kv_heads) + 3 * e * dims.intermediate)
        + 2 * e * dims.vocab
    )


def _attention_probe(dims: ModelDims, dt: Any, device: str) -> dict[str, float]:
    import torch

    from ds_seqpar.ops.attention import KERNELS

    kernel = KERNELS["sdpa" if device == "cpu" else "cuda_sdpa"]
    why = kernel.unavailable(torch.device(device), dt)
    if why:
        raise RuntimeError(f"--cluster local: the {kernel.name} kernel cannot run here: {why}")
    heads, d, n = 4, dims.head_dim, BLOCK
    scale = d**-0.5

    def block(tokens: int, causal: bool, backward: bool = True) -> tuple[float, float]:
        q, k, v = (torch.randn(1, tokens, heads, d, dtype=dt, device=device) for _ in range(3))
        out, lse = kernel.forward(q, k, v, scale, None, causal)
        dout = torch.randn_like(out)
        reps = 5 if tokens <= n else 3
        fwd = _best(lambda: kernel.forward(q, k, v, scale, None, causal), reps)
        if not backward:
            return fwd, 0.0
        bwd = _best(lambda: kernel.backward(dout, q, k, v, out, lse, scale, None, causal), reps)
        return fwd, bwd

    full_f, full_b = block(n, False)
    causal_f, _ = block(n, True)
    small_f, small_b = block(64, False)
    call_s = (small_f + small_b) / 2
    costs = {}  # a causal block's forward over a full one's, per side (the kernel skips more of a larger one)
    for side in CAUSAL_SIDES:
        f_full = full_f if side == n else block(side, False, backward=False)[0]
        f_causal = causal_f if side == n else block(side, True, backward=False)[0]
        costs[str(side)] = (f_causal - call_s) / max(f_full - call_s, 1e-9)
    return {
        "flops": 4 * d * heads * n * n / max(full_f - call_s, 1e-9),
        "causal_cost": (causal_f - call_s) / max(full_f - call_s, 1e-9),
        "causal_costs": costs,
        "backward": full_b / full_f,
        "call_s": call_s,
    }


PROBE_ATTENTION = "ds_seqpar_plan_probe"


def _stand_in_attention(
    module: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any
) -> tuple[Any, None]:
    """An attention function for HF models that skips the attention core: q + k + v (K/V heads repeated),
    ``[B, H, S, D]`` in, ``[B, S, H, D]`` out, so the layer's time without its attention can be measured."""
    group = query.shape[1] // key.shape[1]
    mixed = query + (key + value).repeat_interleave(group, dim=1)
    return mixed.transpose(1, 2).contiguous(), None


def _model_probe(config: Any, dims: ModelDims, dt: Any, device: str) -> dict[str, float]:
    """Steps of the model with 1 and 2 layers at 512 and 2048 tokens, its attention core skipped
    (``_stand_in_attention``): a layer's seconds per token and fixed seconds, and the rest of a step's."""
    import copy

    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register(PROBE_ATTENTION, _stand_in_attention)
    times = {}
    for layers in (1, 2):
        cfg = copy.deepcopy(config)
        cfg.num_hidden_layers = layers
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=PROBE_ATTENTION, dtype=dt).to(
            device
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for tokens in (SMALL, LARGE):
            ids = torch.randint(0, dims.vocab, (1, tokens), device=device)

            def step(model=model, opt=opt, ids=ids) -> None:
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            times[layers, tokens] = _best(step, reps=3)
    layer = {n: times[2, n] - times[1, n] for n in (SMALL, LARGE)}
    rest = {n: 2 * times[1, n] - times[2, n] for n in (SMALL, LARGE)}  # a step without its layers
    token_s = max((layer[LARGE] - layer[SMALL]) / (LARGE - SMALL), 1e-12)
    head_token_s = max((rest[LARGE] - rest[SMALL]) / (LARGE - SMALL), 0.0)
    moved = 3 * dims.layer_elementwise_bytes(LARGE, dt.itemsize)
    return {
        "token_s": token_s,
        "call_s": max(layer[SMALL] - SMALL * token_s, 0.0),
        "head_token_s": head_token_s,
        "step_s": max(rest[SMALL] - SMALL * head_token_s, 0.0),
        "memory_bw": moved / max(layer[LARGE], 1e-9),
    }


def _layer_probe(dims: ModelDims, dt: Any, device: str) -> dict[str, float]:
    """The stand-in layer (``plan/probe.py``) at 512 and 2048 tokens, and the LM head with its loss."""
    from ds_seqpar.plan.probe import decoder_layer_step, head_step

    t_small = _best(decoder_layer_step(dims, SMALL, dt, device), reps=3)
    t_large = _best(decoder_layer_step(dims, LARGE, dt, device), reps=3)
    token_s = max((t_large - t_small) / (LARGE - SMALL), 1e-12)
    head_s = _best(head_step(dims, LARGE, dt, device), reps=3) / LARGE
    moved = 3 * dims.layer_elementwise_bytes(LARGE, dt.itemsize)
    return {"token_s": token_s, "call_s": max(t_small - SMALL * token_s, 0.0), "head_token_s": head_s,
            "step_s": 0.0, "memory_bw": moved / t_large}  # fmt: skip


def _matmul_probe(dims: ModelDims, dt: Any, device: str) -> float:
    import torch

    a = torch.randn(2048, dims.hidden, dtype=dt, device=device)
    b = torch.randn(dims.hidden, dims.intermediate, dtype=dt, device=device)
    return 2 * 2048 * dims.hidden * dims.intermediate / _best(lambda: a @ b)


def _memory_bytes() -> float:
    """Physical memory of this machine (bytes; 64 GiB when unknown)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (OSError, ValueError, AttributeError):
        return 64.0 * GIB


def latencies(ranks: int, timeout_s: float = 120.0) -> dict[str, float]:
    """One ring round and one small all-reduce among ``ranks`` gloo processes on this machine (seconds):
    ``python -m ds_seqpar.plan.latency`` started ``ranks`` times (rank 0 prints the figures)."""
    return _spawn("ds_seqpar.plan.latency", ranks, [], timeout_s, "the latency probe")


def sp_costs(ranks: int, model_config: Any, dims: ModelDims, dtype: str, timeout_s: float = 300.0) -> dict:
    """The SP path's fixed seconds per step and the ring engine's timings among ``ranks`` gloo processes
    (``python -m ds_seqpar.plan.sp_probe``; its doc says what is timed): ``{"sp_step_s": {kind: s},
    "ring_probe": {...}}``. The fixed step is measured only for a model small enough to build."""
    import json
    import tempfile

    data = model_config.to_dict() if hasattr(model_config, "to_dict") else dict(model_config)
    fixed = _probe_params(dims) <= MAX_PROBE_PARAMS and "model_type" in data
    if "model_type" not in data:  # a config without its type: the ring probe reads the widths only
        data = {"model_type": "llama", "hidden_size": dims.hidden, "num_attention_heads": dims.heads,
                "num_key_value_heads": dims.kv_heads, "head_dim": dims.head_dim,
                "intermediate_size": dims.intermediate, "num_hidden_layers": 1, "vocab_size": dims.vocab}  # fmt: skip
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(data, f, default=str)
    try:
        return _spawn("ds_seqpar.plan.sp_probe", ranks, [f.name, dtype, "1" if fixed else "0"], timeout_s,
                      "the SP-path probe")  # fmt: skip
    finally:
        os.unlink(f.name)


def _spawn(module: str, ranks: int, args: list[str], timeout_s: float, what: str) -> dict:
    """``python -m module RANK RANKS PORT *args`` started ``ranks`` times, one thread each; rank 0's last
    line of output, parsed as JSON."""
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, str(rank), str(ranks), str(port), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for rank in range(ranks)
    ]
    try:
        outs = [proc.communicate(timeout=timeout_s)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"--cluster local: {what} of {ranks} gloo processes failed")
    return json.loads(outs[0].strip().splitlines()[-1])
