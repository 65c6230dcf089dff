"""The accumulation rule: outputs, lse, gradients and travelling accumulators are float64 for float64
inputs, else float32 (so ring merges and gradient sums stay exact; outputs are cast to the input dtype
at the end). One rule, as a dtype and in bytes."""

from __future__ import annotations

import torch

__all__ = ["accumulation_dtype", "accumulator_bytes"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype for inputs of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def accumulator_bytes(element_bytes: int) -> int:
    """Bytes per accumulator element for inputs of ``element_bytes`` bytes (the same rule, in bytes)."""
    return 8 if element_bytes == 8 else 4
