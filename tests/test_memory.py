"""Memory savings (``sequence_parallel.memory``): tiled MLP, layer checkpointing with offload, tile agreement.

Exactness of the savings under SP and ZeRO-3 (5 steps against the non-SP model) is in
``tests/test_hf_integration.py`` (``MEMORY_AB_CASES``); the memory model in ``tests/test_memory_model.py``.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist

from ds_seqpar.config import SeqParConfigError, load_config
from ds_seqpar.memory import HostStore, LayerCheckpoint, TilePlan
from ds_seqpar.memory.tiled_mlp import find_mlps, tile_bounds, tile_mlps
from tests.helpers.hf_models import tiny_model


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-300)).item()


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize(("tokens", "tile"), [(37, 8), (37, 37), (5, 1), (16, 5)])
def test_tiled_mlp_equals_untiled_fp64(kind, tokens, tile):
    """Output, input gradient and every parameter gradient within 1e-10 (fp64), uneven and 1-token tiles."""
    model = tiny_model(kind)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # the grouped-GEMM experts have no fp64 kernel
    model = model.double()
    mlp = model.model.layers[0].mlp
    tiled = copy.deepcopy(mlp)
    plan = TilePlan(tile)
    (name,) = tile_mlps([_holder(tiled)], plan)
    assert name == "layers.0.mlp"
    x = torch.randn(1, tokens, 64, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    dout = torch.randn(1, tokens, 64, dtype=torch.float64)
    out, ref = tiled(x), mlp(x_ref)
    if isinstance(ref, tuple):  # gpt-oss returns (hidden, router scores [B·n, experts]): every part joined
        assert isinstance(out, tuple) and len(out) == len(ref)
        for o, r in zip(out[1:], ref[1:]):
            assert o.shape == r.shape and _rel(o, r) <= 1e-10
        out, ref = out[0], ref[0]
    assert _rel(out, ref) <= 1e-10
    out.backward(dout)
    ref.backward(dout)
    assert _rel(x.grad, x_ref.grad) <= 1e-10
    got, want = _grads(tiled), _grads(mlp)
    assert set(got) == set(want) and want
    for n in want:
        assert _rel(got[n], want[n]) <= 1e-10, n


def _holder(mlp: torch.nn.Module) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.mlp = mlp
    return layer


def test_tiled_mlp_keeps_one_tile_of_intermediates():
    """Forward saves only the input: no [n, I] activation survives until backward."""
    mlp = tiny_model("llama").model.layers[0].mlp
    plan = TilePlan(8)
    tile_mlps([_holder(mlp)], plan)
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    x = torch.randn(1, 64, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = mlp(x)
    assert saved == [(1, 64, 64)], saved  # the input only
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_tile_bounds_cover_the_tokens_with_empty_tiles_when_needed():
    assert tile_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert tile_bounds(2, 4) == [(0, 0), (0, 1), (1, 1), (1, 2)]


def test_tiled_norms_equal_untiled_fp64():
    """Every norm of the layers and the final norm, tiled: the model's loss and gradients within 1e-10."""
    from ds_seqpar.memory.tiled_mlp import find_norms, tile_modules

    model = tiny_model("llama").double()
    tiled = copy.deepcopy(model)
    names = tile_modules(find_norms(list(tiled.model.layers), tiled.model), TilePlan(7))
    assert names == [
        "layers.0.input_layernorm", "layers.0.post_attention_layernorm", "layers.1.input_layernorm",
        "layers.1.post_attention_layernorm", "norm",
    ]  # fmt: skip
    ids = torch.randint(4, 96, (1, 30), generator=torch.Generator().manual_seed(0))
    loss, ref = tiled(input_ids=ids, labels=ids).loss, model(input_ids=ids, labels=ids).loss
    assert abs(loss.item() - ref.item()) <= 1e-10 * abs(ref.item())
    loss.backward()
    ref.backward()
    want = _grads(model)
    for n, g in _grads(tiled).items():
        assert _rel(g, want[n]) <= 1e-10, n


def test_layer_without_mlp_is_refused_by_name():
    layer = torch.nn.Module()
    layer.attn = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"decoder layer 0 \(Module\) has no MLP child.*tiled_mlp=false"):
        find_mlps([layer])


def test_mlp_with_extra_arguments_is_refused():
    mlp = tiny_model("llama").model.layers[0].mlp
    tile_mlps([_holder(mlp)], TilePlan(4))
    with pytest.raises(ValueError, match="expected forward\\(hidden_states"):
        mlp(torch.randn(1, 8, 64), torch.ones(1))


class _Noisy(torch.nn.Module):
    """A layer with dropout: the re-run must draw the same mask."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.drop(self.lin(x)) * scale, None


@pytest.mark.parametrize("offload", [False, True])
def test_checkpoint_reruns_with_the_same_rng_and_returns_every_gradient(offload):
    torch.manual_seed(0)
    layer = _Noisy()
    ref = copy.deepcopy(layer)
    x = torch.randn(2, 5, 8, requires_grad=True)
    scale = torch.tensor(1.5, requires_grad=True)  # a keyword tensor that needs its gradient
    x_ref, scale_ref = x.detach().clone().requires_grad_(), scale.detach().clone().requires_grad_()
    store = HostStore(offload=offload)
    check = LayerCheckpoint(store)
    torch.manual_seed(1)
    h = x
    for _ in range(3):  # three "layers" through one store (the last stays on the device)
        h, none = check(functools.partial(layer.forward, scale=scale), h)
        assert none is None
    torch.manual_seed(1)
    h_ref = x_ref
    for _ in range(3):
        h_ref, _ = ref(h_ref, scale_ref)
    assert torch.equal(h, h_ref)
    if offload:
        assert store.host_bytes == 2 * x.numel() * 4  # two of three inputs left the "device"
    h.sum().backward()
    h_ref.sum().backward()
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(scale.grad, scale_ref.grad)
    for n, g in _grads(ref).items():
        assert torch.equal(_grads(layer)[n], g), n
    assert store.host_bytes == 0


def test_checkpoint_refuses_an_input_modified_in_place():
    lin = torch.nn.Linear(4, 4)
    bias = torch.zeros(4)
    check = LayerCheckpoint(HostStore(offload=False))
    out = check(functools.partial(lambda x, b: lin(x) + b, b=bias), torch.randn(3, 4, requires_grad=True))
    bias.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()


def test_checkpointed_model_reruns_each_layer_in_backward_and_is_bitwise_equal(dist_pool):
    for rep in dist_pool(1).run(_checkpointed_model_case):
        assert rep["loss_equal"] and rep["grads_equal"], rep
        assert rep["calls_plain"] == 2 and rep["calls_checkpointed"] == 4, rep  # 2 layers, re-run in backward
        assert rep["offloaded_peak"] == 1 * 64 * 64 * 8, rep  # layer 0's input left; layer 1's stayed


def _checkpointed_model_case() -> dict:
    from ds_seqpar import SeqParCausalLM, SeqParMesh, shard_batch

    base = tiny_model("llama").double()
    ids = torch.randint(4, 96, (1, 64), generator=torch.Generator().manual_seed(3))
    results = {}
    for key, memory in [("plain", {}), ("checkpointed", {"activation_checkpointing": True, "offload": True})]:
        model = copy.deepcopy(base)
        mesh = SeqParMesh.from_config({"size": 1, "ulysses_degree": 1, "memory": memory})
        sp = SeqParCausalLM(model, mesh).train()
        calls: list[int] = []
        for layer in model.model.layers:
            layer.self_attn.register_forward_pre_hook(functools.partial(_count, calls))
        loss = sp(**shard_batch({"input_ids": ids}, mesh))
        loss.backward()
        results[key] = (loss.detach(), _grads(model), len(calls), sp.memory)
    (l0, g0, c0, _), (l1, g1, c1, mem) = results["plain"], results["checkpointed"]
    assert mem.checkpointed == "transformers"
    return {
        "loss_equal": bool(torch.equal(l0, l1)),
        "grads_equal": set(g0) == set(g1) and all(torch.equal(g0[n], g1[n]) for n in g0),
        "calls_plain": c0,
        "calls_checkpointed": c1,
        "offloaded_peak": mem.store.peak_host_bytes,
    }


def _count(calls: list[int], *_: object) -> None:
    calls.append(1)


def test_tile_count_is_agreed_across_ranks(dist_pool):
    """A rank with fewer tokens runs as many tiles as the rank with the most (ZeRO-3 gathers per tile)."""
    assert dist_pool(2).run(_tile_agreement) == [5, 5]


def _tile_agreement() -> int:
    plan = TilePlan(4, group=dist.group.WORLD)
    tokens = 17 if dist.get_rank() == 0 else 3  # 5 tiles vs 1
    return plan.plan(tokens, torch.device("cpu"), agree=True)


def test_memory_section_is_validated_by_name():
    with pytest.raises(SeqParConfigError, match=r"memory\.offload=true.*activation_checkpointing is false"):
        load_config({"sequence_parallel": {"size": 1, "memory": {"offload": True}}})
    with pytest.raises(
        SeqParConfigError,
        match=r"mlp_tile_tokens=64 is set but memory\.tiled_mlp and memory\.tiled_norms are false",
    ):
        load_config({"sequence_parallel": {"size": 1, "memory": {"mlp_tile_tokens": 64}}})
    with pytest.raises(SeqParConfigError, match=r"memory\.checkpoint"):
        load_config({"sequence_parallel": {"size": 1, "memory": {"checkpoint": True}}})
    section, _ = load_config(
        {"sequence_parallel": {"size": 1, "memory": {"activation_checkpointing": True, "offload": True}}}
    )
    assert section.memory.offload and not section.memory.tiled_mlp


def test_pipelined_ulysses_frees_each_head_group(dist_pool):
    """U = 2, 8 heads: without gradients (a checkpointed layer's first run, evaluation) the live peak of
    the attention falls with the head groups; with gradients the backward's peak does too."""
    peaks = dist_pool(2).run(_pipelined_peaks)
    for rank in peaks:
        assert rank["no_grad"][4] < 0.8 * rank["no_grad"][1], rank  # exchange buffers: 3/c of one exchange
        assert rank["backward"][4] < rank["backward"][1], rank


def _pipelined_peaks() -> dict:
    import ds_seqpar
    from ds_seqpar import SeqParMesh
    from ds_seqpar.memory.trace import LiveBytes

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2048, 8, 16, generator=g) for _ in range(3))
    out: dict[str, dict[int, int]] = {"no_grad": {}, "backward": {}}
    for chunks in (1, 4):
        mesh = SeqParMesh.from_config({"size": 2, "ulysses_degree": 2, "ulysses_chunks": chunks})
        with torch.no_grad(), LiveBytes() as mode:
            ds_seqpar.attention(q, k, v, mesh=mesh)
        out["no_grad"][chunks] = mode.peak
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        result = ds_seqpar.attention(*leaves, mesh=mesh)
        with LiveBytes() as mode:
            result.backward(torch.ones_like(result))
        out["backward"][chunks] = mode.peak
    return out


def test_rerun_output_data_is_freed_only_when_nothing_reads_it():
    """A re-run layer's residual-sum output is freed before its backward; outputs that the graph
    saved, or that are not sums, keep their data; the gradients are unchanged."""
    from ds_seqpar.memory.checkpoint import _free_unsaved_outputs

    x = torch.randn(4, 8, requires_grad=True)
    summed = x * 2 + 1  # AddBackward0, nothing saves it
    _free_unsaved_outputs([summed], set(), [x])
    assert summed.untyped_storage().nbytes() == 0
    summed.backward(torch.ones(4, 8))
    assert torch.equal(x.grad, torch.full((4, 8), 2.0))
    saved = x + 1
    _free_unsaved_outputs([saved], {saved.untyped_storage().data_ptr()}, [x])
    exp = x.exp()  # ExpBackward saves its result
    _free_unsaved_outputs([exp], set(), [x])
    assert saved.untyped_storage().nbytes() > 0 and exp.untyped_storage().nbytes() > 0


def test_checkpointed_layer_backward_holds_no_copy_of_its_output():
    """The live peak of a checkpointed layer's backward: the re-run output's data is gone."""
    from ds_seqpar.memory.trace import LiveBytes

    lin = torch.nn.Linear(256, 256)
    x = torch.randn(2048, 256, requires_grad=True)
    out = LayerCheckpoint(HostStore(offload=False))(lambda h: h + lin(h), x)
    g = torch.ones_like(out)
    with LiveBytes() as mode:
        out.backward(g)
    hidden = x.numel() * 4
    # re-run: lin(h) and the sum (freed); backward: x.grad and lin's input gradient
    assert mode.peak < 3.5 * hidden, mode.table()


def test_live_bytes_follows_storages_resized_in_place():
    from ds_seqpar.memory.trace import LiveBytes

    with LiveBytes() as mode:
        a = torch.empty(1 << 20)
        a.untyped_storage().resize_(0)
        b = torch.empty(1 << 20)
    assert mode.peak == b.numel() * 4, mode.table()


def test_ring_receive_buffers_live_only_during_a_call(dist_pool):
    """R = 2: after forward and backward no receive buffer stays pooled in the schedule (every byte
    of the ring is inside the step, where memory is measured), the ring call keeps no output for its
    backward (it runs on rowsum(dout * out) from the token-layout output), and dK/dV are exact."""
    for rep in dist_pool(2).run(_ring_buffers_case):
        assert rep["pooled_after"] == 0, rep
        assert rep["ring_saved"] == [True, True, True, False, True, False], rep
        assert rep["max_err"] <= 1e-12, rep


def _graph_node(root, name: str):
    """The first autograd node named ``name`` reachable from ``root``."""
    seen, todo = set(), [root]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if name in node.name():
            return node
        todo += [n for n, _ in node.next_functions]
    raise AssertionError(f"no {name} node in the graph")


def _ring_buffers_case() -> dict:
    import ds_seqpar
    from ds_seqpar import SeqParMesh, input_layout
    from ds_seqpar.comm.schedules.ring import RingSchedule
    from ds_seqpar.ops.attention.reference import dense_attention_reference

    g = torch.Generator().manual_seed(0)
    s = 64
    q, k, v = (torch.randn(1, s, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mesh = SeqParMesh.from_config({"size": 2, "ulysses_degree": 1, "ring": {"layout": "zigzag"}})
    idx = input_layout(mesh).local_positions(s, mesh.coords.sp_rank)
    leaves = [t[:, idx].clone().requires_grad_() for t in (q, k, v)]
    out = ds_seqpar.attention(*leaves, mesh=mesh)
    # saved: q, k, v, the output (none: the backward runs on rowsum(dout * out)), lse, sinks (none)
    ring_saved = [t is not None for t in _graph_node(out.grad_fn, "_RingAttention").saved_tensors]
    dout = torch.randn(q.shape, generator=g, dtype=q.dtype)
    out.backward(dout[:, idx])
    pooled = sum(
        sum(t.numel() for s_ in sets if s_ is not None for t in s_)
        for r in mesh.resources.values()
        if isinstance(r, RingSchedule)
        for ring in r._rings()
        for sets in ring._buffers.values()
    )
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    ref_out, _ = dense_attention_reference(*ref, mask)
    ref_out.backward(dout)
    err = max((a.grad - b.grad[:, idx]).abs().max().item() for a, b in zip(leaves, ref, strict=True))
    return {"pooled_after": pooled, "ring_saved": ring_saved, "max_err": err}
