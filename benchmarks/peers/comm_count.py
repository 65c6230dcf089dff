"""Bytes a peer system sends, counted by wrapping torch.distributed's collective and p2p functions.

A peer (xfuser here) calls torch's communication functions itself, so ds_seqpar's ``CommStats`` never sees
them; :func:`install` replaces these module attributes for the rest of the process (before the peer is
imported, so ``from torch.distributed import x`` in the peer also gets the wrapper):

* ``torch.distributed`` (and ``distributed_c10d``): ``all_reduce``, ``all_gather``, ``all_gather_into_tensor``, ``all_gather_single``, ``reduce_scatter_single``,
  ``reduce_scatter``, ``reduce_scatter_tensor``, ``all_to_all``, ``all_to_all_single``, ``broadcast``,
  ``send``, ``isend``, ``recv``, ``irecv``, ``batch_isend_irecv``;
* ``torch.distributed._functional_collectives``: ``all_reduce``, ``all_gather_tensor``, ``all_gather_single``,
  ``reduce_scatter_tensor``, ``all_to_all_single``, ``broadcast``, ``permute_tensor``.

Convention (that of ``ds_seqpar.comm.stats``): the bytes THIS rank sends. all-to-all: its input less the
chunk it keeps; all-gather: its shard x (n - 1); reduce-scatter: its input x (n - 1) / n; all-reduce: its
tensor x 2 (n - 1) / n (a ring all-reduce); broadcast: the tensor x (n - 1) on the source, 0 elsewhere;
send / isend: the payload; recv / irecv: 0; permute_tensor: the tensor (one peer). A call made inside
another counted call (``permute_tensor`` -> ``all_to_all_single``, ``batch_isend_irecv`` -> ``isend``) is
counted once, by the outer one. Calls within a group of size 1 send nothing.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as ft_c
import torch.distributed.distributed_c10d as c10d

COUNTS: dict[str, list[int]] = {}  # "module.fn" -> [bytes, calls]
_DEPTH = threading.local()
_INSTALLED: list[bool] = [False]


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _n(a: dict) -> int:
    """Size of the call's group (c10d ``group`` or funcol ``group``)."""
    group = a.get("group")
    return dist.get_world_size(group) if isinstance(group, (dist.ProcessGroup, type(None))) else _fsize(group)


def _fsize(group: Any) -> int:
    return ft_c._expand_group(group)[2]


def _me(a: dict) -> int | None:
    group = a.get("group")
    return dist.get_rank(group) if isinstance(group, (dist.ProcessGroup, type(None))) else None


def _a2a_single(t: torch.Tensor, a: dict) -> int:
    """Input rows less the rows this rank keeps (``input_split_sizes[me]`` or rows / n)."""
    n, me, splits = _n(a), _me(a), a.get("input_split_sizes")
    if n == 1:
        return 0
    rows = t.shape[0]
    kept = splits[me] if (splits and me is not None) else rows // n
    return (rows - kept) * (t.numel() // max(rows, 1)) * t.element_size()


def _is_src(a: dict) -> bool:
    if a.get("group_src") is not None:
        return dist.get_rank(a.get("group")) == a["group_src"]
    return dist.get_rank() == a.get("src")  # c10d and funcol name the source by global rank


def _isend_ops(ops: list) -> int:
    sends = {c10d.isend, _ORIG.get("isend")}
    return sum(_nbytes(op.tensor) for op in ops if op.op in sends)


_ORIG: dict[str, Callable] = {}
C10D_RULES: dict[str, Callable[[dict], int]] = {
    "all_reduce": lambda a: 2 * _nbytes(a["tensor"]) * (_n(a) - 1) // _n(a),
    "all_gather": lambda a: _nbytes(a["tensor"]) * (_n(a) - 1),
    "all_gather_into_tensor": lambda a: _nbytes(a["input_tensor"]) * (_n(a) - 1),
    "all_gather_single": lambda a: _nbytes(a["input_tensor"]) * (_n(a) - 1),  # torch >= 2.13's name
    "reduce_scatter": lambda a: _nbytes(a["input_list"]) * (_n(a) - 1) // _n(a),
    "reduce_scatter_tensor": lambda a: _nbytes(a["input"]) * (_n(a) - 1) // _n(a),
    "reduce_scatter_single": lambda a: _nbytes(a["input"]) * (_n(a) - 1) // _n(a),
    "all_to_all": lambda a: _nbytes(a["input_tensor_list"]) - _nbytes(a["input_tensor_list"][_me(a)]),
    "all_to_all_single": lambda a: _a2a_single(a["input"], a),
    "broadcast": lambda a: _nbytes(a["tensor"]) * (_n(a) - 1) if _is_src(a) else 0,
    "send": lambda a: _nbytes(a["tensor"]),
    "isend": lambda a: _nbytes(a["tensor"]),
    "recv": lambda a: 0,
    "irecv": lambda a: 0,
    "batch_isend_irecv": lambda a: _isend_ops(a["p2p_op_list"]),
}
FUNCOL_RULES: dict[str, Callable[[dict], int]] = {
    "all_reduce": lambda a: 2 * _nbytes(a["self"]) * (_n(a) - 1) // _n(a),
    "all_gather_tensor": lambda a: _nbytes(a["self"]) * (_n(a) - 1),
    "all_gather_single": lambda a: _nbytes(a["self"]) * (_n(a) - 1),
    "reduce_scatter_tensor": lambda a: _nbytes(a["self"]) * (_n(a) - 1) // _n(a),
    "all_to_all_single": lambda a: _a2a_single(a["self"], a),
    "broadcast": lambda a: _nbytes(a["self"]) * (_n(a) - 1) if _is_src(a) else 0,
    "permute_tensor": lambda a: _nbytes(a["self"]) if _n(a) > 1 else 0,
}


def _wrap(key: str, fn: Callable, rule: Callable[[dict], int]) -> Callable:
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_DEPTH, "n", 0)
        if depth == 0:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            entry = COUNTS.setdefault(key, [0, 0])
            entry[0] += int(rule(bound.arguments))
            entry[1] += 1
        _DEPTH.n = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _DEPTH.n = depth

    counted.__wrapped_for_count__ = True
    return counted


def install() -> None:
    """Replace the functions named in the module docstring by counting wrappers (idempotent)."""
    if _INSTALLED[0]:
        return
    for name, rule in C10D_RULES.items():
        fn = getattr(c10d, name, None) or getattr(dist, name, None)
        if fn is None:  # a name this torch does not have
            continue
        _ORIG[name] = fn
        wrapped = _wrap(f"dist.{name}", fn, rule)
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)
    for name, rule in FUNCOL_RULES.items():
        setattr(ft_c, name, _wrap(f"funcol.{name}", getattr(ft_c, name), rule))
    _INSTALLED[0] = True


def snapshot() -> dict[str, list[int]]:
    """A copy of the running ``{call: [bytes sent, calls]}`` totals of this rank."""
    return {k: list(v) for k, v in COUNTS.items()}


def delta(before: dict[str, list[int]]) -> dict[str, list[int]]:
    """What was counted since ``before`` (a :func:`snapshot`)."""
    out = {}
    for key, (nbytes, calls) in COUNTS.items():
        b0, c0 = before.get(key, [0, 0])
        if calls > c0:
            out[key] = [nbytes - b0, calls - c0]
    return out
