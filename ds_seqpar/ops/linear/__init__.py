"""Chunked linear attention with decay and its All-Scan split (``chunk.py``), the token-by-token ground
truth (``reference.py``), and the input checks the recurrent ops share (``checks.py``); docs/linear.md."""

from ds_seqpar.ops.linear.chunk import (
    LocalScan,
    advance_state,
    chunk_linear_attention,
    entering_state_output,
    local_scan,
    piece_state,
)
from ds_seqpar.ops.linear.reference import linear_attention_reference

__all__ = [
    "LocalScan",
    "advance_state",
    "chunk_linear_attention",
    "entering_state_output",
    "linear_attention_reference",
    "local_scan",
    "piece_state",
]
