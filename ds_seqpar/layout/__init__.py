"""Token layouts: which global positions each rank holds, in which order (docs/ring.md, docs/attention.md).

Every layout is a class (``layout/ring.py`` for the ring layouts and their registry, ``layout/composite.py``
for the layouts built from them); masks are built from global positions (``ops/masks.py``), so no layout
has mask logic. ``SeqLayout(name, world, granularity)`` is the name this factory had before layouts were
classes.
"""

from ds_seqpar.layout.base import Layout, LayoutError, padded_length
from ds_seqpar.layout.composite import BlockLayout, GroupLayout, PieceLayout, UspLayout, piece_multiple
from ds_seqpar.layout.documents import doc_ids_from_cu_seqlens, document_lengths, positions_from_cu_seqlens
from ds_seqpar.layout.grouped import GroupedPlacement, dynamic_placement, place_in_groups
from ds_seqpar.layout.placement import Placement, layout_work, place_documents, token_work
from ds_seqpar.layout.ring import (
    LAYOUTS,
    ContiguousLayout,
    RingLayout,
    StripeLayout,
    TeamZigzagLayout,
    ZigzagLayout,
    register_layout,
    ring_layout,
)

SeqLayout = ring_layout

__all__ = [
    "LAYOUTS",
    "BlockLayout",
    "ContiguousLayout",
    "GroupLayout",
    "GroupedPlacement",
    "Layout",
    "LayoutError",
    "PieceLayout",
    "Placement",
    "RingLayout",
    "SeqLayout",
    "StripeLayout",
    "TeamZigzagLayout",
    "UspLayout",
    "ZigzagLayout",
    "doc_ids_from_cu_seqlens",
    "document_lengths",
    "dynamic_placement",
    "layout_work",
    "padded_length",
    "piece_multiple",
    "place_documents",
    "place_in_groups",
    "positions_from_cu_seqlens",
    "register_layout",
    "ring_layout",
    "token_work",
]
