"""Where the token-locality probe (``hf_model.check_token_locality``) first diverges: the module to name.

The probe runs the decoder on 8 tokens and on their last 4 (with their global position ids) under an
attention in which every token sees only itself. When the 4 outputs differ, the refusal names the FIRST
submodule (in the order calls finish) whose output for those tokens differs: the family's positional or
token-mixing code outside the attention (RoBERTa's position embeddings without a position rule, a
short convolution applied through its weights, a hashed n-gram embedding, a patcher), instead of a
generic "something differs". Outputs ``[..., S, ...]`` are compared on the shard's tokens along the
one dimension where the whole run has twice the shard's length; an output whose shape differs in any
other way (e.g. a number of patches) counts as different.
"""

from __future__ import annotations

from typing import Any

import torch


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, list | tuple):
        return next((t for t in out if isinstance(t, torch.Tensor)), None)
    first = getattr(out, "last_hidden_state", None)
    return first if isinstance(first, torch.Tensor) else None


class ProbeTrace:
    """Forward hooks on every submodule of ``decoder``: per run (``next_run``), the first tensor output of
    each call, keyed by (module name, call index), in the order the calls finish."""

    def __init__(self, decoder: torch.nn.Module) -> None:
        self.modules = dict(decoder.named_modules())
        self.runs: list[dict[tuple[str, int], torch.Tensor]] = []
        self.hooks = [
            m.register_forward_hook(lambda _m, _a, out, name=name: self._record(name, out))
            for name, m in self.modules.items()
            if name
        ]

    def next_run(self) -> None:
        self.runs.append({})

    def _record(self, name: str, out: Any) -> None:
        t = _first_tensor(out)
        if t is None or not self.runs:
            return
        run = self.runs[-1]
        calls = sum(1 for key in run if key[0] == name)
        run[(name, calls)] = t.detach().clone()  # a later in-place update must not change it

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()

    def first_divergence(self, half: int, tol: float) -> tuple[str, torch.nn.Module, str] | None:
        """``(name, module, what)`` of the first call of the whole run (``runs[0]``, the shard's tokens
        from ``half`` on) that the shard run (``runs[1]``) does not reproduce, or None."""
        if len(self.runs) < 2:
            return None
        whole, shard = self.runs[0], self.runs[1]
        for key, w in whole.items():
            s = shard.get(key)
            what = "it is not called on the shard" if s is None else _difference(w, s, half, tol)
            if what:
                return key[0], self.modules[key[0]], what
        return None


def _difference(w: torch.Tensor, s: torch.Tensor, half: int, tol: float) -> str:
    """Empty when ``s`` is ``w``'s part from ``half`` on (relative ``tol``), else what differs."""
    if w.shape == s.shape:
        return ""  # no sequence dimension (or not split): nothing to compare per token
    dims = [
        d
        for d in range(w.dim())
        if w.dim() == s.dim()
        and w.shape[d] == s.shape[d] + half
        and all(w.shape[e] == s.shape[e] for e in range(w.dim()) if e != d)
    ]
    if not dims:
        return (
            f"its output has shape {tuple(w.shape)} on the whole sequence and {tuple(s.shape)} on the shard"
        )
    part = w.narrow(dims[0], half, s.shape[dims[0]])
    if not (part.is_floating_point() or part.is_complex()):
        return "" if torch.equal(part, s) else "its integer output differs"
    err = ((part.double() - s.double()).norm() / part.double().norm().clamp(min=1e-30)).item()
    return "" if err <= tol else f"its output differs by {err:.1e} (relative)"
