"""Dynamic vertical-slash sparse attention (MTraining / MInference, docs/sparse.md), one module per job:

    pattern.py        the pattern and its estimation over the ranks that share the sequence
    tiles.py          the ``blocks`` kernel: the tile planner over the dense block kernel
    triton_kernel.py  the ``triton`` kernel: block-sparse Triton, no host sync
    kernels.py        the sparse kernel registry (``SPARSE_KERNELS``: triton, blocks, masked) and ``visible_pairs``
    work.py           work per (query rank, key rank) and the imbalance ratio ρ_s (db-SP)
    reference.py      the fp64 ground truth (dense attention under the pattern's mask)
    topk.py           DeepSeek sparse attention: indexer scores, top-k keys per query, attention over them
                      (docs/dsa.md; used by parallel/topk_sparse.py, not by sparse_ring)

Legend: B, H, H_kv, D batch, query heads, key/value heads, head dim; S global sequence length (positions
are GLOBAL, 0..S-1); G ``block_size``, the tile of the block mask; nB = ceil(S/G); Sq, Sk query / key rows
of one (query shard, key shard) pair, in any layout.
"""

from ds_seqpar.ops.sparse.kernels import (
    SPARSE_AUTO_SUMMARY,
    SPARSE_KERNELS,
    SparseKernel,
    available_sparse_kernels,
    register_sparse_kernel,
    resolve_sparse_kernel,
    visible_pairs,
)
from ds_seqpar.ops.sparse.pattern import (
    Reducer,
    SparsePattern,
    VerticalSlashBudget,
    diagonals_to_blocks,
    estimate_pattern,
)
from ds_seqpar.ops.sparse.reference import sparse_attention_reference
from ds_seqpar.ops.sparse.tiles import check_pair_shapes, sparse_attn_backward, sparse_attn_forward
from ds_seqpar.ops.sparse.work import block_row_work, block_work, imbalance_ratio

__all__ = [
    "SPARSE_AUTO_SUMMARY",
    "SPARSE_KERNELS",
    "Reducer",
    "SparseKernel",
    "SparsePattern",
    "VerticalSlashBudget",
    "available_sparse_kernels",
    "block_row_work",
    "block_work",
    "check_pair_shapes",
    "diagonals_to_blocks",
    "estimate_pattern",
    "imbalance_ratio",
    "register_sparse_kernel",
    "resolve_sparse_kernel",
    "sparse_attention_reference",
    "sparse_attn_backward",
    "sparse_attn_forward",
    "visible_pairs",
]
