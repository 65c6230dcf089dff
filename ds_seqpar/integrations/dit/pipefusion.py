"""PipeFusion: a diffusion transformer's blocks pipelined over ranks by patches, one-step-stale K/V (docs/pipefusion.md).

Legend: P = stages (``team.size``, one per rank, in member order), s = this rank's stage, L = transformer blocks,
B = batch, N = image tokens, C = hidden width, F = the output projection's features (``proj_out``), M = patches.

``PipeFusion(model, team, patches, warmup_steps)`` installs itself in place (``pipe.transformer(...)`` keeps
working; ``remove()`` restores the model). Every rank keeps all weights and runs the modules before and after
the blocks itself; of ``transformer_blocks`` it runs only its stage's contiguous share (balanced by count).
One transformer call = one denoising step. Warm-up steps (the first ``warmup_steps`` calls after construction
or ``reset()``) send the whole sequence through the stages as one patch: exact. Later steps cut the image
tokens into M contiguous patches: stage s takes patch m from stage s-1 (P2P ``[B, n_m, C]``), runs its blocks,
sends it to stage s+1, so stage s works on patch m while stage s+1 works on patch m-1. Each self-attention
layer keeps a K/V buffer ``[B, N, H_kv, D]``: patch m writes its fresh K/V into its slice and its queries
attend over the whole buffer (patches < m fresh from this step, patches > m stale from the previous step; in a
step with no previous one, over the fresh prefix only). The last stage's ``proj_out`` output ``[B, N, F]``
is broadcast to every rank, so the scheduler step is the same everywhere.

Bytes per step (every step, warm-up or not): stage s < P-1 sends B·N·C·itemsize (P2P); the last stage sends
B·N·F·itemsize to each of the P-1 others (broadcast); ``step_bytes`` is the formula, ``CommStats`` (kinds
``p2p``, ``broadcast``) counts them. Inference only (no autograd through the pipeline).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as torch_functional

from ds_seqpar.comm.team import TeamComm
from ds_seqpar.integrations.dit.attention import ATTENTION_RULES, AttentionCall, SeqParAttnProcessor
from ds_seqpar.integrations.dit.plans import TokenPlan, plan_of
from ds_seqpar.integrations.hf_model import UnsupportedModelError

__all__ = ["PipeFusion", "patch_bounds", "stage_blocks", "step_bytes"]

_TAG = 4100  # + patch index: gloo matches P2P by tag


def stage_blocks(blocks: int, stages: int, stage: int) -> range:
    """Stage ``stage``'s contiguous blocks of ``blocks``, balanced by count (the first ones get the extra)."""
    base, extra = divmod(blocks, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def patch_bounds(tokens: int, patches: int) -> list[tuple[int, int]]:
    """(start, length) of each of ``patches`` contiguous patches of ``tokens`` (the first ones get the extra)."""
    base, extra = divmod(tokens, patches)
    out, start = [], 0
    for m in range(patches):
        n = base + (m < extra)
        out.append((start, n))
        start += n
    return out


def step_bytes(
    stages: int, batch: int, tokens: int, hidden: int, out_features: int, itemsize: int
) -> dict[int, int]:
    """Bytes each stage sends in one step: s < P-1: B·N·C·itemsize (P2P to s+1); the last: (P-1)·B·N·F·itemsize
    (the output broadcast). Total = (P-1)·B·N·(C+F)·itemsize."""
    if stages == 1:
        return {0: 0}
    out = dict.fromkeys(range(stages - 1), batch * tokens * hidden * itemsize)
    out[stages - 1] = (stages - 1) * batch * tokens * out_features * itemsize
    return out


@dataclass
class _KV:
    """One self-attention layer's K/V buffer ``[B, N, H_kv, D]``; ``full``: every slice has been written."""

    k: torch.Tensor
    v: torch.Tensor
    full: bool = False


def _check_args(patches: Any, warmup_steps: Any, team: TeamComm) -> None:
    if isinstance(patches, bool) or not isinstance(patches, int) or patches < 1:
        raise ValueError(f"PipeFusion: patches={patches!r} must be an int >= 1 (1 = exact at every step)")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(
            f"PipeFusion: warmup_steps={warmup_steps!r} must be an int >= 0 (the exact steps before the patches)"
        )
    if not 0 <= team.index < team.size:
        raise ValueError(f"PipeFusion: team.index={team.index} is outside its {team.size} members")
    if team.size > 1 and dist.is_initialized() and dist.get_rank() != team.members[team.index]:
        raise ValueError(
            f"PipeFusion: team.members[{team.index}]={team.members[team.index]} is not this rank "
            f"({dist.get_rank()}); pass the team with this rank's index"
        )


def _check_plan(model: torch.nn.Module, plan: TokenPlan) -> str:
    """The module whose output is the whole output (``proj_out``); refuses plans that are not PixArt-style."""
    name = type(model).__name__
    inputs = plan.splits.get("transformer_blocks.0", {})
    streams = {k for entry in plan.splits.values() for k in entry}
    if plan.joint_order is not None or streams - {"hidden_states"}:
        raise UnsupportedModelError(
            f"{name}: PipeFusion does not support joint attention (its plan {plan.source} splits the streams "
            f"{sorted(map(str, streams))}): the second stream's tokens would need their own patches and stale K/V "
            "inside every joint attention; run this model with DitParallel (exact SP) instead"
        )
    split = inputs.get("hidden_states")
    if (
        set(plan.splits) != {"transformer_blocks.0"}
        or split is None
        or split.dim != 1
        or len(plan.gathers) != 1
    ):
        raise UnsupportedModelError(
            f"{name}: PipeFusion needs a plan that splits hidden_states [B, N, C] at the input of "
            f"transformer_blocks.0 and gathers one module's output (PixArt's); {plan.source} has splits "
            f"{sorted(plan.splits)} and gathers {sorted(plan.gathers)}"
        )
    return next(iter(plan.gathers))


class PipeFusion:
    """See the module docstring. ``team``: the pipeline's ranks in stage order (``TeamComm``; its ``stats``, if
    any, counts the bytes). ``patches`` = M; ``warmup_steps`` = W exact steps after construction / ``reset()``."""

    def __init__(self, model: torch.nn.Module, team: TeamComm, patches: int, warmup_steps: int) -> None:
        _check_args(patches, warmup_steps, team)
        self.model, self.team, self.patches, self.warmup_steps = model, team, patches, warmup_steps
        self._out_module = _check_plan(model, plan_of(model))
        blocks = getattr(model, "transformer_blocks", None)
        if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) < team.size:
            count = len(blocks) if isinstance(blocks, torch.nn.ModuleList) else 0
            raise ValueError(
                f"PipeFusion: {team.size} stages but {type(model).__name__} has {count} transformer_blocks; "
                f"use at most {count} ranks in the team (one stage needs at least one block)"
            )
        self.blocks = blocks
        self.mine = stage_blocks(len(blocks), team.size, team.index)
        self.reset()
        self._patch = (0, 0, 0)  # (start, length, tokens N) of the patch running now
        self._forwards: list[Callable[..., Any]] = []
        self._processors: dict[str, Any] = {}
        self._handles: list[Any] = []
        self._install()

    # -- installation -------------------------------------------------------------------------------------
    def _wrap_processors(self) -> dict[str, tuple[Any, Any, Any]]:
        wrapped = {}
        for name, module in self.model.named_modules():
            processor = getattr(module, "processor", None)
            if processor is None or not hasattr(module, "set_processor"):
                continue
            if isinstance(processor, SeqParAttnProcessor):
                raise UnsupportedModelError(
                    f"{type(self.model).__name__}.{name}: the attention is already served by DitParallel; "
                    "PipeFusion with Ulysses / ring SP inside a stage is not supported: remove() the DitParallel "
                    "first and use one of the two"
                )
            site = ATTENTION_RULES.get(type(processor).__name__)
            if site is None and getattr(module, "is_cross_attention", False):
                continue  # cross-attention to the whole prompt stays the model's own
            if site is None or site.joint:
                why = "joint attention" if site is not None else "no ds_seqpar rule"
                raise UnsupportedModelError(
                    f"{type(self.model).__name__}.{name}: PipeFusion cannot serve attention processor "
                    f"{type(processor).__name__} ({why}); it serves self-attention over the image tokens only"
                )
            wrapped[name] = (module, processor, site)
        return wrapped

    def _install(self) -> None:
        wrapped = self._wrap_processors()
        for index, block in enumerate(self.blocks):
            self._forwards.append(block.forward)
            block.forward = self._block_forward(index, block.forward)
        modules = dict(self.model.named_modules())
        self._handles.append(self.model.register_forward_pre_hook(self._new_generation, with_kwargs=True))
        self._handles.append(modules[self._out_module].register_forward_hook(self._share_output))
        for name, (module, processor, site) in wrapped.items():
            self._processors[name] = processor
            module.set_processor(SeqParAttnProcessor(processor, site, self, name))

    def remove(self) -> None:
        """Restore the model: the blocks' forwards, the processors, no hooks; the K/V buffers dropped."""
        for block in self.blocks:
            block.__dict__.pop("forward", None)
        for handle in self._handles:
            handle.remove()
        modules = dict(self.model.named_modules())
        for name, processor in self._processors.items():
            modules[name].set_processor(processor)
        self._forwards, self._handles, self._processors = [], [], {}
        self.reset()

    def reset(self) -> None:
        """Start a new generation: step 0 (warm-up again), the K/V buffers dropped."""
        self.step = 0
        self._timestep: float | None = None
        self._kv: dict[str, _KV] = {}
        self._seen: tuple[int, int, torch.dtype] | None = None  # (B, N, dtype) of the steps that filled _kv

    def _new_generation(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """A call whose timestep is above the previous call's starts a new denoising run (diffusers' loops go
        from high to low timesteps; a repeated timestep, as Heun's second evaluation, is the same run):
        ``reset()``, so a second image never attends to the first image's K/V."""
        timestep = kwargs.get("timestep")
        if not isinstance(timestep, torch.Tensor | float | int):
            return
        now = float(timestep.max()) if isinstance(timestep, torch.Tensor) else float(timestep)
        if self._timestep is not None and now > self._timestep:
            self.reset()
        self._timestep = now

    # -- one step -------------------------------------------------------------------------------------------
    def _block_forward(self, index: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(forward)

        def run(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            if index == 0:
                return self._pipeline(bound)
            return bound.arguments["hidden_states"]  # the whole stack ran in block 0's call

        return run

    def _check_step(self, x: torch.Tensor) -> None:
        """Checks of one call, before any communication (every rank sees the same inputs)."""
        if torch.is_grad_enabled():
            raise RuntimeError(
                "PipeFusion is inference only (stale K/V, no backward through the pipeline): call the transformer "
                "under torch.no_grad() (diffusers pipelines do)"
            )
        if x.dim() != 3:
            raise UnsupportedModelError(
                f"PipeFusion: transformer_blocks.0 got hidden_states of shape {tuple(x.shape)}, not [B, N, C]"
            )
        if self.patches > x.shape[1]:
            raise ValueError(
                f"PipeFusion: patches={self.patches} is more than the {x.shape[1]} image tokens; use at most "
                f"{x.shape[1]} patches"
            )
        seen = (x.shape[0], x.shape[1], x.dtype)
        if self._seen is not None and seen != self._seen:
            raise ValueError(
                f"PipeFusion: step {self.step} has batch, tokens, dtype {seen} but the K/V buffers were filled by "
                f"steps with {self._seen}; call reset() before a new generation"
            )
        self._seen = seen

    def _pipeline(self, bound: inspect.BoundArguments) -> torch.Tensor:
        """This stage's blocks on every patch of the step; the whole stack's output on the last stage."""
        x = bound.arguments["hidden_states"]
        self._check_step(x)
        team, stage = self.team, self.team.index
        last = stage == team.size - 1
        count = 1 if self.step < self.warmup_steps else self.patches
        outs, sends = [], []
        for m, (start, n) in enumerate(patch_bounds(x.shape[1], count)):
            if stage == 0:
                h = x[:, start : start + n]
            else:
                h = x.new_empty((x.shape[0], n, x.shape[2]))
                dist.recv(h, team.members[stage - 1], group=team.group, tag=_TAG + m)
            self._patch = (start, n, x.shape[1])
            for index in self.mine:
                bound.arguments["hidden_states"] = h
                h = self._forwards[index](*bound.args, **bound.kwargs)
                if not isinstance(h, torch.Tensor):
                    raise UnsupportedModelError(
                        f"PipeFusion: transformer_blocks.{index} returned {type(h).__name__}, not one tensor "
                        "[B, n, C] (a joint / two-stream block is not supported)"
                    )
            if last:
                outs.append(h)
            else:
                h = h.contiguous()
                sends.append(dist.isend(h, team.members[stage + 1], group=team.group, tag=_TAG + m))
                self._record("p2p", {team.members[stage + 1]: h.numel() * h.element_size()})
        for work in sends:
            work.wait()
        self.step += 1
        return (
            torch.cat(outs, dim=1) if last else x
        )  # x: a stand-in, the output broadcast replaces what follows

    def _record(self, kind: str, sent: dict[int, int]) -> None:
        if self.team.stats is not None:
            self.team.stats.record_peers(kind, sent)

    def _share_output(self, module: torch.nn.Module, args: tuple, output: Any) -> torch.Tensor:
        """The last stage's output ``[B, N, F]`` broadcast to every stage (one broadcast)."""
        team = self.team
        if team.size == 1:
            return output
        if not isinstance(output, torch.Tensor):
            raise UnsupportedModelError(
                f"PipeFusion: {self._out_module} returned {type(output).__name__}, not one tensor"
            )
        out = output.contiguous()
        dist.broadcast(out, team.members[-1], group=team.group)
        if team.index == team.size - 1:
            nbytes = out.numel() * out.element_size()
            self._record("broadcast", {m: nbytes for m in team.members[:-1]})
        return out

    # -- the attention (SeqParAttnProcessor's runtime) ---------------------------------------------------------
    def token_order(self, name: str, length: int, joint_call: bool) -> tuple[str, ...]:
        start, n, _ = self._patch
        if joint_call or length != n:
            raise UnsupportedModelError(
                f"{name}: {length} tokens reach a self-attention under PipeFusion, but the patch running has {n} "
                f"(from token {start}); only self-attention over the image tokens is pipelined"
            )
        return ("hidden_states",)

    def attend(self, call: AttentionCall) -> torch.Tensor:
        """q ``[B, n, H, D]`` of the patch over the layer's K/V buffer after writing the patch's k/v into it."""
        start, n, tokens = self._patch
        kv = self._kv.get(call.name)
        if kv is None:
            shape = (call.k.shape[0], tokens, *call.k.shape[2:])
            kv = self._kv[call.name] = _KV(call.k.new_empty(shape), call.v.new_empty(shape))
        if (kv.k.dtype, kv.k.shape[2:]) != (call.k.dtype, call.k.shape[2:]):
            raise ValueError(
                f"{call.name}: K/V of dtype {call.k.dtype}, heads x dim {tuple(call.k.shape[2:])}, but the buffer of "
                f"the previous steps holds {kv.k.dtype}, {tuple(kv.k.shape[2:])}; call reset() after changing the model"
            )
        kv.k[:, start : start + n] = call.k
        kv.v[:, start : start + n] = call.v
        end = tokens if kv.full else start + n  # no stale K/V yet: the fresh prefix only
        if start + n == tokens:
            kv.full = True
        q, k, v = (t.transpose(1, 2) for t in (call.q, kv.k[:, :end], kv.v[:, :end]))
        out = torch_functional.scaled_dot_product_attention(
            q, k, v, scale=call.scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        return out.transpose(1, 2)
