"""The ranks of an SP group agree on their inputs' shapes before a call's first exchange (docs/attention.md
"Shapes across ranks"): one all-gather of ``SLOTS`` int64 per rank (each tensor's shape and dtype, and a
few flags such as the schedule) over the ``sp`` group. Shards that differ between ranks are then named on
every rank (``RankShapeError``), instead of aborting the process inside gloo (the sizes of a P2P or an
all-to-all disagree) or hanging in NCCL.

* :func:`gather_inputs` runs the all-gather on every call: ``cross_attention``, which pads unequal shards
  and decides its schedule from the agreed shapes, so every rank picks the same.
* :func:`check_same_inputs` is for the entries whose shards must be equal (``ds_seqpar.attention``, the
  recurrent scans, the sharded conv): the first call with a new local signature on a mesh runs the
  all-gather, later calls with that signature none (ranks that passed equal shapes have seen the same
  signatures, so they skip together; the steady state costs one set lookup).

Both run after the call's local checks (bad input on every rank still fails before any collective). The
all-gather is metadata (``SLOTS`` · 8 bytes per rank) and is not counted in ``mesh.comm_stats``.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ds_seqpar.errors import SeqParConfigError

__all__ = ["SLOTS", "RankInputs", "RankShapeError", "check_same_inputs", "gather_inputs"]

SLOTS = 48  # ints per rank: caller, counts, then per tensor ndim, dims, dtype; then the flags
MAX_DIMS = 6  # a tensor with more dims is carried as "too many" (its dims are not compared)
DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.complex64, torch.complex128,
)  # fmt: skip
_CODES = {dtype: i + 1 for i, dtype in enumerate(DTYPES)}
_CACHE = "agreed_inputs"  # key of mesh.resources: the signatures already agreed on that mesh


class RankShapeError(SeqParConfigError):
    """The ranks of one SP group passed inputs that disagree; the message lists each rank's."""


@dataclass(frozen=True)
class RankInputs:
    """One rank's inputs as the all-gather carries them: shape per named tensor (None: not passed; ``()``
    with ``ndim`` -2: more than ``MAX_DIMS`` dims), dtype name per tensor, and the call's flags."""

    rank: int
    caller: int
    shapes: tuple[tuple[int, ...] | None, ...]
    dtypes: tuple[str | None, ...]
    flags: tuple[int, ...]

    def describe(self, names: Sequence[str], flag_names: Sequence[str] = ()) -> str:
        """``rank 3: q [1, 8, 4, 8] float32, k ...`` (and ``name=value`` per named flag)."""
        parts = []
        for name, shape, dtype in zip(names, self.shapes, self.dtypes, strict=True):
            parts.append(f"{name} None" if shape is None else f"{name} {list(shape)} {dtype}")
        parts += [f"{name}={value}" for name, value in zip(flag_names, self.flags, strict=False)]
        return f"rank {self.rank}: " + ", ".join(parts)


@functools.cache
def caller_code(caller: str) -> int:
    """The entry's name as a non-negative CRC-32 (the same on every rank, unlike ``hash``)."""
    return zlib.crc32(caller.encode()) & 0x7FFFFFFF


def _dtype_code(dtype: torch.dtype) -> int:
    return _CODES.get(dtype, 0)


def _dtype_name(code: int) -> str:
    return str(DTYPES[code - 1]).removeprefix("torch.") if 0 < code <= len(DTYPES) else "other"


def encode(caller: str, tensors: Sequence[torch.Tensor | None], flags: Sequence[int] = ()) -> list[int]:
    """The ``SLOTS`` ints of this rank's call (the caller's name as a CRC, so different entries differ)."""
    out = [caller_code(caller), len(tensors), len(flags)]
    for t in tensors:
        if t is None:
            out.append(-1)
        elif t.dim() > MAX_DIMS:
            out += [-2, _dtype_code(t.dtype)]
        else:
            out += [t.dim(), *t.shape, _dtype_code(t.dtype)]
    out += [int(f) for f in flags]
    if len(out) > SLOTS:
        raise ValueError(f"{caller}: {len(out)} ints do not fit the shape all-gather's {SLOTS} slots")
    return out + [0] * (SLOTS - len(out))


def decode(values: Sequence[int], rank: int) -> RankInputs:
    """The inverse of :func:`encode` for the ints of global rank ``rank``."""
    caller, count, nflags = values[0], values[1], values[2]
    shapes: list[tuple[int, ...] | None] = []
    dtypes: list[str | None] = []
    i = 3
    for _ in range(count):
        ndim = values[i]
        if ndim == -1:
            shapes.append(None)
            dtypes.append(None)
            i += 1
            continue
        dims = () if ndim < 0 else tuple(values[i + 1 : i + 1 + ndim])
        i += 1 + max(ndim, 0)
        shapes.append(dims)
        dtypes.append(_dtype_name(values[i]))
        i += 1
    return RankInputs(rank, caller, tuple(shapes), tuple(dtypes), tuple(values[i : i + nflags]))


def _device(group: object, hint: torch.device) -> torch.device:
    """Where the all-gather's ints live: CPU for gloo, the current CUDA device for NCCL."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return hint if hint.type == "cuda" else torch.device("cuda", torch.cuda.current_device())


def gather_inputs(
    mesh: object, caller: str, tensors: Sequence[torch.Tensor | None], flags: Sequence[int] = ()
) -> list[RankInputs]:
    """Every ``sp`` rank's inputs, in SP rank order (one all-gather; none when SP = 1)."""
    values = encode(caller, tensors, flags)
    members = mesh.members["sp"]
    if mesh.sp_size == 1:
        return [decode(values, members[0])]
    group = mesh.group("sp")
    hint = next((t.device for t in tensors if t is not None), torch.device("cpu"))
    mine = torch.tensor(values, dtype=torch.int64, device=_device(group, hint))
    parts = [torch.empty_like(mine) for _ in range(mesh.sp_size)]
    dist.all_gather(parts, mine, group=group)
    rows = torch.stack(parts).tolist()
    return [decode(row, rank) for row, rank in zip(rows, members, strict=True)]


def different_callers(ranks: list[RankInputs], caller: str) -> str | None:
    """A message when the ranks are not all in the same entry (their collectives would pair wrongly)."""
    if len({r.caller for r in ranks}) == 1:
        return None
    here = caller_code(caller)
    elsewhere = [r.rank for r in ranks if r.caller != here]
    return (
        f"{caller}: ranks {elsewhere} of the SP group are in a different ds_seqpar call at this point; every "
        "rank of the group must run the same layers in the same order"
    )


def check_same_inputs(
    mesh: object,
    caller: str,
    names: Sequence[str],
    tensors: Sequence[torch.Tensor | None],
    flags: Sequence[int] = (),
    fix: str = "",
    flag_names: Sequence[str] = (),
) -> None:
    """Raise ``RankShapeError`` on every rank unless every ``sp`` rank passed the same shapes, dtypes and
    flags; the all-gather runs only the first time this mesh sees this local signature."""
    if mesh.sp_size == 1:
        return
    signature = tuple(encode(caller, tensors, flags))
    seen = mesh.resources.setdefault(_CACHE, set())
    if signature in seen:
        return
    ranks = gather_inputs(mesh, caller, tensors, flags)
    problem = different_callers(ranks, caller)
    if problem is None and len({(r.shapes, r.dtypes, r.flags) for r in ranks}) > 1:
        listed = "; ".join(r.describe(names, flag_names) for r in ranks)
        problem = f"{caller}: the ranks of the SP group passed different inputs ({listed}); {fix}"
    if problem is not None:
        raise RankShapeError(problem)
    seen.add(signature)
