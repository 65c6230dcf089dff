"""A stand-in for flash-linear-attention's kernels on CPU: the fused-path plumbing of the recurrent ops
(``ops/fla.py``) tested without fla or a GPU."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from ds_seqpar.ops import fla


def use_stand_in(monkeypatch, kernel: Callable) -> None:
    """Every registered fla kernel served by ``kernel`` on CPU, its first-use check not yet run (undone by
    ``monkeypatch`` after the test)."""
    monkeypatch.setattr(fla, "FUSED_DEVICES", ("cpu",))
    monkeypatch.setattr(fla.FLA_KERNELS, "_verified", {})
    for name, entry in list(fla.FLA_KERNELS.entries.items()):
        stand_in = dataclasses.replace(entry.impl, load=lambda: kernel)
        monkeypatch.setitem(fla.FLA_KERNELS.entries, name, fla.fla_backend(name, stand_in, entry.summary))


class _BackwardRefused(torch.autograd.Function):
    """Identity forward; a backward that raises as fla does on a GPU / Triton pair it knows to be wrong."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results")


def backward_refused(kernel: Callable) -> Callable:
    """``kernel`` with exact outputs whose backward raises (fla's refusal, seen on an H200)."""

    @functools.wraps(kernel)  # fla_call reads the parameters of the wrapped kernel
    def refusing(*args, **kwargs):
        out, state = kernel(*args, **kwargs)
        return _BackwardRefused.apply(out), state

    return refusing
