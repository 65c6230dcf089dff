"""Tiled MLP (and norms): position-wise blocks run over sequence tiles, recomputed tile by tile in backward.

Legend: B = batch, n = local tokens, E = hidden size, I = intermediate size, T = tiles.

An MLP (or MoE block) of a decoder layer maps every token on its own, so it can run on tiles of
the sequence. ``forward`` runs the tiles without saving activations and keeps only the input
``[B, n, E]``; ``backward`` re-runs one tile at a time with gradients and back-propagates it, so one
tile's ``[B, n/T, I]`` intermediates exist at a time instead of ``[B, n, I]`` (docs/memory.md). The
norms of the layers (``tiled_norms``) run the same way: they keep their input only, not the
normalised intermediates, and their backward temporaries are one tile's.

DeepSpeed: every tile's forward gathers the module's ZeRO-3 parameters, so every rank of the ZeRO
group must run the same number of tiles: :class:`TilePlan` agrees on T (a max over the group, once per
forward; empty tiles are run by the ranks with fewer tokens). The parameters' gradients accumulate
over the tiles and are handed to DeepSpeed's reduction once, after the last tile
(``ds_grad_is_ready``, which ZeRO-1/2/3 of DeepSpeed 0.19.8 read).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn", "moe")


class TilePlan:
    """How many tiles every tiled MLP of one forward runs (shared by the layers of a model).

    Args:
        tile_tokens: tokens per tile (``"auto"`` resolved by the caller).
        group: the process group whose ranks must agree (the ZeRO partition group), or None.
    """

    def __init__(self, tile_tokens: int, group: Any = None) -> None:
        self.tile_tokens = tile_tokens
        self.group = group
        self.tiles = 0  # 0: not planned, each call derives its own count

    def plan(self, tokens: int, device: torch.device, agree: bool) -> int:
        """Set the tile count for ``tokens`` local tokens; ``agree``: take the max over the group."""
        tiles = max(1, math.ceil(tokens / self.tile_tokens))
        if agree and self.group is not None and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            count = torch.tensor([tiles], dtype=torch.int64, device=device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
            tiles = int(count.item())
        self.tiles = tiles
        return tiles

    def tiles_for(self, tokens: int) -> int:
        return self.tiles or max(1, math.ceil(tokens / self.tile_tokens))


def tile_bounds(tokens: int, tiles: int) -> list[tuple[int, int]]:
    """``tiles`` consecutive ``[start, end)`` ranges covering ``tokens`` (empty ones when tiles > tokens)."""
    return [(tokens * i // tiles, tokens * (i + 1) // tiles) for i in range(tiles)]


def _token_dim(t: torch.Tensor, batch: int, tokens: int, name: str) -> int:
    """The dim of ``t`` that runs over the tile's tokens: 1 for ``[B, t, ...]``, 0 for ``[B·t, ...]`` (B = 1)."""
    if t.dim() >= 2 and t.shape[0] == batch and t.shape[1] == tokens:
        return 1
    if batch == 1 and t.dim() >= 1 and t.shape[0] == tokens:
        return 0
    raise ValueError(
        f"tiled MLP {name}: an output of shape {tuple(t.shape)} is not per token (expected [B, {tokens}, ...] or "
        f"[B·{tokens}, ...] with B = 1); set sequence_parallel.memory.tiled_mlp=false for this model"
    )


class _TiledCall(torch.autograd.Function):
    """Inputs: (run, params, bounds, box, name, x); returns the tensors of the joined output (``box``
    receives its structure)."""

    @staticmethod
    def forward(ctx: Any, run: Callable[[torch.Tensor], Any], params: list[torch.nn.Parameter],
                bounds: list[tuple[int, int]], box: dict, name: str, x: torch.Tensor) -> Any:  # fmt: skip
        batch = x.shape[0]
        with torch.no_grad():
            outs = [tree_flatten(run(x[:, a:b])) for a, b in bounds]
        widest = max(range(len(bounds)), key=lambda i: bounds[i][1] - bounds[i][0])
        leaves, spec = outs[widest]
        tokens = bounds[widest][1] - bounds[widest][0]
        dims = [_token_dim(t, batch, tokens, name) if isinstance(t, torch.Tensor) else None for t in leaves]
        joined = [
            torch.cat([o[0][i] for o in outs], dim=d) if d is not None else leaf
            for i, (leaf, d) in enumerate(zip(leaves, dims))
        ]
        ctx.save_for_backward(x)
        ctx.run, ctx.params, ctx.bounds = run, params, bounds
        ctx.dims = [d for d in dims if d is not None]
        box["spec"], box["leaves"] = spec, [None if d is not None else leaf for leaf, d in zip(joined, dims)]
        box["is_tensor"] = [d is not None for d in dims]
        return tuple(t for t, d in zip(joined, dims) if d is not None)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        needs = x.requires_grad
        dx = torch.zeros_like(x) if needs else None
        last = len(ctx.bounds) - 1
        try:
            for i, (a, b) in enumerate(ctx.bounds):
                for p in ctx.params:  # DeepSpeed reduces a gradient once, after the last tile
                    p.ds_grad_is_ready = i == last
                tile = x[:, a:b].detach().requires_grad_(needs)
                with torch.enable_grad():
                    outs = [t for t in tree_flatten(ctx.run(tile))[0] if isinstance(t, torch.Tensor)]
                pairs = [
                    (o, g.narrow(d, a, b - a))
                    for o, g, d in zip(outs, grads, ctx.dims)
                    if g is not None and o.requires_grad
                ]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                if needs and tile.grad is not None:
                    dx[:, a:b] = tile.grad
        finally:
            for p in ctx.params:
                p.ds_grad_is_ready = True
        return None, None, None, None, None, dx


def tiled_forward(module: torch.nn.Module, plan: TilePlan, name: str) -> Callable[..., Any]:
    """A ``forward`` for ``module`` that runs its original forward over ``plan``'s tiles of ``x [B, n, E]``."""
    original = module.forward
    params = [p for p in module.parameters() if p.requires_grad]

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not isinstance(x, torch.Tensor) or x.dim() != 3:
            got = [type(a).__name__ for a in args] + sorted(kwargs)
            raise ValueError(
                f"tiled MLP {name}: expected forward(hidden_states [B, n, E]) but got extra arguments {got} or input "
                f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}; set "
                "sequence_parallel.memory.tiled_mlp=false for this model"
            )
        tiles = plan.tiles_for(x.shape[1])
        if tiles == 1:
            return original(x)
        box: dict[str, Any] = {}
        tensors = iter(_TiledCall.apply(original, params, tile_bounds(x.shape[1], tiles), box, name, x))
        leaves = [next(tensors) if is_t else leaf for is_t, leaf in zip(box["is_tensor"], box["leaves"])]
        return tree_unflatten(leaves, box["spec"])

    forward.__ds_seqpar_tiled__ = original  # type: ignore[attr-defined]
    return forward


def find_mlps(layers: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Module]]:
    """The position-wise MLP child of every decoder layer (``mlp``, ``feed_forward``, ``block_sparse_moe``,
    ``ffn`` or ``moe``), as ``("layers.{i}.{name}", module)``; raises naming a layer without one."""
    found = []
    for i, layer in enumerate(layers):
        children = dict(layer.named_children())
        name = next((n for n in MLP_NAMES if n in children), None)
        if name is None:
            raise ValueError(
                f"sequence_parallel.memory.tiled_mlp=true but decoder layer {i} ({type(layer).__name__}) has no MLP "
                f"child named one of {MLP_NAMES} (children: {sorted(children)}); set memory.tiled_mlp=false"
            )
        found.append((f"layers.{i}.{name}", children[name]))
    return found


def tile_mlps(layers: list[torch.nn.Module], plan: TilePlan) -> list[str]:
    """Replace the forward of each decoder layer's MLP with its tiled version; returns their names."""
    return tile_modules(find_mlps(layers), plan)


def is_norm(module: torch.nn.Module) -> bool:
    """A per-token normalisation: ``nn.LayerNorm`` / ``nn.RMSNorm`` or a class named ``*Norm`` (e.g.
    ``LlamaRMSNorm``); BatchNorm / GroupNorm-style names do not end in ``Norm`` and are never matched."""
    return isinstance(module, torch.nn.LayerNorm | torch.nn.RMSNorm) or type(module).__name__.endswith("Norm")


def find_norms(layers: list[torch.nn.Module], decoder: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The norm children of every decoder layer and of the decoder itself (its final norm)."""
    found = [
        (f"layers.{i}.{name}", child)
        for i, layer in enumerate(layers)
        for name, child in layer.named_children()
        if is_norm(child)
    ]
    found += [(name, child) for name, child in decoder.named_children() if is_norm(child)]
    return found


def tile_modules(modules: list[tuple[str, torch.nn.Module]], plan: TilePlan) -> list[str]:
    """Replace the forward of each module with its tiled version; returns their names."""
    for name, module in modules:
        if not hasattr(module.forward, "__ds_seqpar_tiled__"):
            module.forward = tiled_forward(module, plan, name)
    return [name for name, _ in modules]
