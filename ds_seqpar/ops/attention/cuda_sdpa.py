"""The ``cuda_sdpa`` block kernel: PyTorch's fused CUDA attention ops, forward and backward.

Works on any CUDA machine with no extra package. Per block (the contract: ``attention/contract.py``):

    FULL / square CAUSAL, fp16 / bf16, D % 8 == 0, D <= 256   aten._scaled_dot_product_flash_attention(+_backward)
    PARTIAL (explicit mask), rectangular causal, fp32,          aten._scaled_dot_product_efficient_attention
    other head dims                                             (+_backward)
                                                        with the mask as an additive bias
                                                        (in float32 for half-precision blocks whose Sq
                                                        or Sk is not a multiple of 32: efficient_in_fp32)

Both backward ops take the output and log-sum-exp as inputs, so the engine passes the FINAL (merged
over all key blocks) out and lse of the rows, exactly as for the other kernels. Layout: the ops want
``[B, H, S, D]`` with as many K/V heads as query heads, so K/V heads are repeated for GQA and their
gradients summed over each group. The efficient op pads its lse to a multiple of 32 rows and wants
the bias's last dim aligned to 16 elements; both are handled here. Rows that the mask hides entirely
get out 0 and lse -inf (no host sync). No softcap (the kernel registry skips it then). ALiBi: every
block on the efficient op in float32 with the per-head bias ``[B, H, Sq, Sk]`` (mask and causality folded
in as -inf), whatever the input dtype (a bias of slope · distance in half precision would round).

Every call is exercised on ``device="meta"`` tensors in CPU tests (the ops have meta kernels) and
against CPU stand-ins of the two op pairs; ``benchmarks/gpu_check.py`` checks the arithmetic on a GPU.
"""

from __future__ import annotations

import torch

from ds_seqpar.ops.attention.contract import Alibi, AttentionKernel

NEG_INF = float("-inf")
LSE_ROWS = 32  # the efficient op's log-sum-exp is padded to a multiple of this many rows
BIAS_ALIGN = 16  # the efficient op wants the bias's last dim aligned to this many elements
HALF_ALIGN = (
    32  # half-precision efficient-op blocks run in fp32 unless Sq and Sk are multiples (efficient_in_fp32)
)
FLASH_DTYPES = (torch.float16, torch.bfloat16)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot run for ``(device, dtype)``, or None."""
    if device.type != "cuda":
        return f"needs CUDA tensors (got device {device.type!r})"
    if dtype not in DTYPES:
        return f"needs float16, bfloat16 or float32 inputs (got {dtype})"
    return None


def refuse_softcap(kernel: str, softcap: float | None) -> None:
    """Kernels without soft-capping take the argument of the kernel interface but must never drop it."""
    if softcap is not None:
        raise ValueError(f"kernel={kernel!r} cannot apply softcap={softcap}; use kernel='auto' or 'torch'")


def use_flash(
    q: torch.Tensor, mask: torch.Tensor | None, causal: bool = False, sk: int | None = None
) -> bool:
    """Whether a block runs on the flash op (else the efficient op). A rectangular causal block goes to
    the efficient op: the flash op aligns causality bottom-right, the engine top-left."""
    d = q.shape[-1]
    square = not causal or sk is None or sk == q.shape[1]
    return mask is None and square and q.dtype in FLASH_DTYPES and d % 8 == 0 and d <= 256


def efficient_in_fp32(
    q: torch.Tensor, mask: torch.Tensor | None, causal: bool = False, sk: int | None = None
) -> bool:
    """Whether a half-precision block (``q [B, Sq, H, D]`` against ``sk`` keys) that goes to the efficient
    op runs it in float32 instead.

    Measured on an H200 (torch 2.11, ``benchmarks/results/gpu_check.md``): the efficient op with a bias
    in fp16 / bf16 returned errors of 0.7 to 246 (relative to the output's max) on blocks of 257 queries
    x 193 or 257 keys (batch 2, the bias then a stride-0 expand over the batch), while float32 on the same
    blocks, and bf16 on 255 x 255 and 256 x 256 blocks (batch 1), were exact. The trigger is not pinned
    down (a length of 32k + 1, the batch, the stride-0 bias), so every half-precision efficient-op block
    whose Sq or Sk is not a multiple of ``HALF_ALIGN`` runs in float32 (slower, exact), blocks without a
    mask too (rectangular causal, head dims the flash op does not take: not measured); aligned blocks stay
    in half precision. ``benchmarks/gpu_check.py``'s ``efficient_raw`` rows run the op in half precision
    on such blocks, bypassing this rule, to narrow it.
    """
    if q.dtype not in FLASH_DTYPES or use_flash(q, mask, causal, sk):
        return False
    return q.shape[1] % HALF_ALIGN != 0 or (sk if sk is not None else q.shape[1]) % HALF_ALIGN != 0


def _heads_first(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[B, S, H_kv, D]`` -> ``[B, H_kv·group, S, D]`` (each K/V head repeated for its query heads)."""
    x = x.transpose(1, 2)
    return x.repeat_interleave(group, dim=1) if group > 1 else x


def _bias(mask: torch.Tensor, batch: int, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """Bool ``[B|1, Sq, Sk]`` (True = visible) -> additive ``[B, H, Sq, Sk]`` view of a ``[B, 1, Sq, *]``
    buffer whose last dim is padded to ``BIAS_ALIGN`` (0 visible, -inf hidden). The op checks every size,
    the batch too; a mask shared by the batch is written once per batch row (a stride-0 batch is not among
    the layouts measured exact on a GPU), the heads are a stride-0 expand (measured exact)."""
    sq, sk = mask.shape[1:]
    padded = -(-sk // BIAS_ALIGN) * BIAS_ALIGN
    buf = torch.zeros(batch, 1, sq, padded, dtype=dtype, device=mask.device)
    view = buf[..., :sk]
    view.masked_fill_(~mask.unsqueeze(1), NEG_INF)
    return view.expand(batch, heads, sq, sk)


def _alibi_bias(
    alibi: Alibi, mask: torch.Tensor | None, causal: bool, q: torch.Tensor, sk: int
) -> torch.Tensor:
    """The ALiBi bias of a block as the efficient op takes it: float32 ``[B, H, Sq, Sk]`` in a buffer whose
    last dim is padded to ``BIAS_ALIGN``, every batch row written, hidden pairs -inf."""
    b, sq, h, _ = q.shape
    padded = -(-sk // BIAS_ALIGN) * BIAS_ALIGN
    buf = torch.zeros(b, h, sq, padded, dtype=torch.float32, device=q.device)
    view = buf[..., :sk]
    view.copy_(alibi.bias(0, sq, 0, sk, torch.float32).expand(b, h, sq, sk))
    if causal:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril().unsqueeze(0)
    if mask is not None:
        view.masked_fill_(~mask.unsqueeze(1), NEG_INF)
    return view


def _alibi_forward(q, k, v, scale, mask, causal, alibi):
    """A block with ALiBi: the efficient op in float32 with the bias; out in q.dtype, lse fp32."""
    group, sq = q.shape[2] // k.shape[2], q.shape[1]
    q_t, k_t, v_t = q.float().transpose(1, 2), _heads_first(k.float(), group), _heads_first(v.float(), group)
    bias = _alibi_bias(alibi, mask, causal, q, k.shape[1])
    res = torch.ops.aten._scaled_dot_product_efficient_attention(
        q_t, k_t, v_t, bias, True, 0.0, False, scale=scale
    )
    out, lse = res[0].transpose(1, 2).to(q.dtype), res[1][..., :sq]
    if mask is not None:  # rows that see no key: out 0, lse -inf
        empty = ~mask.any(dim=-1)
        out = out.masked_fill(empty[:, :, None, None], 0.0)
        lse = lse.masked_fill(empty.unsqueeze(1), NEG_INF)
    return out, lse.float()


def _alibi_backward(dout, q, k, v, out, lse, scale, mask, causal, alibi):
    """Gradients of a block with ALiBi (float32 efficient op), in q.dtype."""
    b, _, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = h // hkv
    q_t, k_t, v_t = q.float().transpose(1, 2), _heads_first(k.float(), group), _heads_first(v.float(), group)
    do_t, o_t = (x.float().transpose(1, 2) for x in (dout, out))
    bias = _alibi_bias(alibi, mask, causal, q, sk)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        do_t, q_t, k_t, v_t, bias, o_t, _padded_lse(lse.float().contiguous()), seed, offset, 0.0,
        [True, True, True, False], False, scale=scale,
    )  # fmt: skip
    if group > 1:  # repeated K/V heads: sum each group's gradients
        dk = dk.reshape(b, hkv, group, sk, d).sum(2)
        dv = dv.reshape(b, hkv, group, sk, d).sum(2)
    return tuple(x.transpose(1, 2).to(q.dtype) for x in (dq, dk, dv))


def _padded_lse(lse: torch.Tensor) -> torch.Tensor:
    """``[B, H, Sq]`` -> ``[B, H, ceil(Sq / 32) * 32]`` (the efficient op's layout)."""
    sq = lse.shape[-1]
    pad = -(-sq // LSE_ROWS) * LSE_ROWS - sq
    return torch.nn.functional.pad(lse, (0, pad)) if pad else lse


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    causal: bool,
    softcap: float | None = None,
    alibi: Alibi | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, Sq, H, D]``, ``k, v [B, Sk, H_kv, D]`` -> ``out [B, Sq, H, D]`` (q.dtype), ``lse [B, H, Sq]`` fp32."""
    refuse_softcap("cuda_sdpa", softcap)
    if alibi is not None:
        return _alibi_forward(q, k, v, scale, mask, causal, alibi)
    if efficient_in_fp32(q, mask, causal, k.shape[1]):
        out, lse = forward(q.float(), k.float(), v.float(), scale, mask, causal)
        return out.to(q.dtype), lse
    aten = torch.ops.aten
    group = q.shape[2] // k.shape[2]
    q_t, k_t, v_t = q.transpose(1, 2), _heads_first(k, group), _heads_first(v, group)
    sq = q.shape[1]
    if use_flash(q, mask, causal, k.shape[1]):
        res = aten._scaled_dot_product_flash_attention(q_t, k_t, v_t, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1]
    else:
        bias = None if mask is None else _bias(mask, q.shape[0], q.shape[2], q.dtype)
        res = aten._scaled_dot_product_efficient_attention(
            q_t, k_t, v_t, bias, True, 0.0, causal, scale=scale
        )
        out, lse = res[0], res[1][..., :sq]
    out = out.transpose(1, 2)
    if mask is not None:  # rows that see no key: out 0, lse -inf (whatever the op made of them)
        empty = ~mask.any(dim=-1)  # [B|1, Sq]
        out = out.masked_fill(empty[:, :, None, None], 0.0)
        lse = lse.masked_fill(empty.unsqueeze(1), NEG_INF)
    return out, lse.float()


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    causal: bool,
    softcap: float | None = None,
    alibi: Alibi | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients given the FINAL ``out [B, Sq, H, D]`` / ``lse [B, H, Sq]`` (finite) of the rows."""
    refuse_softcap("cuda_sdpa", softcap)
    if alibi is not None:
        return _alibi_backward(dout, q, k, v, out, lse, scale, mask, causal, alibi)
    if efficient_in_fp32(q, mask, causal, k.shape[1]):
        grads = backward(dout.float(), q.float(), k.float(), v.float(), out, lse, scale, mask, causal)
        return tuple(g.to(q.dtype) for g in grads)  # type: ignore[return-value]
    aten = torch.ops.aten
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = h // hkv
    q_t, k_t, v_t = q.transpose(1, 2), _heads_first(k, group), _heads_first(v, group)
    do_t, o_t = (x.to(q.dtype).transpose(1, 2) for x in (dout, out))
    lse = lse.float().contiguous()
    if use_flash(q, mask, causal, sk):
        seed = torch.zeros(2, dtype=torch.uint64, device=q.device)  # dropout 0: the RNG state is unused
        offset = torch.zeros((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            do_t, q_t, k_t, v_t, o_t, lse, None, None, sq, sk, 0.0, causal, seed, offset, scale=scale
        )
    else:
        bias = None if mask is None else _bias(mask, b, h, q.dtype)
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        offset = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            do_t, q_t, k_t, v_t, bias, o_t, _padded_lse(lse), seed, offset, 0.0, [True, True, True, False], causal,
            scale=scale,
        )  # fmt: skip
    if group > 1:  # repeated K/V heads: sum each group's gradients
        dk = dk.reshape(b, hkv, group, sk, d).sum(2)
        dv = dv.reshape(b, hkv, group, sk, d).sum(2)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


CUDA_SDPA = AttentionKernel(
    name="cuda_sdpa",
    forward=forward,
    backward=backward,
    unavailable=unavailable,
    summary="PyTorch's fused CUDA ops",
    alibi=True,
)
