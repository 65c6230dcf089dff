"""One registry of interchangeable backends, used for every family of kernels in ``ops/``.

A family (the dense attention kernels, the sparse kernels, the fused recurrent kernels of
flash-linear-attention) is one :class:`Registry`; an entry is a :class:`Backend`: its name, the object
callers use, why it cannot run for a (device, dtype) (or None), and optionally a first-use ``verify`` that
compares it with the PyTorch form (its result is cached per (device, dtype); a backend that fails it is
unavailable from then on, with one warning). Registration order is the ``auto`` order.

    registry.resolve(name, device, dtype)   a name or "auto" -> the backend's object; ValueError naming
                                            why it cannot run and the valid names here
    registry.available(device, dtype)       names that can run, in auto order
    registry.usable(name, device, dtype)    the object, or None when it cannot run (optional fast paths)

The ``auto`` choice is logged once per (family, device type, dtype, detail).
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["AUTO", "Backend", "Registry"]

AUTO = "auto"
logger = logging.getLogger("ds_seqpar")


@dataclass(frozen=True)
class Backend:
    """One backend of a family.

    Args:
        name: what the config (or the caller) names it by.
        impl: the object callers use (a kernel, or a loader of one).
        unavailable: ``(device, dtype) -> reason or None``: why it cannot run there.
        summary: one line for the config's description and the report.
        verify: optional first-use check ``(device, dtype) -> reason or None`` (e.g. against PyTorch).
    """

    name: str
    impl: Any
    unavailable: Callable[[torch.device, torch.dtype], str | None]
    summary: str = ""
    verify: Callable[[torch.device, torch.dtype], str | None] | None = None


def always_available(device: torch.device, dtype: torch.dtype) -> str | None:
    """The ``unavailable`` of a backend that runs anywhere."""
    return None


class Registry:
    """The backends of one family, in ``auto`` order (see the module docstring).

    Args:
        what: the family's name in messages (``"kernel"``, ``"sparse kernel"``).
        config_key: the ``sequence_parallel`` key that chooses it (named in the ``auto`` log line), or None.
    """

    def __init__(self, what: str, config_key: str | None = None) -> None:
        self.what, self.config_key = what, config_key
        self.entries: dict[str, Backend] = {}
        self._verified: dict[tuple[str, str, torch.dtype], str | None] = {}

    def register(self, backend: Backend) -> Backend:
        """Add (or replace) ``backend``; a new name goes last in the ``auto`` order."""
        if not isinstance(backend, Backend) or not backend.name or backend.name == AUTO:
            raise TypeError(
                f"{self.what} registry takes a Backend with a name other than 'auto', got {backend!r}"
            )
        self.entries[backend.name] = backend
        self._verified = {k: v for k, v in self._verified.items() if k[0] != backend.name}
        return backend

    # the names and objects -----------------------------------------------------------------
    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __getitem__(self, name: str) -> Any:
        return self.entries[name].impl

    def items(self) -> Iterator[tuple[str, Any]]:
        return ((name, b.impl) for name, b in self.entries.items())

    # availability --------------------------------------------------------------------------
    def why_unavailable(self, name: str, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why backend ``name`` cannot run for ``(device, dtype)`` (its first-use check included), or None."""
        backend = self.entries[name]
        reason = backend.unavailable(device, dtype)
        if reason is not None or backend.verify is None:
            return reason
        key = (name, device.type, dtype)
        if key not in self._verified:
            self._verified[key] = backend.verify(device, dtype)
            if self._verified[key] is not None:
                warnings.warn(
                    f"{self.what} {name!r} disagrees with ds_seqpar ({self._verified[key]}); using PyTorch",
                    stacklevel=3,
                )
        return self._verified[key]

    def available(
        self, device: torch.device | str, dtype: torch.dtype, accepts: Callable[[Any], bool] | None = None
    ) -> list[str]:
        """Names that can run for ``(device, dtype)`` (and that ``accepts``), in ``auto`` order."""
        device = torch.device(device)
        return [
            name
            for name, b in self.entries.items()
            if (accepts is None or accepts(b.impl)) and self.why_unavailable(name, device, dtype) is None
        ]

    def usable(self, name: str, device: torch.device | str, dtype: torch.dtype) -> Any | None:
        """The object of ``name`` when it can run for ``(device, dtype)``, else None (a fast path's fallback)."""
        if name not in self.entries:
            return None
        return (
            self.entries[name].impl
            if self.why_unavailable(name, torch.device(device), dtype) is None
            else None
        )

    def resolve(
        self,
        name: str,
        device: torch.device | str,
        dtype: torch.dtype,
        accepts: Callable[[Any], bool] | None = None,
        refusal: str = "",
        detail: str = "",
    ) -> Any:
        """The object ``name`` (``"auto"``: the first available that ``accepts``) runs as on ``(device, dtype)``.

        ``refusal``: why a named backend that ``accepts`` rejects cannot serve (e.g. "cannot apply softcap=2");
        ``detail``: what the ``auto`` log line adds to the device and dtype. ValueError naming the reason
        and the valid names here when it cannot run.
        """
        device = torch.device(device)
        if name == AUTO:
            chosen = self.available(device, dtype, accepts)
            if not chosen:
                raise ValueError(f"no {self.what} runs on {device.type} {dtype}{detail}")
            _log_auto(self.what, self.config_key, device.type, dtype, detail, chosen[0])
            return self.entries[chosen[0]].impl
        if name not in self.entries:
            raise ValueError(f"unknown {self.what}={name!r}; valid names: {AUTO}, {', '.join(self.entries)}")
        reason = self.why_unavailable(name, device, dtype)
        if reason is None and accepts is not None and not accepts(self.entries[name].impl):
            reason = refusal
        if reason is not None:
            valid = ", ".join([AUTO, *self.available(device, dtype, accepts)])
            raise ValueError(f"{self.what}={name!r} {reason}; valid here ({device.type}, {dtype}): {valid}")
        return self.entries[name].impl


@functools.cache
def _log_auto(
    what: str, key: str | None, device_type: str, dtype: torch.dtype, detail: str, name: str
) -> None:
    """Say once per (family, device type, dtype, detail) which backend ``auto`` runs as."""
    choose = f" (set sequence_parallel.{key} to choose)" if key else ""
    logger.info(
        "ds_seqpar: %s 'auto' runs as %r on %s %s%s%s", what, name, device_type, dtype, detail, choose
    )
