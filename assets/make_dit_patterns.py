"""Write the shipped DiT block patterns ``assets/dit_patterns/<name>.pt`` (docs/dit_sparse.md "Shipped patterns").

    PYTHONPATH=. .venv/bin/python assets/make_dit_patterns.py

Each file holds the bool mask ``[1, H, nB, nB]`` of ``ds_seqpar.ops.sparse.dit_patterns.SHIPPED[name]``;
the generator is deterministic, so the files are what it gives (tests/test_dit_sparse.py checks it).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ds_seqpar.ops.sparse.dit_patterns import SHIPPED, dit_pattern

OUT = Path(__file__).resolve().parent / "dit_patterns"


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for name, spec in SHIPPED.items():
        pattern = dit_pattern(spec)
        torch.save(pattern.mask.clone(), OUT / f"{name}.pt")
        dens = pattern.mask.float().mean((0, 2, 3)).tolist()
        print(
            f"{name}: S={spec.seq_len} G={spec.block_size} H={spec.heads} density {pattern.density():.4f}; "
            f"per head {', '.join(f'{d:.3f}' for d in dens)}"
        )


if __name__ == "__main__":
    main()
