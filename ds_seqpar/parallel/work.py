"""What attention work a rank actually computed (balance of layouts and schedules, tests and benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkCounter:
    """Attention work this rank actually computed: score pairs (query x key) and segment blocks.

    A pair is one visible (unmasked) score of a kernel call, the work an ideal kernel does: every pair
    of a FULL rectangle, the lower-left part of a CAUSAL block, the mask's count of a PARTIAL one (per
    batch row). Balance across ranks is ``max / mean`` of ``forward_pairs`` (1.0 = perfect). ``blocks`` /
    ``skipped_blocks`` count forward (query segment, key segment) pairs computed / skipped as EMPTY.
    """

    forward_pairs: int = 0
    backward_pairs: int = 0
    blocks: int = 0
    skipped_blocks: int = 0

    def reset(self) -> None:
        self.forward_pairs = self.backward_pairs = self.blocks = self.skipped_blocks = 0
