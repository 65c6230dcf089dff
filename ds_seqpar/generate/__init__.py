"""``ds_seqpar.generate``: the generation function, and ``python -m ds_seqpar.generate`` (docs/inference_cli.md).

Importing this package makes Python bind ``ds_seqpar.generate`` to the package instead of the function
(``integrations/generation.py``); the package is therefore callable and forwards every call to the function,
so ``ds_seqpar.generate(model, input_ids, mesh=..., ...)`` works the same before and after the command line's
import. The command line itself lives in ``ds_seqpar/cli/generate.py``.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from ds_seqpar.integrations.generation import GenerateOutput
from ds_seqpar.integrations.generation import generate as _generate

__all__ = ["GenerateOutput", "generate"]

generate = _generate
__wrapped__ = _generate  # inspect.signature(ds_seqpar.generate) shows the function's signature


class _CallableModule(types.ModuleType):
    """This package, callable as :func:`ds_seqpar.integrations.generation.generate`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
