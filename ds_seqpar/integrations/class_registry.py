"""The lookup the layer registries share (``recurrent_layers.py``, ``attention_layers.py``): class -> forward.

Built-in entries are named by (transformers module, class name) and resolved only when that module is
already imported, so no model module is imported to look one up; entries registered from user code are
classes. A module matches its own class or the nearest registered base class.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch


def registered_forward(
    module: torch.nn.Module, builtins: dict[tuple[str, str], Callable], registry: dict[type, Callable]
) -> Callable | None:
    """The forward registered for ``module``'s class (or a base class), else None; resolves ``builtins``
    whose transformers module is imported into ``registry`` first."""
    for (module_name, class_name), forward in builtins.items():
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is not None and cls not in registry:
            registry[cls] = forward
    return next((registry[c] for c in type(module).__mro__ if c in registry), None)
