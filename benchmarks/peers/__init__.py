"""The peer systems of the benchmark suite: where they live and how they are put on ``sys.path``.

``bash benchmarks/peers/install.sh`` installs yunchang, ring-flash-attn, xfuser and distvae into ``benchmarks/.peers``;
DeepSpeed (``DistributedAttention``, ALST's ``UlyssesSPAttentionHF``) comes with the main install.
:func:`activate` prepends the flash-attn CPU shim and ``.peers`` to ``sys.path`` for this process only.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SITE = HERE.parent / ".peers"
SHIM = HERE / "flash_attn_shim"
VERSIONS = {"yunchang": "0.6.4", "ring_flash_attn": "0.1.8"}
# imported only by benchmarks/peers/xfuser_dit.py, after its CPU stand-ins (xfuser does not import on CPU without them)
LAZY_VERSIONS = {"xfuser": "0.7.0", "distvae": "0.1.0"}
INSTALL_HINT = "run `bash benchmarks/peers/install.sh` (installs yunchang 0.6.4, ring-flash-attn 0.1.8, xfuser 0.7.0, distvae 0.1.0)"


def activate() -> dict[str, str | None]:
    """Put the shim and the peer site directory on ``sys.path``; return ``{peer: None | why it cannot run}``."""
    for path in (str(SITE), str(SHIM)):
        if path not in sys.path:
            sys.path.insert(0, path)
    _transformers_compat()
    missing: dict[str, str | None] = {}
    for name, version in VERSIONS.items():
        try:
            importlib.import_module(name)
            found = importlib.metadata.version(name.replace("_", "-"))
            missing[name] = (
                None if found == version else f"{name} {found} is installed, the suite pins {version}"
            )
        except Exception as exc:
            missing[name] = f"{name} does not import ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    for name, version in LAZY_VERSIONS.items():
        try:
            found = importlib.metadata.version(name)
            missing[name] = (
                None if found == version else f"{name} {found} is installed, the suite pins {version}"
            )
        except importlib.metadata.PackageNotFoundError:
            missing[name] = f"{name} is not installed; {INSTALL_HINT}"
    return missing


def _transformers_compat() -> None:
    """ring-flash-attn 0.1.8 imports ``is_flash_attn_greater_or_equal_2_10`` from transformers at import
    time (for its HF adapter, which the suite does not use); transformers 5 removed it. Supply it."""
    try:
        import transformers.modeling_flash_attention_utils as fa_utils
    except Exception:
        return
    if not hasattr(fa_utils, "is_flash_attn_greater_or_equal_2_10"):
        fa_utils.is_flash_attn_greater_or_equal_2_10 = lambda: True
