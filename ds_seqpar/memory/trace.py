"""What is alive at the peak of a training step: live tensor bytes by module and phase.

``LiveBytes`` is a ``TorchDispatchMode`` that follows every tensor storage created inside it until the
storage is freed (a weak-reference finalizer on the storage), labels it with the module running when it
was created (global module hooks) and the phase (``forward`` / ``backward``, recomputed layers show as
``backward`` + their module), and records the peak of the live total with the breakdown at that moment.
Tensors created before the mode (parameters, optimizer states) are not counted: the peak is the growth
of one step, the quantity the memory suite measures as resident memory growth.

Used by ``benchmarks.suites.e2e --mode trace``, the memory-model tests, and to derive the memory model
(docs/memory.md "Measuring a step").
"""

from __future__ import annotations

import os
import weakref
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Live bytes of the storages created inside the mode; ``peak`` and ``at_peak`` (label -> bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[int, str, Any]] = {}
        self.current = 0
        self.peak = 0
        self.at_peak: Counter[str] = Counter()
        self.phase = "forward"
        self._modules: list[str] = []
        self._names: dict[int, str] = {}
        self._handles: list[Any] = []
        self.detail = bool(os.environ.get("DS_SEQPAR_TRACE_DETAIL"))  # labels name the op and shape too

    # ------------------------------------------------------------------ labels
    def name_modules(self, model: torch.nn.Module) -> None:
        """Label allocations with the qualified names of ``model``'s modules (digits folded: layers.*)."""
        for name, module in model.named_modules():
            self._names[id(module)] = ".".join("*" if p.isdigit() else p for p in name.split(".")) or "model"

    def _push(self, module: torch.nn.Module, *_: Any) -> None:
        self._modules.append(self._names.get(id(module), type(module).__name__))

    def _pop(self, *_: Any) -> None:
        if self._modules:
            self._modules.pop()

    def label(self) -> str:
        where = self._modules[-1] if self._modules else "-"
        return f"{self.phase}:{where}"

    # ------------------------------------------------------------------ tracking
    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.current -= entry[0]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            key = storage.data_ptr()
            if nbytes == 0 or key in self.live or key in inputs:  # a view or in-place result: not new
                continue
            self.live[key] = (
                nbytes,
                self.label() + (f":{func.__name__}{tuple(t.shape)}" if self.detail else ""),
                weakref.ref(storage),
            )
            self.current += nbytes
            weakref.finalize(storage, self._free, key)
            if self.current > self.peak:
                self._settle()
            if self.current > self.peak:
                self.peak = self.current
                self.at_peak = Counter()
                for size, label, _ in self.live.values():
                    self.at_peak[label] += size
        return out

    def _settle(self) -> None:
        """Re-read the live storages' sizes: a storage resized in place (``resize_(0)`` frees the data of
        a tensor whose graph is still needed, ``memory/checkpoint.py``) holds fewer bytes than it was
        created with."""
        for key, (nbytes, label, ref) in list(self.live.items()):
            storage = ref()
            now = nbytes if storage is None else storage.nbytes()
            if now != nbytes:
                self.live[key] = (now, label, ref)
                self.current -= nbytes - now

    def __enter__(self) -> LiveBytes:
        self._handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._push),
            torch.nn.modules.module.register_module_forward_hook(self._pop),
        ]
        self._backward = torch.autograd.backward  # ``loss.backward()`` goes through it: the phase switches

        def backward(*args: Any, **kwargs: Any) -> Any:
            self.phase = "backward"
            return self._backward(*args, **kwargs)

        torch.autograd.backward = backward
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.autograd.backward = self._backward
        for handle in self._handles:
            handle.remove()
        super().__exit__(*exc)

    def table(self, top: int = 25) -> str:
        rows = [f"peak {self.peak / 2**20:.2f} MiB live (created in the step)"]
        rows += [f"  {v / 2**20:8.2f} MiB  {k}" for k, v in self.at_peak.most_common(top)]
        return "\n".join(rows)
