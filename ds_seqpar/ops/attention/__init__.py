"""Exact block attention with log-sum-exp: the single-device kernel under every ring / Ulysses schedule.

``contract.py`` says what a kernel computes; ``dispatch.py`` validates a block and runs it on a kernel of
the registry ``KERNELS`` (``torch_kernel.py``, ``cpu_sdpa.py``, ``cuda_sdpa.py``, ``flash.py``);
``reference.py`` is the dense fp64 reference every kernel and distributed algorithm is tested against.
"""

from ds_seqpar.ops.attention.contract import Alibi, AttentionKernel, Band, Varlen
from ds_seqpar.ops.attention.dispatch import (
    KERNELS,
    available_kernels,
    block_attn_backward,
    block_attn_forward,
    check_softcap,
    kernel_for,
    register_kernel,
    resolve_kernel,
)
from ds_seqpar.ops.attention.flash import flash_attn_kernel
from ds_seqpar.ops.attention.reference import dense_attention_reference
from ds_seqpar.ops.attention.torch_kernel import torch_chunked_kernel

__all__ = [
    "KERNELS",
    "Alibi",
    "AttentionKernel",
    "Band",
    "Varlen",
    "available_kernels",
    "block_attn_backward",
    "block_attn_forward",
    "check_softcap",
    "dense_attention_reference",
    "flash_attn_kernel",
    "kernel_for",
    "register_kernel",
    "resolve_kernel",
    "torch_chunked_kernel",
]
