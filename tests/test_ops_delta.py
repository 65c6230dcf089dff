"""The gated delta rule in chunk form (``ops/delta/``) and the causal conv1d op (``ops/conv.py``), one process.

The chunk form and the piece decomposition (transition M, offset N, entering-state correction) equal
the token-by-token recurrence in fp64 for every decay kind and chunk size; gradcheck passes through
the chunk form; the conv with a history equals the conv of the joined sequence.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds_seqpar.ops import delta
from ds_seqpar.ops.conv import causal_conv1d
from ds_seqpar.ops.delta import chunk as delta_chunk
from ds_seqpar.ops.delta import (
    chunk_delta_rule,
    delta_piece,
    delta_rule_reference,
    entering_state_output,
    piece_outputs,
    piece_transition,
)
from tests.helpers.fla import backward_refused, use_stand_in

B, H, DK, DV = 2, 3, 5, 4


def _inputs(seq_len: int, decay: str, seed: int = 0, requires_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    q = torch.randn(B, seq_len, H, DK, generator=g, dtype=f64)
    k = F.normalize(torch.randn(B, seq_len, H, DK, generator=g, dtype=f64), dim=-1)
    v = torch.randn(B, seq_len, H, DV, generator=g, dtype=f64)
    beta = torch.rand(B, seq_len, H, generator=g, dtype=f64)
    shape = {"gdn": (B, seq_len, H), "kda": (B, seq_len, H, DK)}.get(decay)
    log_decay = None if shape is None else -torch.rand(*shape, generator=g, dtype=f64) * 0.5
    init = torch.randn(B, H, DK, DV, generator=g, dtype=f64)
    xs = [q, k, v, beta, log_decay, init]
    return [x.requires_grad_() if requires_grad and x is not None else x for x in xs]


@pytest.mark.parametrize("decay", ["none", "gdn", "kda"])
@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
def test_chunk_form_equals_the_recurrence(decay, chunk):
    q, k, v, beta, g, init = _inputs(37, decay)
    ref, ref_state = delta_rule_reference(q, k, v, beta, g, init, scale=0.7)
    out, state = chunk_delta_rule(q, k, v, beta, g, init, chunk, scale=0.7)
    assert (out - ref).abs().max() <= 1e-12 and (state - ref_state).abs().max() <= 1e-12


@pytest.mark.parametrize("decay", ["none", "gdn", "kda"])
def test_piece_split_is_affine_in_the_entering_state(decay):
    """S_out = M E + N and out(E) = out(0) + correction(E), for any E."""
    q, k, v, beta, g, init = _inputs(29, decay, seed=1)
    ref, ref_state = delta_rule_reference(q, k, v, beta, g, init, scale=0.5)
    piece = delta_piece(q, k, v, beta, g, 8, scale=0.5)
    m, n = piece_transition(piece)
    assert m.shape == (B, H, DK, DK) and n.shape == (B, H, DK, DV)
    assert (m @ init + n - ref_state).abs().max() <= 1e-12
    out0, leave0 = piece_outputs(piece, None)
    assert (leave0 - n).abs().max() <= 1e-12
    assert (out0 + entering_state_output(piece, init) - ref).abs().max() <= 1e-12
    out, leave = piece_outputs(piece, init)
    assert (out - ref).abs().max() <= 1e-12 and (leave - ref_state).abs().max() <= 1e-12


@pytest.mark.parametrize("decay", ["gdn", "kda"])
def test_gradcheck_through_the_chunk_form(decay):
    xs = _inputs(7, decay, seed=2, requires_grad=True)

    def f(q, k, v, beta, g, init):
        out, state = chunk_delta_rule(q, k, v, beta, g, init, 3, scale=0.8)
        return out, state

    assert torch.autograd.gradcheck(f, tuple(xs), eps=1e-6, atol=1e-8, fast_mode=True)


def test_gradients_equal_the_recurrence():
    xs = _inputs(23, "kda", seed=3, requires_grad=True)
    dout = torch.randn(B, 23, H, DV, dtype=torch.float64)
    ref, ref_state = delta_rule_reference(*xs, scale=0.6)
    ref_grads = torch.autograd.grad((ref * dout).sum() + ref_state.sum(), xs)
    out, state = chunk_delta_rule(*xs[:5], xs[5], 4, scale=0.6)
    grads = torch.autograd.grad((out * dout).sum() + state.sum(), xs)
    for a, b in zip(grads, ref_grads, strict=True):
        assert (a - b).abs().max() <= 1e-11


def test_bad_inputs_are_named():
    q, k, v, beta, g, init = _inputs(8, "gdn")
    with pytest.raises(ValueError, match=r"beta shape \(2, 8\) must be \(2, 8, 3\)"):
        chunk_delta_rule(q, k, v, beta[..., 0], g)
    with pytest.raises(ValueError, match=r"log_decay shape \(2, 8, 3, 4\) must be \[B, S, H\]"):
        chunk_delta_rule(q, k, v, beta, torch.zeros(B, 8, H, DK - 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="log_decay must be finite and <= 0"):
        chunk_delta_rule(q, k, v, beta, g.abs() + 0.1)
    with pytest.raises(ValueError, match=r"initial_state shape"):
        chunk_delta_rule(q, k, v, beta, g, init[:, :1])


def test_causal_conv_with_history_equals_the_joined_sequence():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(B, 20, 6, generator=g, dtype=torch.float64)
    w = torch.randn(6, 4, generator=g, dtype=torch.float64)
    bias = torch.randn(6, generator=g, dtype=torch.float64)
    whole = causal_conv1d(x, w, bias, activation=F.silu)
    # nn.Conv1d with padding K - 1, cut to S outputs (what HF's causal_conv1d_fn computes)
    conv = torch.nn.Conv1d(6, 6, 4, groups=6, padding=3, dtype=torch.float64)
    conv.weight.data, conv.bias.data = w.unsqueeze(1), bias
    assert (whole - F.silu(conv(x.transpose(1, 2))[..., :20]).transpose(1, 2)).abs().max() <= 1e-13
    tail = causal_conv1d(x[:, 12:], w, bias, x[:, 9:12], activation=F.silu)
    assert (tail - whole[:, 12:]).abs().max() <= 1e-13
    with pytest.raises(ValueError, match=r"history must be \[B, K - 1, C\] = \(2, 3, 6\)"):
        causal_conv1d(x, w, bias, x[:, :2])


@pytest.mark.parametrize("decay", ["gdn", "kda"])
def test_strong_decay_is_finite_and_exact(decay):
    """Log decays down to -60 per token: no exp overflow, no NaN gradients, still the recurrence."""
    q, k, v, beta, g, init = _inputs(30, decay, seed=5, requires_grad=True)
    strong = (g * 120).detach().requires_grad_()
    ref, ref_state = delta_rule_reference(q, k, v, beta, strong, init)
    out, state = chunk_delta_rule(q, k, v, beta, strong, init, 8)
    assert (out - ref).abs().max() <= 1e-12 and (state - ref_state).abs().max() <= 1e-12
    grads = torch.autograd.grad(out.sum() + state.sum(), [q, k, v, beta, strong, init])
    assert all(torch.isfinite(x).all() for x in grads)


# ---- the optional fused (flash-linear-attention) path: plumbing checked with stand-in kernels on CPU


def _fake_fla(wrong: bool = False):
    """A stand-in with fla's calling convention: (q, k, v, g, beta) as [B, S, H, ...], keyword scale / states."""
    calls = []

    def kernel(
        q,
        k,
        v,
        g,
        beta,
        scale=None,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=True,
    ):
        assert use_qk_l2norm_in_kernel is False  # ds_seqpar normalises q and k as the model does, not fla
        calls.append(g.dim())
        out, state = delta.piece_outputs(
            delta_chunk._torch_piece(q, k, v, beta, g.to(q.dtype), 16, scale), initial_state
        )
        return (out * 0 if wrong else out.to(q.dtype)), state

    return kernel, calls


@pytest.mark.parametrize("decay", ["none", "gdn", "kda"])
def test_fused_path_is_used_when_it_agrees(monkeypatch, decay):
    kernel, calls = _fake_fla()
    use_stand_in(monkeypatch, kernel)
    q, k, v, beta, g, init = _inputs(37, decay, seed=6)
    monkeypatch.setenv("DS_SEQPAR_NO_FLA", "1")
    ref_piece = delta_piece(q, k, v, beta, g, 8, scale=0.5)
    assert not calls and not isinstance(ref_piece, delta.FusedDeltaPiece)  # off by the environment variable
    monkeypatch.delenv("DS_SEQPAR_NO_FLA")
    piece = delta_piece(q, k, v, beta, g, 8, scale=0.5)
    assert isinstance(piece, delta.FusedDeltaPiece) and len(calls) == 1  # the one-time check
    for got, ref in (
        (piece_transition(piece), piece_transition(ref_piece)),
        (piece_outputs(piece, init), piece_outputs(ref_piece, init)),
        ((entering_state_output(piece, init),), (entering_state_output(ref_piece, init),)),
    ):
        assert all((a - b).abs().max() <= 1e-10 for a, b in zip(got, ref, strict=True))
    assert len(calls) == 1 + 4  # M, N, the outputs, the correction


def test_fused_path_that_disagrees_is_refused_with_a_warning(monkeypatch):
    kernel, calls = _fake_fla(wrong=True)
    use_stand_in(monkeypatch, kernel)
    q, k, v, beta, g, init = _inputs(20, "gdn", seed=7)
    with pytest.warns(UserWarning, match="disagrees with ds_seqpar"):
        out, _ = chunk_delta_rule(q, k, v, beta, g, init, 8)
    ref, _ = delta_rule_reference(q, k, v, beta, g, init)
    assert (out - ref).abs().max() <= 1e-12  # PyTorch result, not the stand-in's zeros
    chunk_delta_rule(q, k, v, beta, g, init, 8)
    assert len(calls) == 1  # checked once, then never called again


def test_fused_path_whose_backward_fails_is_refused_at_first_use(monkeypatch):
    kernel, calls = _fake_fla()
    use_stand_in(monkeypatch, backward_refused(kernel))
    q, k, v, beta, g, _ = _inputs(20, "gdn", seed=8)
    with pytest.warns(UserWarning, match="RuntimeError: Triton >= 3.4.0"):
        piece = delta_piece(q, k, v, beta, g, 8, scale=0.5)
    assert not isinstance(piece, delta.FusedDeltaPiece) and len(calls) == 1
