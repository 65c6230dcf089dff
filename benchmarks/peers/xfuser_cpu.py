"""Stand-ins that let xfuser 0.7.0 import and set up on a CPU-only machine with gloo (its files untouched).

xfuser decides its platform once, in ``xfuser/envs.py``, and has no CPU branch there. :func:`install`
(before ``import xfuser``) puts an import hook in place that, right after ``xfuser.envs`` has executed,
replaces what has no CPU answer; :func:`after_import` fixes what other modules decided at import time.
Every stand-in is listed in ``STANDINS`` with the xfuser line it answers (recorded in the results).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

STANDINS = [
    "xfuser/envs.py:138 get_device_version() raises NotImplementedError('No Accelerators ...') on CPU "
    "(read at import by xfuser/config/config.py:11 CUDA_VERSION): stand-in returns None, as envs.py does for MPS/NPU",
    "xfuser/envs.py:152 get_torch_distributed_backend() raises on CPU: stand-in returns 'gloo'",
    "xfuser/envs.py:373 check_long_ctx_attn() is False without torch.cuda (yunchang imports fine on CPU): "
    "stand-in sets packages_info['has_long_ctx_attn'] = True",
    "xfuser/model_executor/layers/usp.py:10 takes yunchang's PROCESS_GROUP only if torch.cuda.is_available(), "
    "else None (USP then fails on PROCESS_GROUP.ULYSSES_PG): stand-in binds usp.PROCESS_GROUP to yunchang's",
]


class _EnvsHook(importlib.abc.MetaPathFinder):
    """Loads ``xfuser.envs`` as usual, then applies the CPU stand-ins to it (once)."""

    def __init__(self, flash: bool) -> None:
        self.flash = flash

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "xfuser.envs":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module
        flash = self.flash

        def exec_module(module: Any) -> None:
            run(module)
            module.get_device_version = lambda: None
            module.get_torch_distributed_backend = lambda: "gloo"
            info = module.PACKAGES_CHECKER.packages_info
            info["has_long_ctx_attn"] = True
            info["has_flash_attn"] = flash

        spec.loader.exec_module = exec_module
        return spec


def install(flash: bool = False) -> None:
    """Put the ``xfuser.envs`` hook in place; ``flash`` marks the flash-attn CPU shim as flash-attn 2."""
    if "xfuser" in sys.modules:
        raise RuntimeError("xfuser_cpu.install() must run before xfuser is imported")
    sys.meta_path.insert(0, _EnvsHook(flash))


def after_import() -> None:
    """Bind the module-level names xfuser chose at import time on the CUDA test (``STANDINS``)."""
    import xfuser.model_executor.layers.usp as usp
    import yunchang.globals

    if usp.PROCESS_GROUP is None:
        usp.PROCESS_GROUP = yunchang.globals.PROCESS_GROUP
