"""flash-linear-attention's chunked kernels as optional fused paths of the recurrent ops, in one registry.

Each op family registers the fla kernels it can use (``ops/linear``: ``simple_gla``, ``gla``;
``ops/delta``: ``gated_delta_rule``, ``kda``) as a :class:`FlaKernel`: where the function lives and a
``compare(kernel, device, dtype)`` that runs it and the PyTorch chunk form on a small input, forward and
backward (:func:`outputs_and_grads`). A kernel serves a call (:func:`fla_kernel`) only on a fused device
(CUDA), when fla imports, when ``DS_SEQPAR_NO_FLA=1`` is unset, and after its first use per (device,
dtype) agreed with PyTorch within 1e-3 (float32) or 5e-2 (half precision) relative error, outputs and
gradients alike; on a mismatch or an error (an incompatible fla API, or fla refusing its own backward on
a GPU / Triton pair it knows to be wrong) the registry warns once and PyTorch serves, so an incompatible
fla version is never silently wrong and never fails mid-training.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ds_seqpar.ops.backends import Backend, Registry

__all__ = [
    "FLA_KERNELS",
    "FUSED_DEVICES",
    "FlaKernel",
    "fla_backend",
    "fla_call",
    "fla_kernel",
    "imported",
    "outputs_and_grads",
]

FUSED_DEVICES = ("cuda",)
FLA_KERNELS = Registry("flash-linear-attention kernel")
"""The fla kernels the recurrent ops may run instead of their PyTorch chunk form."""

Compare = Callable[[Callable, torch.device, torch.dtype], list[tuple[torch.Tensor, torch.Tensor]]]


def imported(module: str, function: str) -> Callable[[], Callable | None]:
    """A loader of ``module.function`` (imported on first use; None when it does not import)."""

    @functools.cache
    def load() -> Callable | None:
        try:
            return getattr(importlib.import_module(module), function)
        except Exception:  # not installed, or no Triton / CUDA: stay on PyTorch
            return None

    return load


@dataclass(frozen=True)
class FlaKernel:
    """One fla kernel: ``load()`` returns the function (None when fla does not import); ``compare`` runs it
    and the PyTorch form on a small input and returns ``(fla, pytorch)`` pairs."""

    load: Callable[[], Callable | None]
    compare: Compare

    def unavailable(self, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type not in FUSED_DEVICES:
            return f"needs {' or '.join(FUSED_DEVICES)} tensors (got device {device.type!r})"
        if os.environ.get("DS_SEQPAR_NO_FLA") == "1":
            return "is switched off by DS_SEQPAR_NO_FLA=1"
        if self.load() is None:
            return "needs the flash-linear-attention package (pip install flash-linear-attention)"
        return None

    def verify(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """None when fla agrees with PyTorch on the small input, else why not."""
        tol = 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2
        try:  # gradients are compared too, also when the first use is under no_grad / inference_mode
            with torch.inference_mode(False), torch.enable_grad():
                pairs = self.compare(self.load(), device, dtype)
            err = max(
                float(
                    (got.float().cpu() - ref.float().cpu()).abs().max()
                    / ref.float().abs().max().clamp(min=1e-6)
                )
                for got, ref in pairs
            )
        except Exception as exc:  # an incompatible fla API, or fla refusing its backward here
            return f"{type(exc).__name__}: {exc}"
        return None if err <= tol else f"relative error {err:.2e} > {tol:g}"


def outputs_and_grads(outputs: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``outputs`` followed by the gradients of ``leaves`` under one fixed random linear loss of the outputs
    (the same weights for the same output shapes), so a first-use check compares the backward too."""
    gen = torch.Generator().manual_seed(1)
    loss = sum((out.float() * torch.randn(out.shape, generator=gen).to(out.device)).sum() for out in outputs)
    grads = torch.autograd.grad(loss, list(leaves))
    return [*(out.detach() for out in outputs), *grads]


def fla_backend(name: str, kernel: FlaKernel, summary: str = "") -> Backend:
    """The registry entry of ``kernel``."""
    return Backend(name, kernel, kernel.unavailable, summary, kernel.verify)


def fla_kernel(name: str, q: torch.Tensor) -> Callable | None:
    """The fla kernel ``name`` when it may serve ``q`` (a non-empty piece on a fused device, checked), else None."""
    if q.shape[1] == 0:
        return None
    kernel = FLA_KERNELS.usable(name, q.device, q.dtype)
    return None if kernel is None else kernel.load()


def fla_call(kernel: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call an fla kernel on ``[B, S, H, d]`` tensors: older fla versions are told the layout
    (``head_first=False``), and q / k are used as given (no in-kernel l2 norm)."""
    params = inspect.signature(kernel).parameters
    if "use_qk_l2norm_in_kernel" in params:
        kwargs["use_qk_l2norm_in_kernel"] = False
    if "head_first" in params:
        kwargs["head_first"] = False
    return kernel(*args, **kwargs)
