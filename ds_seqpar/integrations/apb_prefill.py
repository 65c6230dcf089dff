"""APB and Star Attention prefill modes ``"apb"`` / ``"star"`` of ``ds_seqpar.prefill`` (docs/inference.md "APB and
Star Attention").

The prompt (S0 tokens) is sharded as for the exact prefill, which for these modes must give SP rank r the
contiguous block of global positions [r·n, (r+1)·n) (``ring.layout: "contiguous"``; the padding to the
layout's multiple sits at the end of the last block). Rank r runs the model on its rows, positions in brackets:

    [ ids[:l_a] (0 .. l_a-1) ; ids[S0-l_q:S0] (l_a .. l_a+l_q-1) ; its block (r·n .. (r+1)·n - 1) ]
      anchor prefix             embedded query                      as sharded

Every attention layer runs ``parallel/apb.py`` instead of ``ds_seqpar.attention`` (through the context's
``approximate``) and stores only the block's K/V in the ``ShardedCache`` (through ``_BlockCache``); the
anchor rows' outputs are dropped, so the mode returns the block's hidden states and ``prefill`` proceeds as for ``"exact"``.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_seqpar.integrations.context import ACTIVE_CONTEXT, CONTEXT_KEY, SeqParContext
from ds_seqpar.integrations.hf_model import UnsupportedModelError
from ds_seqpar.integrations.prefill import PrefillMode, register_prefill_mode
from ds_seqpar.integrations.recurrent_layers import has_recurrent_layers
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.parallel.apb import ApbSpec, apb_attention
from ds_seqpar.settings import input_layout

__all__ = ["ApbAttention", "apb_rows", "apb_spec"]

FIX = "use sequence_parallel.inference.prefill='exact' (prefill(..., mode='exact'))"


def apb_spec(mesh: SeqParMesh, star: bool = False) -> ApbSpec:
    """The ``ApbSpec`` of ``sequence_parallel.inference`` (its defaults when the section says ``exact``); ``star``:
    passing length 0."""
    inference = mesh.settings.inference
    if inference is None:
        from ds_seqpar.config.inference import InferenceConfig

        inference = InferenceConfig()
    return ApbSpec(inference.anchor_len, inference.query_len, 0 if star else inference.passing_len)


def check_fit(spec: ApbSpec, s0: int, n: int) -> None:
    """The anchor and embedded query must fit a prompt of ``s0`` tokens in blocks of ``n``."""
    if spec.anchor_len > n or spec.anchor_len > s0 or spec.query_len > s0:
        raise ValueError(
            f"sequence_parallel.inference.anchor_len={spec.anchor_len} / query_len={spec.query_len} do not fit a "
            f"prompt of {s0} tokens in blocks of {n}: anchor_len <= {min(n, s0)} and query_len <= {s0}; lower them"
        )


def apb_rows(
    prompt: torch.Tensor, block: torch.Tensor, block_positions: torch.Tensor, spec: ApbSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows ``[B, n_a + n]`` and their position ids ``[B, n_a + n]``: anchor prefix and embedded
    query of ``prompt [B, S0]``, then the rank's ``block [B, n]`` at ``block_positions [B, n]``."""
    s0 = prompt.shape[1]
    check_fit(spec, s0, block.shape[1])
    l_a, l_q = spec.anchor_len, spec.query_len
    ids = torch.cat([prompt[:, :l_a], prompt[:, s0 - l_q :], block], dim=1)
    anchor = torch.arange(l_a + l_q, device=block.device).expand(block.shape[0], -1)
    return ids, torch.cat([anchor, block_positions.to(block.device)], dim=1)


class ApbAttention:
    """The context's ``approximate``: called as ``ds_seqpar.attention`` is, on this rank's rows ``q [B, n_a + n, H,
    D]``, ``k, v [B, n_a + n, H_kv, D]``; runs ``apb_attention``. Refuses what it does not honour by name."""

    def __init__(self, spec: ApbSpec) -> None:
        self.spec = spec

    def __call__(self, q, k, v, *, mesh, causal, softmax_scale, window, doc_ids, softcap, sinks, chunk,
                 alibi_slopes, layer=None, **_unused) -> torch.Tensor:  # fmt: skip
        refused = {"is_causal=False": not causal, "an attention chunk": chunk is not None,
                   "ALiBi": alibi_slopes is not None, "document ids": doc_ids is not None}  # fmt: skip
        what = [k for k, v in refused.items() if v]
        if what:
            raise UnsupportedModelError(
                f"layer {layer}: APB / Star prefill runs causal softmax attention (with window, softcap and sinks); "
                f"this layer's {what[0]} is not honoured by it: {FIX}"
            )
        return apb_attention(q, k, v, mesh=mesh, spec=self.spec, softmax_scale=softmax_scale, window=window,
                             softcap=softcap, sinks=sinks)  # fmt: skip


class _BlockCache:
    """Stands for the ``ShardedCache`` during an APB / Star forward: ``store`` keeps the block's K/V only
    (the rows after the ``anchor_rows`` anchor rows)."""

    decoding = False

    def __init__(self, cache: Any, anchor_rows: int) -> None:
        self.cache, self.anchor_rows = cache, anchor_rows

    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self.cache.store(layer, key[:, :, self.anchor_rows :], value[:, :, self.anchor_rows :])


def _check(wrapper: Any, ids: torch.Tensor, position_ids: Any, star: bool) -> None:
    """What APB / Star cannot honour, refused by name before any collective: recurrent layers, a layout without
    one contiguous block per rank, packed prompts, anchor / query rows that do not fit the prompt's blocks."""
    hf, mesh = wrapper._parts.hf, wrapper.mesh
    if position_ids is not None:
        raise ValueError(
            "APB / Star prefill of packed prompts (position_ids restarting): the anchor and passing blocks would "
            f"cross documents; prefill one document per row, or {FIX}"
        )
    name = type(hf).__name__
    if has_recurrent_layers(hf):
        raise UnsupportedModelError(
            f"{name} has recurrent layers; APB / Star prefill approximates softmax attention only and would run the "
            f"recurrent layers on [anchor ; block] rows as if they were one sequence: {FIX}"
        )
    layout, world = input_layout(mesh), mesh.sp_size
    probe = layout.multiple * world  # any valid length: every rank must hold one contiguous block of it
    blocks = [layout.local_positions(probe, r) for r in range(world)]
    contiguous = all(torch.equal(b, torch.arange(r * len(b), (r + 1) * len(b))) for r, b in enumerate(blocks))
    if mesh.settings.dynamic_degree or not contiguous:
        raise UnsupportedModelError(
            f"APB / Star prefill needs every SP rank to hold one contiguous block of the prompt; "
            f"sequence_parallel.ring.layout={layout.ring.name!r} (dynamic_degree={mesh.settings.dynamic_degree}) does "
            "not: set ring.layout='contiguous' and dynamic_degree=false for this prefill, or " + FIX
        )
    s0, mult = ids.shape[1], layout.multiple
    block = max(mult, -(-s0 // mult) * mult) // world
    check_fit(apb_spec(mesh, star), s0, block)


def _forward(wrapper: Any, batch: dict[str, Any], ctx: SeqParContext, star: bool) -> torch.Tensor:
    """Hidden states ``[B, n, E]`` of this rank's block after the APB / Star forward of its rows."""
    spec = apb_spec(wrapper.mesh, star)
    ids, positions = apb_rows(batch["prompt_ids"], batch["input_ids"], batch["position_ids"], spec)
    cache = ctx.cache
    ctx.approximate = ApbAttention(spec)
    ctx.cache = None if cache is None else _BlockCache(cache, spec.anchor_rows)
    token = ACTIVE_CONTEXT.set(ctx)
    try:
        out = wrapper._parts.decoder(
            input_ids=ids, position_ids=positions, use_cache=False, **{CONTEXT_KEY: ctx}
        )
    finally:
        ACTIVE_CONTEXT.reset(token)
        ctx.cache, ctx.approximate = cache, None
    wrapper._check_calls(ctx)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[:, spec.anchor_rows :]


register_prefill_mode(
    PrefillMode(
        "apb",
        "APB: anchor block + blocks passed by the earlier ranks + own block; approximate (docs/inference.md)",
        lambda wrapper, batch, ctx: _forward(wrapper, batch, ctx, star=False),
        lambda wrapper, ids, position_ids: _check(wrapper, ids, position_ids, star=False),
    )
)
register_prefill_mode(
    PrefillMode(
        "star",
        "Star Attention: anchor block + own block; approximate, no collective in attention (docs/inference.md)",
        lambda wrapper, batch, ctx: _forward(wrapper, batch, ctx, star=True),
        lambda wrapper, ids, position_ids: _check(wrapper, ids, position_ids, star=True),
    )
)
