"""The gated delta rule (GDN, KDA) in chunk form with its All-Scan split (``chunk.py``) and the
token-by-token ground truth (``reference.py``); docs/delta.md."""

from ds_seqpar.ops.delta.chunk import (
    DeltaPiece,
    FusedDeltaPiece,
    chunk_delta_rule,
    delta_piece,
    entering_state_output,
    piece_outputs,
    piece_transition,
    prepare_piece,
)
from ds_seqpar.ops.delta.reference import delta_rule_reference

__all__ = [
    "DeltaPiece",
    "FusedDeltaPiece",
    "chunk_delta_rule",
    "delta_piece",
    "delta_rule_reference",
    "entering_state_output",
    "piece_outputs",
    "piece_transition",
    "prepare_piece",
]
