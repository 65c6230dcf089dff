"""A stand-in for flash-linear-attention's kernels on CPU: the fused-path plumbing of the recurrent ops
(``ops/fla.py``) tested without fla or a GPU."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ds_seqpar.ops import fla


def use_stand_in(monkeypatch, kernel: Callable) -> None:
    """Every registered fla kernel served by ``kernel`` on CPU, its first-use check not yet run (undone by
    ``monkeypatch`` after the test)."""
    monkeypatch.setattr(fla, "FUSED_DEVICES", ("cpu",))
    monkeypatch.setattr(fla.FLA_KERNELS, "_verified", {})
    for name, entry in list(fla.FLA_KERNELS.entries.items()):
        stand_in = dataclasses.replace(entry.impl, load=lambda: kernel)
        monkeypatch.setitem(fla.FLA_KERNELS.entries, name, fla.fla_backend(name, stand_in, entry.summary))
