"""Activation checkpointing of decoder layers, with the kept inputs optionally offloaded (docs/memory.md).

``LayerCheckpoint(store)`` is a checkpoint function with the signature transformers gives its layers
(``fn(function, *args)``, keyword arguments bound into ``function`` by a ``functools.partial``): the
forward runs without saving activations and keeps only the layer's positional tensor inputs (the
hidden states) in a :class:`~ds_seqpar.memory.offload.HostStore`; the backward takes them back,
re-runs the layer with gradients (every collective of the layer, e.g. the Ulysses all-to-alls and
ring transfers, runs again in the same order on every rank) and back-propagates through it.

What the re-run sees equals the first run: the RNG state (CPU and CUDA), the autocast state and the
``contextvars`` context (the per-forward ``SeqParContext``) are captured in forward and restored. Keyword
tensors (e.g. the RoPE cos/sin shared by every layer) are kept by reference, not copied; any tensor
input that requires a gradient gets it. A kept tensor modified in place between forward and backward
raises instead of giving a wrong gradient.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ds_seqpar.memory.offload import Handle, HostStore

_AUTOCAST_DEVICES = ("cpu", "cuda")
_TENSOR = object()  # marks where the Function's tensor outputs go back into the output structure


def _unbind(function: Callable[..., Any]) -> tuple[Callable[..., Any], tuple, dict[str, Any]]:
    """``function`` as (callable, bound positional args, bound keyword args) when it is a partial."""
    if isinstance(function, functools.partial):
        return function.func, tuple(function.args), dict(function.keywords)
    return function, (), {}


class _State:
    """What the re-run needs besides the inputs: RNG, autocast, contextvars."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.cpu_rng = torch.get_rng_state()
        self.cuda_devices = sorted(
            {t.device.index for t in tensors if t.is_cuda and t.device.index is not None}
        )
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]
        self.autocast = [
            (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
        ]
        self.context = contextvars.copy_context()

    def rerun(self, run: Callable[[], Any]) -> Any:
        with torch.random.fork_rng(devices=self.cuda_devices):
            torch.set_rng_state(self.cpu_rng)
            for device, state in zip(self.cuda_devices, self.cuda_rng):
                torch.cuda.set_rng_state(state, device)
            with torch.enable_grad():
                casts = [torch.autocast(d, dtype=dt, enabled=on) for d, on, dt in self.autocast]
                for cast in casts:
                    cast.__enter__()
                try:
                    return self.context.run(run)
                finally:
                    for cast in reversed(casts):
                        cast.__exit__(None, None, None)


class _CheckpointedCall(torch.autograd.Function):
    """Inputs: (box, store, spec, offloaded, anchor, *leaves of (function, args, kwargs)).

    ``box`` (a dict) receives the output's structure and its non-tensor leaves (the Function returns
    only the tensors).

    ``offloaded`` marks the leaves kept in the store (the positional tensors); the others are kept
    by reference. ``anchor`` is an empty tensor that requires grad, so the output requires grad even
    when no input does (frozen embeddings): the layer's parameters still get their gradients.
    """

    @staticmethod
    def forward(ctx: Any, box: dict, store: HostStore, spec: Any, offloaded: tuple[bool, ...], anchor: Any,
                *leaves: Any) -> tuple[torch.Tensor, ...]:  # fmt: skip
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        ctx.state = _State(tensors)
        with torch.no_grad():
            func, args, kwargs = tree_unflatten(list(leaves), spec)
            out = func(*args, **kwargs)
        out_leaves, out_spec = tree_flatten(out)
        kept = [x for x, off in zip(leaves, offloaded) if off]
        ctx.handle = store.put(kept)
        ctx.store, ctx.spec, ctx.offloaded = store, spec, offloaded
        ctx.by_ref = [
            (i, x, x._version) if isinstance(x, torch.Tensor) else (i, x, None)
            for i, (x, off) in enumerate(zip(leaves, offloaded))
            if not off
        ]
        ctx.needs = [isinstance(x, torch.Tensor) and x.requires_grad for x in leaves]
        box["spec"] = out_spec
        box["leaves"] = [_TENSOR if isinstance(x, torch.Tensor) else x for x in out_leaves]
        tensors_out = tuple(x for x in out_leaves if isinstance(x, torch.Tensor))
        ctx.mark_non_differentiable(*[t for t in tensors_out if not t.is_floating_point()])
        return tensors_out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        store: HostStore = ctx.store
        handle: Handle = ctx.handle
        kept = iter(store.take(handle))
        leaves: list[Any] = [None] * len(ctx.offloaded)
        for i, off in enumerate(ctx.offloaded):
            if off:
                leaves[i] = next(kept)
        for i, x, version in ctx.by_ref:
            if version is not None and x._version != version:
                raise RuntimeError(
                    f"a tensor input {tuple(x.shape)} of a checkpointed layer was modified in place between its "
                    "forward and backward; the recomputed layer would differ. Do not modify layer inputs in place"
                )
            leaves[i] = x
        inputs = [
            x.detach().requires_grad_(need) if isinstance(x, torch.Tensor) else x
            for x, need in zip(leaves, ctx.needs)
        ]

        saved: set[int] = set()  # storages the re-run's graph saved for its backward

        def keep(t: torch.Tensor) -> torch.Tensor:
            saved.add(t.untyped_storage().data_ptr())
            return t

        def run() -> Any:
            func, args, kwargs = tree_unflatten(inputs, ctx.spec)
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                return func(*args, **kwargs)

        out = ctx.state.rerun(run)
        out_leaves, _ = tree_flatten(out)
        del out
        outs, grads_in = [], []
        for t, g in zip((x for x in out_leaves if isinstance(x, torch.Tensor)), grads):
            if g is not None and t.requires_grad:
                outs.append(t)
                grads_in.append(g)
        del out_leaves
        _free_unsaved_outputs(outs, saved, inputs)
        if outs:
            torch.autograd.backward(outs, grads_in)
        store.release(handle)
        ctx.handle = ctx.state = None
        leaf_grads = [
            x.grad if isinstance(x, torch.Tensor) and need else None for x, need in zip(inputs, ctx.needs)
        ]
        return (None, None, None, None, None, *leaf_grads)


def _free_unsaved_outputs(outs: list[torch.Tensor], saved: set[int], inputs: list[Any]) -> None:
    """Free the data of re-run outputs that their backward never reads, before back-propagating.

    ``torch.autograd.backward`` needs only an output's graph node and shape, but the list handed to
    it keeps the whole tensor alive during the layer's backward: one hidden state at the peak. An
    output qualifies when it is the result of an addition (the residual sum that ends a decoder
    layer; its backward saves nothing), is not a view, and shares its storage with no saved tensor,
    input or other output. Its storage is then resized to 0; the graph is unchanged.
    """
    ptrs = [t.untyped_storage().data_ptr() for t in outs]
    taken = saved | {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)}
    for t, ptr in zip(outs, ptrs):
        node = t.grad_fn
        if (
            node is not None
            and type(node).__name__ == "AddBackward0"
            and t._base is None
            and ptr not in taken
            and ptrs.count(ptr) == 1
        ):
            t.untyped_storage().resize_(0)


class LayerCheckpoint:
    """A checkpoint function for decoder layers: ``checkpoint(function, *args)`` as transformers calls it.

    Args:
        store: where the kept inputs live (``HostStore(offload=True)`` moves them to host memory).

    Without gradients (evaluation) the layer just runs.
    """

    def __init__(self, store: HostStore) -> None:
        self.store = store

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return function(*args, **kwargs)
        func, bound_args, bound_kwargs = _unbind(function)
        all_args = (*bound_args, *args)
        all_kwargs = {**bound_kwargs, **kwargs}
        leaves, spec = tree_flatten((func, all_args, all_kwargs))
        # the positional tensors (the hidden states) are what the store keeps; keywords are shared
        positional = {id(x) for x in tree_flatten(args)[0] if isinstance(x, torch.Tensor)}
        offloaded = tuple(isinstance(x, torch.Tensor) and id(x) in positional for x in leaves)
        anchor = torch.empty(0, requires_grad=True)
        box: dict[str, Any] = {}
        tensors_out = iter(_CheckpointedCall.apply(box, self.store, spec, offloaded, anchor, *leaves))
        out_leaves = [next(tensors_out) if x is _TENSOR else x for x in box["leaves"]]
        return tree_unflatten(out_leaves, box["spec"])
