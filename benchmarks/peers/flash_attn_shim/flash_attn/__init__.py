"""CPU stand-in for the ``flash_attn`` package: the benchmark suite's peer rows and the flash_attn kernel's tests.

Peers (yunchang, ring-flash-attn, DeepSpeed Ulysses with a flash local attention) call flash-attn's
block functions. On a CPU-only machine this package serves those calls with PyTorch's CPU flash
attention op (``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` and its backward), the
same op ds_seqpar's ``sdpa`` kernel runs, so every row of a table computes attention with one kernel.
Windows, softcap and the varlen pair run on a dense fp64 computation (tests of ds_seqpar's
``flash_attn`` kernel use them). It is not flash-attn: no dropout or ALiBi (those raise).
"""

from flash_attn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func

__version__ = (
    "2.6.3"  # the flash-attn API generation this shim follows (4-tuple forward, *_left/_right windows)
)
__all__ = ["flash_attn_func", "flash_attn_varlen_func"]
