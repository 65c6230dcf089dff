"""A diffusers attention processor's own code, with its attention call served by ds_seqpar (docs/dit.md).

``SeqParAttnProcessor(inner, site, runtime, name)`` runs the model's processor (projections, q/k norms, RoPE,
output projection: the family's own code) and swaps, for the duration of the call only, the one function
through which that processor computes attention (``ATTENTION_RULES``: PyTorch's SDPA reached as
``F.scaled_dot_product_attention`` in the processor's module, or diffusers' ``dispatch_attention_fn``) for
the runtime's attention over the SP group. Cross-attention to a stream that is not split (PixArt's prompt)
keeps the model's own call: its keys are whole on every rank and its queries are this rank's tokens.
A mask, dropout or ``is_causal`` reaching a sharded attention is refused by name.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as torch_functional

from ds_seqpar.integrations.hf_model import UnsupportedModelError

__all__ = [
    "ATTENTION_RULES",
    "AttentionCall",
    "AttentionSite",
    "SeqParAttnProcessor",
    "register_dit_attention",
]


@dataclass(frozen=True)
class AttentionSite:
    """How a processor class computes attention.

    name: the global of the processor's module that it calls (``"F"``: ``F.scaled_dot_product_attention`` with
        q/k/v ``[B, H, S, D]``; ``"dispatch_attention_fn"``: diffusers' dispatcher with ``[B, S, H, D]``).
    joint: a call with ``encoder_hidden_states`` concatenates those tokens with the image tokens (MM-DiT);
        False: such a call is cross-attention to them.
    """

    name: str
    joint: bool


ATTENTION_RULES: dict[str, AttentionSite] = {}


def register_dit_attention(processor_class: str, site: AttentionSite) -> None:
    """Serve processors of class ``processor_class`` through ``site`` (``ds_seqpar.register_dit_attention``)."""
    if site.name not in _SWAPS:
        raise ValueError(f"AttentionSite.name={site.name!r} is not one of {sorted(_SWAPS)}")
    ATTENTION_RULES[processor_class] = site


@dataclass
class AttentionCall:
    """One sharded attention: q ``[B, n, H, D]``, k/v ``[B, n, H_kv, D]`` (this rank's tokens of the joint
    sequence ``order``), the softmax scale, the processor's module ``name``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float | None
    order: tuple[str, ...]
    name: str


class _FunctionalWithSdpa:
    """``torch.nn.functional`` with ``scaled_dot_product_attention`` replaced (one processor call long)."""

    def __init__(self, sdpa: Callable[..., torch.Tensor]) -> None:
        self.scaled_dot_product_attention = sdpa

    def __getattr__(self, item: str) -> Any:
        return getattr(torch_functional, item)


def _check_plain(name: str, attn_mask: Any, dropout_p: float, is_causal: bool) -> None:
    if attn_mask is not None:
        raise UnsupportedModelError(
            f"{name}: an attention mask reaches a sequence-parallel attention; ds_seqpar shards only unmasked "
            "image / joint attention (pad the prompt instead of masking it, or run this model without SP)"
        )
    if dropout_p:
        raise UnsupportedModelError(
            f"{name}: attention dropout_p={dropout_p} is not applied under SP; set the model's attention dropout to 0"
        )
    if is_causal:
        raise UnsupportedModelError(
            f"{name}: is_causal=True in a diffusion transformer's attention is not supported"
        )


def _sdpa_swap(
    serve: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float | None], torch.Tensor], name: str
):
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        _check_plain(name, attn_mask, dropout_p, is_causal)
        out = serve(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale)
        return out.transpose(1, 2)

    return _FunctionalWithSdpa(sdpa)


def _dispatch_swap(serve: Callable[..., torch.Tensor], name: str):
    def dispatch(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):  # fmt: skip
        _check_plain(name, attn_mask, dropout_p, is_causal)
        if parallel_config is not None:
            raise UnsupportedModelError(
                f"{name}: diffusers' own context parallelism is enabled on this model; use either it or ds_seqpar"
            )
        return serve(query, key, value, scale)

    return dispatch


_SWAPS = {"F": _sdpa_swap, "dispatch_attention_fn": _dispatch_swap}


class SeqParAttnProcessor:
    """Wraps a diffusers attention processor; see the module docstring. ``runtime.attend(AttentionCall)`` and
    ``runtime.token_order(hidden_len, joint)`` are the runtime's (``hooks.DitParallel``)."""

    def __init__(self, inner: Any, site: AttentionSite, runtime: Any, name: str) -> None:
        self.inner, self.site, self.runtime, self.name = inner, site, runtime, name
        self._signature = inspect.signature(inner.__call__)

        # diffusers filters the keywords it passes by the processor's signature: show the inner one
        def shown(*args: Any, **kwargs: Any) -> Any:
            return self._call(*args, **kwargs)

        shown.__signature__ = self._signature  # type: ignore[attr-defined]
        self.__call__ = shown

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def _call(self, attn: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        bound = self._signature.bind(attn, hidden_states, *args, **kwargs).arguments
        encoder = bound.get("encoder_hidden_states")
        if encoder is not None and not self.site.joint:
            return self.inner(attn, hidden_states, *args, **kwargs)  # cross-attention to a whole stream
        length = hidden_states.shape[1] + (0 if encoder is None else encoder.shape[1])
        order = self.runtime.token_order(self.name, length, encoder is not None)
        with self._swapped(order):
            return self.inner(attn, hidden_states, *args, **kwargs)

    @contextlib.contextmanager
    def _swapped(self, order: tuple[str, ...]) -> Iterator[None]:
        module = sys.modules[type(self.inner).__module__]
        if not hasattr(module, self.site.name):
            raise UnsupportedModelError(
                f"{self.name}: {type(self.inner).__name__} does not call {self.site.name} in {module.__name__}; "
                "its ATTENTION_RULES entry does not match this diffusers version"
            )

        def serve(q, k, v, scale):
            return self.runtime.attend(AttentionCall(q, k, v, scale, order, self.name))

        original = getattr(module, self.site.name)
        setattr(module, self.site.name, _SWAPS[self.site.name](serve, self.name))
        try:
            yield
        finally:
            setattr(module, self.site.name, original)


ATTENTION_RULES["AttnProcessor2_0"] = AttentionSite("F", joint=False)
ATTENTION_RULES["JointAttnProcessor2_0"] = AttentionSite("F", joint=True)
ATTENTION_RULES["FluxAttnProcessor"] = AttentionSite("dispatch_attention_fn", joint=True)
