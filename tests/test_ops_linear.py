"""Chunked linear attention (ds_seqpar.ops.linear) vs the token-by-token recurrence.

Every decay kind (none, scalar per head, per-token gate) runs the same cases: outputs, final state
and the gradients of q, k, v, the decay and the initial state; chunk sizes that divide S, do not,
equal it or exceed it; and the All-Scan split into P contiguous pieces (local scan + entering state
+ advance). Tolerances (max abs error vs the fp64 reference): fp64 1e-10, fp32 1e-4 (relative to
the largest output), bf16/fp16 inputs 5e-2 relative.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from ds_seqpar.ops import linear
from ds_seqpar.ops.linear import (
    LocalScan,
    advance_state,
    chunk_linear_attention,
    entering_state_output,
    linear_attention_reference,
    local_scan,
)
from tests.helpers.fla import backward_refused, use_stand_in

B, H, DK, DV = 2, 3, 4, 5
KINDS = ["none", "scalar", "gate"]
TOL64 = 1e-10


# ----------------------------------------------------------------------------------------------
# cases


@dataclass
class Case:
    """Leaf inputs of one problem, plus random upstream gradients for ``out`` and the final state."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    log_decay: torch.Tensor | None
    initial_state: torch.Tensor | None
    dout: torch.Tensor
    dstate: torch.Tensor

    def leaves(self) -> dict[str, torch.Tensor]:
        named = {"q": self.q, "k": self.k, "v": self.v}
        if self.log_decay is not None:
            named["log_decay"] = self.log_decay
        if self.initial_state is not None:
            named["initial_state"] = self.initial_state
        return named

    def fresh(self, dtype: torch.dtype = torch.float64) -> Case:
        """A copy with new leaves (``q, k, v`` in ``dtype``) that require grad."""

        def leaf(x: torch.Tensor | None, dt: torch.dtype = torch.float64) -> torch.Tensor | None:
            return None if x is None else x.detach().to(dt).requires_grad_()

        return Case(
            leaf(self.q, dtype),
            leaf(self.k, dtype),
            leaf(self.v, dtype),
            leaf(self.log_decay),
            leaf(self.initial_state),
            self.dout,
            self.dstate,
        )


def _case(kind: str, s: int, *, init: bool = True, seed: int = 0, strength: float = 1.0) -> Case:
    """Random fp64 case; log decays in [-strength, 0) scaled so ``strength=1`` means mild decay."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    log_decay = None
    if kind == "scalar":
        log_decay = -strength * (0.05 + 0.5 * torch.rand(H, generator=gen, dtype=torch.float64))
    elif kind == "gate":
        log_decay = -strength * (0.02 + 0.6 * torch.rand(B, s, H, DK, generator=gen, dtype=torch.float64))
    return Case(
        q=randn(B, s, H, DK),
        k=randn(B, s, H, DK),
        v=randn(B, s, H, DV),
        log_decay=log_decay,
        initial_state=randn(B, H, DK, DV) if init else None,
        dout=randn(B, s, H, DV),
        dstate=randn(B, H, DK, DV),
    )


Run = Callable[[Case], tuple[torch.Tensor, torch.Tensor]]


def _forward_backward(case: Case, run: Run) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(out, state, grads)`` of ``run`` on fresh leaves, loss = <out, dout> + <state, dstate>."""
    c = case.fresh()
    out, state = run(c)
    loss = (out * c.dout).sum() + (state * c.dstate).sum()
    loss.backward()
    return out.detach(), state.detach(), {name: x.grad for name, x in c.leaves().items()}


def _reference(c: Case) -> tuple[torch.Tensor, torch.Tensor]:
    return linear_attention_reference(c.q, c.k, c.v, c.log_decay, c.initial_state)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _assert_same(got: Case, want: Case, run_got: Run, run_want: Run, tol: float) -> None:
    out, state, grads = _forward_backward(got, run_got)
    out_ref, state_ref, grads_ref = _forward_backward(want, run_want)
    assert _max_err(out, out_ref) <= tol
    assert _max_err(state, state_ref) <= tol
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads.items():
        assert _max_err(grad, grads_ref[name]) <= tol, name


# ----------------------------------------------------------------------------------------------
# chunked vs reference


@pytest.mark.parametrize("init", [False, True], ids=["zero_init", "init"])
@pytest.mark.parametrize("chunk_size", [1, 4, 5, 13, 64])
@pytest.mark.parametrize("kind", KINDS)
def test_chunk_matches_reference(kind: str, chunk_size: int, init: bool) -> None:
    """S = 13: chunk sizes that divide it (1, 13), do not (4, 5) and exceed it (64)."""
    case = _case(kind, 13, init=init)

    def chunked(c: Case) -> tuple[torch.Tensor, torch.Tensor]:
        return chunk_linear_attention(c.q, c.k, c.v, c.log_decay, c.initial_state, chunk_size)

    _assert_same(case, case, chunked, _reference, TOL64)


@pytest.mark.parametrize("s", [1, 70])
@pytest.mark.parametrize("kind", KINDS)
def test_chunk_default_size_edges(kind: str, s: int) -> None:
    """S = 1 and S = 70 (one full default chunk of 64 plus a tail of 6)."""
    case = _case(kind, s, seed=1)

    def chunked(c: Case) -> tuple[torch.Tensor, torch.Tensor]:
        return chunk_linear_attention(c.q, c.k, c.v, c.log_decay, c.initial_state)

    _assert_same(case, case, chunked, _reference, TOL64)


@pytest.mark.parametrize("kind", ["scalar", "gate"])
def test_strong_decay_is_finite(kind: str) -> None:
    """Log decays down to -124 per token (chunk sums near -2000): no exp overflow, no NaN gradients, still exact."""
    case = _case(kind, 40, strength=200.0, seed=2)

    def chunked(c: Case) -> tuple[torch.Tensor, torch.Tensor]:
        return chunk_linear_attention(c.q, c.k, c.v, c.log_decay, c.initial_state, 16)

    out, state, grads = _forward_backward(case, chunked)
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    assert all(torch.isfinite(g).all() for g in grads.values())
    _assert_same(case, case, chunked, _reference, TOL64)


def test_scale_multiplies_q() -> None:
    case = _case("gate", 9, seed=3)

    def chunked(c: Case) -> tuple[torch.Tensor, torch.Tensor]:
        return chunk_linear_attention(c.q, c.k, c.v, c.log_decay, c.initial_state, 4, scale=0.5)

    def scaled_q(c: Case) -> tuple[torch.Tensor, torch.Tensor]:
        return linear_attention_reference(c.q * 0.5, c.k, c.v, c.log_decay, c.initial_state)

    out, _ = chunked(case)
    out_plain, _ = chunk_linear_attention(case.q, case.k, case.v, case.log_decay, case.initial_state, 4)
    assert _max_err(out, out_plain) > 1e-3
    _assert_same(case, case, chunked, scaled_q, TOL64)


@pytest.mark.parametrize("kind", KINDS)
def test_empty_sequence(kind: str) -> None:
    case = _case(kind, 0)
    for out, state in (
        chunk_linear_attention(case.q, case.k, case.v, case.log_decay, case.initial_state, 4),
        _reference(case),
    ):
        assert out.shape == (B, 0, H, DV)
        assert torch.equal(state, case.initial_state)
    local = local_scan(case.q, case.k, case.v, case.log_decay)
    assert torch.equal(local.state, torch.zeros(B, H, DK, DV, dtype=torch.float64))
    assert torch.equal(local.total_log_decay, torch.zeros(B, H, DK, dtype=torch.float64))


# ----------------------------------------------------------------------------------------------
# All-Scan decomposition


def _pieces(s: int, p: int) -> list[tuple[int, int]]:
    """``p`` contiguous, uneven, non-empty pieces of ``range(s)``."""
    cuts = sorted(random.Random(p).sample(range(1, s), p - 1))
    bounds = [0, *cuts, s]
    return list(itertools.pairwise(bounds))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_decomposition_matches_reference(kind: str, p: int) -> None:
    """Chain local scans through advance_state, add the entering-state term: the single-sequence result."""
    case = _case(kind, 19, seed=4)

    def split(c: Case) -> tuple[torch.Tensor, torch.Tensor]:
        state = c.initial_state
        outs = []
        for lo, hi in _pieces(19, p):
            gate = c.log_decay if kind != "gate" else c.log_decay[:, lo:hi]
            q = c.q[:, lo:hi]
            local = local_scan(q, c.k[:, lo:hi], c.v[:, lo:hi], gate, chunk_size=4)
            outs.append(local.out + entering_state_output(q, local.cum_log_decay, state))
            state = advance_state(state, local.total_log_decay, local.state)
        return torch.cat(outs, dim=1), state

    _assert_same(case, case, split, _reference, TOL64)


@pytest.mark.parametrize("kind", KINDS)
def test_local_scan_fields(kind: str) -> None:
    case = _case(kind, 11, seed=5)
    local = local_scan(case.q, case.k, case.v, case.log_decay, chunk_size=3)
    assert isinstance(local, LocalScan)
    assert local.out.shape == (B, 11, H, DV)
    assert local.state.shape == (B, H, DK, DV)
    assert local.total_log_decay.shape == (B, H, DK)
    assert local.cum_log_decay.shape == (B, 11, H, DK)
    out_ref, state_ref = linear_attention_reference(case.q, case.k, case.v, case.log_decay)
    assert _max_err(local.out, out_ref) <= TOL64
    assert _max_err(local.state, state_ref) <= TOL64
    assert torch.equal(local.total_log_decay, local.cum_log_decay[:, -1])
    if kind == "none":
        assert not local.cum_log_decay.any()
    else:
        assert (local.cum_log_decay < 0).all()


# ----------------------------------------------------------------------------------------------
# gradcheck of the reference (and of the chunked form) on a tiny problem


@pytest.mark.parametrize("fn", ["reference", "chunk"])
@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck(kind: str, fn: str) -> None:
    gen = torch.Generator().manual_seed(6)
    b, s, h, dk, dv = 1, 4, 2, 2, 3

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    inputs = [rand(b, s, h, dk), rand(b, s, h, dk), rand(b, s, h, dv), rand(b, h, dk, dv)]
    if kind == "scalar":
        inputs.append((-0.3 - 0.2 * torch.rand(h, generator=gen, dtype=torch.float64)).requires_grad_())
    elif kind == "gate":
        gate = -0.1 - 0.5 * torch.rand(b, s, h, dk, generator=gen, dtype=torch.float64)
        inputs.append(gate.requires_grad_())

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, init: torch.Tensor, *decay: torch.Tensor):
        log_decay = decay[0] if decay else None
        if fn == "reference":
            return linear_attention_reference(q, k, v, log_decay, init)
        return chunk_linear_attention(q, k, v, log_decay, init, chunk_size=3)

    assert torch.autograd.gradcheck(run, tuple(inputs))


# ----------------------------------------------------------------------------------------------
# low precision


@pytest.mark.parametrize("kind", KINDS)
def test_float32_close_to_float64(kind: str) -> None:
    case = _case(kind, 48, seed=7)
    out64, state64 = _reference(case)
    c32 = case.fresh(torch.float32)
    for out, state in (
        chunk_linear_attention(c32.q, c32.k, c32.v, c32.log_decay, c32.initial_state, 16),
        _reference(c32),
    ):
        assert out.dtype == torch.float32 and state.dtype == torch.float32
        scale = max(1.0, out64.abs().max().item())
        assert _max_err(out, out64) <= 1e-4 * scale
        assert _max_err(state, state64) <= 1e-4 * max(1.0, state64.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_half_inputs_accumulate_in_float32(kind: str, dtype: torch.dtype) -> None:
    case = _case(kind, 20, seed=8)
    c = case.fresh(dtype)
    out, state = chunk_linear_attention(c.q, c.k, c.v, c.log_decay, c.initial_state, 8)
    assert out.dtype == dtype and state.dtype == torch.float32
    (out.float() * c.dout).sum().backward()
    assert c.q.grad.dtype == dtype and torch.isfinite(c.q.grad.float()).all()
    # Compare against the fp64 reference on the same (rounded) inputs.
    rounded = Case(*(None if x is None else x.detach().double() for x in vars(c).values()))
    out_ref, state_ref = _reference(rounded)
    assert _max_err(out, out_ref) <= 5e-2 * out_ref.abs().max().item()
    assert _max_err(state, state_ref) <= 1e-5 * state_ref.abs().max().item()
    local = local_scan(c.q, c.k, c.v, c.log_decay, chunk_size=8)
    assert local.out.dtype == torch.float32 and local.state.dtype == torch.float32


# ----------------------------------------------------------------------------------------------
# validation


def _valid(s: int = 7) -> Case:
    return _case("gate", s)


def _bad_decay_entry(value: float) -> torch.Tensor:
    log_decay = torch.full((H,), -0.5, dtype=torch.float64)
    log_decay[1] = value
    return log_decay


INVALID = {
    "q_3d": (lambda c: chunk_linear_attention(c.q[0], c.k, c.v), r"q must be 4-D .* got shape \(7, 3, 4\)"),
    "k_shape": (
        lambda c: chunk_linear_attention(c.q, c.k[..., :3], c.v),
        r"k shape \(2, 7, 3, 3\) must equal q shape \(2, 7, 3, 4\)",
    ),
    "v_len": (
        lambda c: linear_attention_reference(c.q, c.k, c.v[:, :5]),
        r"v shape \(2, 5, 3, 5\) must match q in \[B, S, H\] = \(2, 7, 3\)",
    ),
    "dtype_mismatch": (
        lambda c: chunk_linear_attention(c.q, c.k.float(), c.v),
        r"dtypes must match, got torch.float64, torch.float32, torch.float64",
    ),
    "int_inputs": (
        lambda c: chunk_linear_attention(c.q.long(), c.k.long(), c.v.long()),
        r"q must be a floating-point tensor, got dtype torch.int64",
    ),
    "device_mismatch": (
        lambda c: chunk_linear_attention(c.q, c.k.to("meta"), c.v),
        r"one device, got cpu, meta, cpu",
    ),
    "positive_decay": (
        lambda c: chunk_linear_attention(c.q, c.k, c.v, _bad_decay_entry(0.25)),
        r"log_decay must be finite and <= 0 .* got an entry 0\.25",
    ),
    "infinite_decay": (
        lambda c: linear_attention_reference(c.q, c.k, c.v, _bad_decay_entry(float("-inf"))),
        r"got an entry -inf",
    ),
    "gate_shape": (
        lambda c: chunk_linear_attention(c.q, c.k, c.v, c.log_decay[..., :2]),
        r"log_decay shape \(2, 7, 3, 2\) must be \[H\] = \(3,\) .* or \[B, S, H, d_k\] = \(2, 7, 3, 4\)",
    ),
    "decay_device": (
        lambda c: local_scan(c.q, c.k, c.v, c.log_decay.to("meta")),
        r"log_decay is on meta but q is on cpu",
    ),
    "chunk_size_zero": (
        lambda c: chunk_linear_attention(c.q, c.k, c.v, chunk_size=0),
        r"chunk_size must be an int >= 1, got 0",
    ),
    "chunk_size_float": (
        lambda c: local_scan(c.q, c.k, c.v, chunk_size=2.5),
        r"chunk_size must be an int >= 1, got 2\.5",
    ),
    "initial_state_shape": (
        lambda c: chunk_linear_attention(c.q, c.k, c.v, None, c.initial_state[..., :4]),
        r"initial_state shape \(2, 3, 4, 4\) must be \(2, 3, 4, 5\)",
    ),
    "cum_log_decay_shape": (
        lambda c: entering_state_output(c.q, c.log_decay[:, :6], c.initial_state),
        r"cum_log_decay shape \(2, 6, 3, 4\) must be \(2, 7, 3, 4\)",
    ),
    "total_log_decay_shape": (
        lambda c: advance_state(c.initial_state, c.log_decay[:, 0, :2], c.initial_state),
        r"total_log_decay shape \(2, 2, 4\) must be \(2, 3, 4\)",
    ),
}


@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_inputs_raise(name: str) -> None:
    call, match = INVALID[name]
    with pytest.raises(ValueError, match=match):
        call(_valid())


# ---- the optional fused (flash-linear-attention) path: plumbing checked with stand-in kernels on CPU


def _fake_fla(wrong: bool = False):
    """A stand-in with fla's calling convention ([B, S, H, d], g 4th, keyword scale / states)."""
    calls = []

    def kernel(q, k, v, g, scale=None, initial_state=None, output_final_state=False, head_first=True):
        assert head_first is False  # ds_seqpar asks for the [B, S, H, d] layout explicitly
        calls.append(g is None or g.dim())
        log_decay = None if g is None else (g if g.dim() == 4 else g[0, 0])
        out, state = linear.chunk_linear_attention(q, k, v, log_decay, scale=scale)
        return (out * 0 if wrong else out), state

    return kernel, calls


@pytest.mark.parametrize("decay", ["none", "scalar", "gate"])
def test_fused_path_is_used_when_it_agrees(monkeypatch, decay):
    kernel, calls = _fake_fla()
    use_stand_in(monkeypatch, kernel)
    q, k, v = (torch.randn(2, 37, 3, 8, dtype=torch.float64) for _ in range(3))
    log_decay = {
        "none": None,
        "scalar": -torch.rand(3, dtype=torch.float64),
        "gate": -torch.rand(2, 37, 3, 8, dtype=torch.float64),
    }[decay]
    monkeypatch.setenv("DS_SEQPAR_NO_FLA", "1")
    ref = linear.local_scan(q, k, v, log_decay, 8, scale=0.5)
    assert not calls  # switched off by the environment variable
    monkeypatch.delenv("DS_SEQPAR_NO_FLA")
    got = linear.local_scan(q, k, v, log_decay, 8, scale=0.5)
    assert len(calls) == 2  # the one-time check, then the piece
    assert (got.out - ref.out).abs().max() <= 1e-10 and (got.state - ref.state).abs().max() <= 1e-10


def test_fused_path_that_disagrees_is_refused_with_a_warning(monkeypatch):
    kernel, calls = _fake_fla(wrong=True)
    use_stand_in(monkeypatch, kernel)
    q, k, v = (torch.randn(1, 20, 2, 4) for _ in range(3))
    with pytest.warns(UserWarning, match="disagrees with ds_seqpar"):
        got = linear.local_scan(q, k, v, None, 8)
    ref, _ = linear.chunk_linear_attention(q, k, v)
    assert (got.out - ref).abs().max() <= 1e-5  # PyTorch result, not the stand-in's zeros
    linear.local_scan(q, k, v, None, 8)
    assert len(calls) == 1  # checked once, then never called again


def test_fused_path_whose_backward_fails_is_refused_at_first_use(monkeypatch):
    """The first-use check runs the backward too (even under no_grad): fla raising there, as it does on
    Hopper with Triton 3.6, means PyTorch serves, not a crash in the first training step."""
    kernel, calls = _fake_fla()
    use_stand_in(monkeypatch, backward_refused(kernel))
    q, k, v = (torch.randn(1, 20, 2, 4, requires_grad=True) for _ in range(3))
    with pytest.warns(UserWarning, match="RuntimeError: Triton >= 3.4.0"), torch.no_grad():
        linear.local_scan(q, k, v, None, 8)
    got = linear.local_scan(q, k, v, None, 8)
    torch.autograd.grad(got.out.sum(), [q, k, v])  # PyTorch's backward
    assert len(calls) == 1  # the check only


def test_first_use_check_under_no_grad_accepts_a_good_kernel(monkeypatch):
    kernel, calls = _fake_fla()
    use_stand_in(monkeypatch, kernel)
    q, k, v = (torch.randn(1, 20, 2, 4) for _ in range(3))
    with torch.inference_mode():
        linear.local_scan(q, k, v, None, 8)
    assert len(calls) == 2  # the check (with its backward) passed, then the piece ran fused
