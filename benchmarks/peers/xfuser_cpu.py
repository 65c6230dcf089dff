"""Stand-ins that let xfuser 0.7.0 import and set up on a CPU-only machine with gloo (its files untouched).

xfuser decides its platform once, in ``xfuser/envs.py``, and has no CPU branch there. :func:`install`
(before ``import xfuser``) puts an import hook in place that, right after ``xfuser.envs`` has executed,
replaces what has no CPU answer; :func:`after_import` fixes what other modules decided at import time.
Every stand-in is listed in ``STANDINS`` with the xfuser line it answers (recorded in the results).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

STANDINS = [
    "xfuser/envs.py:138 get_device_version() raises NotImplementedError('No Accelerators ...') on CPU "
    "(read at import by xfuser/config/config.py:11 CUDA_VERSION): stand-in returns None, as envs.py does for MPS/NPU",
    "xfuser/envs.py:153 get_torch_distributed_backend() raises on CPU: stand-in returns 'gloo'",
    "xfuser/envs.py:357 check_long_ctx_attn() is False without torch.cuda (yunchang imports fine on CPU): "
    "stand-in sets packages_info['has_long_ctx_attn'] = True",
    "xfuser/model_executor/layers/usp.py:10 takes yunchang's PROCESS_GROUP only if torch.cuda.is_available(), "
    "else None (USP then fails on PROCESS_GROUP.ULYSSES_PG): stand-in binds usp.PROCESS_GROUP to yunchang's",
    "xfuser/core/distributed/group_coordinator.py:12 binds torch.cuda.synchronize, called after every "
    "batch_isend_irecv of PipeFusion's shape exchange (:874, :907; AssertionError 'Torch not compiled with "
    "CUDA enabled'): stand-in is a no-op (gloo's work.wait() already returned; no CUDA stream to drain)",
    "xfuser/core/distributed/group_coordinator.py:866-870 and :899-903 (_communicate_shapes) wait on the isend "
    "of a shape before the peer has posted its irecv. Under NCCL a small send completes eagerly and wait() "
    "only orders the CUDA stream; a gloo send completes when the receiver posts, so PipeFusion's ring "
    "deadlocks (measured: the last stage blocks sending patch 0's shape back to stage 0 while stage 0 blocks "
    "sending patch 1's shape to it). Besides, _pipeline_isend (:976) drops the work of its isend, which "
    "gloo then never delivers (measured: the receiver waits forever at :959). Stand-in, for "
    "group_coordinator only: isend (direct or in batch_isend_irecv) sends a private copy of the tensor, keeps "
    "the work and hands back an already-completed handle (the real sends are waited at the end of the run, "
    "drain()); irecvs are unchanged",
]
FLASH_STANDIN = (
    "xfuser/envs.py:253 check_flash_attn() is False without torch.cuda: with --attention flash the stand-in "
    "sets packages_info['has_flash_attn'] = True, served by benchmarks/peers/flash_attn_shim"
)


class _EnvsHook(importlib.abc.MetaPathFinder):
    """Loads ``xfuser.envs`` as usual, then applies the CPU stand-ins to it (once)."""

    def __init__(self, flash: bool) -> None:
        self.flash = flash

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "xfuser.envs":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module
        flash = self.flash

        def exec_module(module: Any) -> None:
            run(module)
            module.get_device_version = lambda: None
            module.get_torch_distributed_backend = lambda: "gloo"
            info = module.PACKAGES_CHECKER.packages_info
            info["has_long_ctx_attn"] = True
            info["has_flash_attn"] = flash

        spec.loader.exec_module = exec_module
        return spec


def install(flash: bool = False) -> None:
    """Put the ``xfuser.envs`` hook in place; ``flash`` marks the flash-attn CPU shim as flash-attn 2."""
    if "xfuser" in sys.modules:
        raise RuntimeError("xfuser_cpu.install() must run before xfuser is imported")
    sys.meta_path.insert(0, _EnvsHook(flash))


_PENDING: list[tuple[Any, torch.Tensor]] = []  # (gloo send work, its private copy)


class _Done:
    """A completed work handle (what an eager NCCL send's wait() amounts to on the host)."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _eager_isend(tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0) -> _Done:
    """``isend`` that goes out on a private copy of ``tensor`` (a later in-place write cannot reach the
    wire) and returns a completed handle; the real work is kept (a dropped gloo send work never lands)."""
    copy = tensor.clone()
    _PENDING.append((dist.isend(copy, dst, group=group, tag=tag), copy))
    return _Done()


def _p2p_op(op: Any, *args: Any, **kwargs: Any) -> Any:
    """``P2POp`` accepting the eager isend (torch checks ``op`` against its own isend / irecv)."""
    return c10d.P2POp(dist.isend if op is _eager_isend else op, *args, **kwargs)


def _eager_batch_isend_irecv(ops: list) -> list:
    """``batch_isend_irecv`` whose isends are eager (:func:`_eager_isend`); irecvs are posted as usual."""
    works = []
    for op in ops:
        if op.op is dist.isend or op.op is c10d.isend:
            works.append(_eager_isend(op.tensor, op.peer, group=op.group, tag=op.tag))
        else:
            works.append(dist.irecv(op.tensor, op.peer, group=op.group, tag=op.tag))
    return works


def drain() -> None:
    """Wait for the eager sends still in flight (call before reading results or tearing down)."""
    while _PENDING:
        work, _ = _PENDING.pop(0)
        work.wait()


class _Proxy:
    """A module seen through attribute overrides (the rest comes from ``base``)."""

    def __init__(self, base: Any, **overrides: Any) -> None:
        self._base = base
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


def after_import() -> None:
    """Bind the module-level names xfuser chose at import time on the CUDA test (``STANDINS``)."""
    import xfuser.core.distributed.group_coordinator as coordinator
    import xfuser.model_executor.layers.usp as usp
    import yunchang.globals

    if usp.PROCESS_GROUP is None:
        usp.PROCESS_GROUP = yunchang.globals.PROCESS_GROUP
    coordinator.synchronize = lambda *args, **kwargs: None
    eager = _Proxy(
        torch.distributed, isend=_eager_isend, P2POp=_p2p_op, batch_isend_irecv=_eager_batch_isend_irecv
    )
    coordinator.torch = _Proxy(torch, distributed=eager)
