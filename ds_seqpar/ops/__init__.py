"""Math layer: single-device attention blocks, masks and merges (no process groups)."""

from ds_seqpar.ops.attention import (
    KERNELS,
    AttentionKernel,
    available_kernels,
    block_attn_backward,
    block_attn_forward,
    resolve_kernel,
    torch_chunked_kernel,
)
from ds_seqpar.ops.attention.reference import dense_attention_reference
from ds_seqpar.ops.masks import BlockKind, MaskSpec, classify_block, token_mask
from ds_seqpar.ops.merge import merge_attn, merge_attn_

__all__ = [
    "KERNELS",
    "AttentionKernel",
    "BlockKind",
    "MaskSpec",
    "available_kernels",
    "block_attn_backward",
    "block_attn_forward",
    "classify_block",
    "dense_attention_reference",
    "merge_attn",
    "merge_attn_",
    "resolve_kernel",
    "token_mask",
    "torch_chunked_kernel",
]
