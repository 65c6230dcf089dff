"""The ``flash_attn`` block kernel: flash-attn's own forward and backward functions (2.x or 3).

docs/kernels.md "flash_attn". The engine needs a backward that takes the FINAL out / lse of the rows
(merged over every key block), which flash-attn's public autograd functions do not accept; its internal
``_flash_attn_forward`` / ``_flash_attn_backward`` (and the ``_varlen_`` pair) do. Their signatures
changed between releases (``window_size`` tuple in 2.5, ``window_size_left/right`` and ``softcap`` from
2.6, in-place gradients in 2.7, a different module and argument list in flash-attn 3), so every call
is made BY PARAMETER NAME from the signature of the installed function: an argument the function does
not take is left out, and a required parameter this adapter does not know makes the kernel refuse with
the version in the message. Per block:

    FULL / square CAUSAL, fp16 / bf16, D % 8 == 0, D <= 256   flash-attn forward + backward
    sliding-window bands (the engine's ``band`` tasks)        the same with ``window_size``
    packed documents (engine's varlen groups)                 flash-attn varlen forward + backward
    PARTIAL (mask), rectangular causal, other head dims       ``cuda_sdpa`` (efficient op, additive bias)
    the same with a softcap                                   the chunked torch kernel
    every block with ALiBi                                    ``cuda_sdpa`` (torch with a softcap): flash-attn's
                                                              ``alibi_slopes`` is by LOCAL index (docs/kernels.md)

Layouts: q ``[B, Sq, H, D]``, k, v ``[B, Sk, H_kv, D]`` (GQA native), lse ``[B, H, Sq]`` fp32; varlen: q
``[T, H, D]`` with ``cu_seqlens`` int32, lse ``[H, T]``. Tested on CPU against a stand-in of the
flash-attn 2.6 API (``benchmarks/peers/flash_attn_shim``); ``benchmarks/gpu_check.py`` checks the
arithmetic of the real package.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ds_seqpar.ops.attention.contract import AttentionKernel, Band, Varlen

__all__ = ["FlashApi", "flash_api", "flash_backward", "flash_forward", "flash_unavailable"]

DTYPES = (torch.float16, torch.bfloat16)
MIN_VERSION = (2, 5)
NO_WINDOW = (-1, -1)


@dataclass(frozen=True)
class FlashApi:
    """The installed flash-attn's block functions and their parameter names."""

    version: str
    module: str
    forward: Callable[..., Any]
    backward: Callable[..., Any]
    varlen_forward: Callable[..., Any] | None
    varlen_backward: Callable[..., Any] | None

    def has(self, fn: Callable[..., Any], name: str) -> bool:
        return name in _params(fn)


@functools.cache
def _params(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(fn).parameters)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _installed_version(package: str, module: Any) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(module, "__version__", "unknown"))


@functools.cache
def flash_api() -> FlashApi | str:
    """The flash-attn block API of this environment (flash-attn 3 preferred), or why there is none."""
    try:  # flash-attn 3 (Hopper build): top-level module flash_attn_interface, varlen in the same functions
        fa3 = importlib.import_module("flash_attn_interface")
        return FlashApi(
            _installed_version("flash_attn_3", fa3),
            "flash_attn_interface",
            fa3._flash_attn_forward,
            fa3._flash_attn_backward,
            fa3._flash_attn_forward,
            fa3._flash_attn_backward,
        )
    except (ImportError, AttributeError):
        pass
    try:
        fa2 = importlib.import_module("flash_attn.flash_attn_interface")
    except ImportError as exc:
        return f"needs the flash-attn package ({type(exc).__name__}: {exc})"
    version = _installed_version("flash-attn", importlib.import_module("flash_attn"))
    if _version_tuple(version) < MIN_VERSION:
        return f"needs flash-attn >= {'.'.join(map(str, MIN_VERSION))} (found {version}); pip install -U flash-attn"
    if not hasattr(fa2, "_flash_attn_forward") or not hasattr(fa2, "_flash_attn_backward"):
        return (
            f"flash-attn {version} has no _flash_attn_forward / _flash_attn_backward; use kernel='cuda_sdpa'"
        )
    return FlashApi(
        version,
        "flash_attn.flash_attn_interface",
        fa2._flash_attn_forward,
        fa2._flash_attn_backward,
        getattr(fa2, "_flash_attn_varlen_forward", None),
        getattr(fa2, "_flash_attn_varlen_backward", None),
    )


def flash_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the ``flash_attn`` kernel cannot run for ``(device, dtype)``, or None."""
    if device.type != "cuda":
        return f"needs CUDA tensors (got device {device.type!r})"
    api = flash_api()
    if isinstance(api, str):
        return api
    if dtype not in DTYPES:
        return f"needs float16/bfloat16 inputs (got {dtype})"
    return None


# inputs flash-attn 3 lists without defaults that this adapter leaves unused (None = off)
UNUSED_INPUTS = frozenset(
    [
        "k_new",
        "v_new",
        "qv",
        "out",
        "cu_seqlens_q",
        "cu_seqlens_k",
        "cu_seqlens_k_new",
        "seqused_q",
        "seqused_k",
        "sequed_q",
        "sequed_k",
        "max_seqlen_q",
        "max_seqlen_k",
        "page_table",
        "kv_batch_idx",
        "leftpad_k",
        "rotary_cos",
        "rotary_sin",
        "seqlens_rotary",
        "q_descale",
        "k_descale",
        "v_descale",
    ]
)


def _call(api: FlashApi, fn: Callable[..., Any], values: dict[str, Any]) -> Any:
    """Call ``fn`` with the entries of ``values`` its signature names (unused optional inputs as None);
    refuse on a required parameter this adapter does not know."""
    kwargs = {}
    for name, param in _params(fn).items():
        if name in values:
            kwargs[name] = values[name]
        elif name in UNUSED_INPUTS and param.default is inspect.Parameter.empty:
            kwargs[name] = None
        elif param.default is inspect.Parameter.empty and param.kind not in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        ):
            raise RuntimeError(
                f"flash-attn {api.version} ({api.module}.{fn.__name__}) has a required parameter {name!r} this "
                "version of ds_seqpar does not know; use kernel='cuda_sdpa' or a flash-attn release between 2.5 and 3"
            )
    return fn(**kwargs)


def _window_values(window: tuple[int, int], softcap: float | None) -> dict[str, Any]:
    """Window and softcap arguments under every name flash-attn releases have used."""
    return {
        "window_size": window,
        "window_size_left": window[0],
        "window_size_right": window[1],
        "softcap": 0.0 if softcap is None else softcap,
        "dropout_p": 0.0,
        "alibi_slopes": None,
        "return_softmax": False,
        "deterministic": False,
        "rng_state": None,
    }


def _lse_of(result: Any, shape: tuple[int, ...]) -> torch.Tensor:
    """The log-sum-exp among a forward's outputs (its position differs between releases)."""
    for item in result[1:]:
        if isinstance(item, torch.Tensor) and tuple(item.shape) == shape and item.dtype.is_floating_point:
            return item
    raise RuntimeError(f"flash-attn returned no log-sum-exp of shape {shape}")


def _lse_in(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The lse as flash-attn takes it: fp32 (fp64 kept for the fp64 inputs of CPU tests)."""
    return lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32).contiguous()


def _check_softcap(api: FlashApi, fn: Callable[..., Any], softcap: float | None) -> None:
    if softcap is not None and not api.has(fn, "softcap"):
        raise ValueError(
            f"flash-attn {api.version} cannot apply softcap={softcap} (needs flash-attn >= 2.6); "
            "use kernel='torch' or upgrade flash-attn"
        )


def _api() -> FlashApi:
    api = flash_api()
    if isinstance(api, str):
        raise RuntimeError(f"kernel='flash_attn' {api}")
    return api


def _forward(fn_name: str, lse_shape: tuple[int, ...], softcap: float | None, values: dict[str, Any]):
    """One forward call of the API function ``fn_name``: ``(out, lse)`` with lse of ``lse_shape``."""
    api = _api()
    fn = getattr(api, fn_name)
    _check_softcap(api, fn, softcap)
    window = values.pop("window", NO_WINDOW)
    result = _call(api, fn, {**values, **_window_values(window, softcap)})
    return result[0], _lse_of(result, lse_shape)


def _backward(
    fn_name: str,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softcap: float | None,
    values: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One backward call of ``fn_name`` given the FINAL out / lse; the gradients are read from the buffers
    passed in (2.7+ writes them in place and returns only softmax_d)."""
    api = _api()
    fn = getattr(api, fn_name)
    _check_softcap(api, fn, softcap)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    tensors = dict(
        dout=dout.to(q.dtype).contiguous(), q=q, k=k, v=v, out=out.to(q.dtype).contiguous(),
        softmax_lse=_lse_in(lse, q), dq=dq, dk=dk, dv=dv,
    )  # fmt: skip
    window = values.pop("window", NO_WINDOW)
    _call(api, fn, {**tensors, **values, **_window_values(window, softcap)})
    return dq, dk, dv


def _varlen_values(cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int) -> dict[str, Any]:
    return dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)


def flash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    softcap: float | None = None,
    window: tuple[int, int] = NO_WINDOW,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One flash-attn forward: ``q [B, Sq, H, D]``, ``k, v [B, Sk, H_kv, D]`` -> ``out`` (q.dtype),
    ``lse [B, H, Sq]`` fp32. ``causal`` is bottom-right aligned (the same as top-left when Sq == Sk)."""
    values = dict(q=q, k=k, v=v, softmax_scale=scale, causal=causal, window=window)
    return _forward("forward", (q.shape[0], q.shape[2], q.shape[1]), softcap, values)


def flash_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    causal: bool,
    softcap: float | None = None,
    window: tuple[int, int] = NO_WINDOW,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the FINAL ``out`` and ``lse [B, H, Sq]`` (finite) of its rows."""
    values = dict(softmax_scale=scale, causal=causal, window=window)
    return _backward("backward", dout, q, k, v, out, lse, softcap, values)


def flash_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    causal: bool,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences: ``q [T, H, D]``, ``k, v [Tk, H_kv, D]``, ``cu_q`` / ``cu_k`` int32 ``[n + 1]`` ->
    ``out [T, H, D]``, ``lse [H, T]`` fp32."""
    values = dict(
        q=q, k=k, v=v, softmax_scale=scale, causal=causal, **_varlen_values(cu_q, cu_k, max_q, max_k)
    )
    return _forward("varlen_forward", (q.shape[1], q.shape[0]), softcap, values)


def flash_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    causal: bool,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of packed sequences given the FINAL ``out [T, H, D]`` / ``lse [H, T]`` of the rows."""
    values = dict(softmax_scale=scale, causal=causal, **_varlen_values(cu_q, cu_k, max_q, max_k))
    return _backward("varlen_backward", dout, q, k, v, out, lse, softcap, values)


def has_varlen() -> bool:
    """Whether the installed flash-attn has the varlen pair."""
    api = flash_api()
    return not isinstance(api, str) and api.varlen_forward is not None and api.varlen_backward is not None


# ----------------------------------------------------------------------------------------------
# the flash_attn kernel: flash-attn's own functions; blocks it cannot take (explicit masks, rectangular
# causal, head dims other than multiples of 8 up to 256) go to a fallback kernel, cuda_sdpa in the
# registry (the torch kernel when a softcap is set)


def _flash_takes(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> bool:
    """Whether a block runs on flash-attn: no mask, square if causal (flash-attn aligns causal
    bottom-right, the engine top-left), D % 8 == 0 and D <= 256."""
    d = q.shape[-1]
    return mask is None and (not causal or q.shape[1] == k.shape[1]) and d % 8 == 0 and d <= 256


def _other(
    fallback: AttentionKernel, capped: AttentionKernel, softcap: float | None, alibi: Any = None
) -> AttentionKernel:
    """The kernel of a block flash-attn does not take: ``fallback`` unless it cannot apply the softcap or
    ALiBi asked for, then ``capped``."""
    takes = (softcap is None or fallback.softcap) and (alibi is None or fallback.alibi)
    return fallback if takes else capped


def _flash_forward(q, k, v, scale, mask, causal, softcap=None, *, fallback, capped, alibi=None):
    if alibi is None and _flash_takes(q, k, mask, causal):
        return flash_forward(q, k, v, scale, causal, softcap)
    kernel, bias = _other(fallback, capped, softcap, alibi), {} if alibi is None else {"alibi": alibi}
    return kernel.forward(q, k, v, scale, mask, causal, softcap, **bias)


def _flash_backward(
    dout, q, k, v, out, lse, scale, mask, causal, softcap=None, *, fallback, capped, alibi=None
):
    if alibi is None and _flash_takes(q, k, mask, causal):
        return flash_backward(dout, q, k, v, out, lse, scale, causal, softcap)
    kernel, bias = _other(fallback, capped, softcap, alibi), {} if alibi is None else {"alibi": alibi}
    return kernel.backward(dout, q, k, v, out, lse, scale, mask, causal, softcap, **bias)


def _flash_head_dim(q: torch.Tensor) -> bool:
    d = q.shape[-1]
    return d % 8 == 0 and d <= 256


def _flash_varlen_takes(q: torch.Tensor) -> bool:
    return has_varlen() and _flash_head_dim(q)


def _flash_band_forward(q, k, v, scale, band, softcap):
    return flash_forward(q, k, v, scale, False, softcap, window=band)


def _flash_band_backward(dout, q, k, v, out, lse, scale, band, softcap):
    return flash_backward(dout, q, k, v, out, lse, scale, False, softcap, window=band)


def flash_attn_kernel(
    fallback: AttentionKernel,
    capped: AttentionKernel,
    unavailable: Callable[[torch.device, torch.dtype], str | None] = flash_unavailable,
) -> AttentionKernel:
    """The ``flash_attn`` kernel with ``fallback`` for the blocks flash-attn cannot take (``capped`` for
    those with a softcap or ALiBi when ``fallback`` cannot apply it); every ALiBi block goes to them.
    Tests build it with CPU kernels and the CPU stand-in of flash-attn."""
    extra = dict(fallback=fallback, capped=capped)
    return AttentionKernel(
        name="flash_attn",
        forward=functools.partial(_flash_forward, **extra),
        backward=functools.partial(_flash_backward, **extra),
        unavailable=unavailable,
        softcap=True,
        varlen=Varlen(flash_varlen_forward, flash_varlen_backward, _flash_varlen_takes),
        band=Band(_flash_band_forward, _flash_band_backward, _flash_head_dim),
        summary="flash-attn's block functions, CUDA",
        alibi=fallback.alibi or capped.alibi,
    )
