"""APB and Star Attention prefill of a causal LM under SP (docs/inference.md "APB and Star Attention").

Every SP rank r runs the model on its own rows, positions in brackets (S prompt tokens, P ranks, n = S / P):

    [ ids[:l_a] (0 .. l_a-1) ; ids[S-l_q:] (l_a .. l_a+l_q-1) ; ids[r·n : (r+1)·n] (r·n .. (r+1)·n - 1) ]
      anchor prefix             embedded query                   this rank's block

Every attention layer runs ``parallel/apb.py`` instead of ``ds_seqpar.attention`` (through the context's
``approximate``); only the block's K/V (RoPE applied) and global positions go into the cache; the anchor
rows' outputs are dropped. The last prompt position is the last row of rank P - 1: its final hidden state
``[B, E]`` is broadcast over the SP group and every rank computes the logits ``[B, V]``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ds_seqpar.integrations.context import ACTIVE_CONTEXT, CONTEXT_KEY
from ds_seqpar.integrations.hf_model import UnsupportedModelError
from ds_seqpar.integrations.recurrent_layers import has_recurrent_layers
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.parallel.apb import ApbSpec, apb_attention

__all__ = ["ApbAttention", "apb_prefill_logits", "apb_rows", "apb_spec"]


def apb_spec(mesh: SeqParMesh) -> ApbSpec:
    """The ``ApbSpec`` of ``sequence_parallel.inference`` (prefill ``apb`` or ``star``)."""
    inference = mesh.settings.inference
    if inference is None or inference.prefill not in ("apb", "star"):
        mode = None if inference is None else inference.prefill
        raise ValueError(f"sequence_parallel.inference.prefill={mode!r} is not 'apb' or 'star'")
    return ApbSpec(inference.anchor_len, inference.query_len, inference.passing)


def check_prompt(seq_len: int, world: int, spec: ApbSpec) -> int:
    """The block length n = S / P; raises (before any collective) what APB cannot honour."""
    if seq_len % world:
        raise ValueError(
            f"APB / Star prefill splits the prompt into {world} equal blocks; its length {seq_len} is not a "
            f"multiple of {world}: left-truncate or extend the prompt to a multiple of {world} tokens"
        )
    n = seq_len // world
    if spec.anchor_len > n or spec.query_len > seq_len:
        raise ValueError(
            f"sequence_parallel.inference.anchor_len={spec.anchor_len} / query_len={spec.query_len} do not fit a "
            f"prompt of {seq_len} tokens on {world} ranks (block {n}): anchor_len <= {n} and query_len <= "
            f"{seq_len}; lower them"
        )
    return n


def apb_rows(
    input_ids: torch.Tensor, rank: int, world: int, spec: ApbSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows ``[B, n_a + n]`` of the prompt ``input_ids [B, S]`` and their positions ``[n_a + n]``."""
    s = input_ids.shape[1]
    n = check_prompt(s, world, spec)
    l_a, l_q = spec.anchor_len, spec.query_len
    ids = torch.cat([input_ids[:, :l_a], input_ids[:, s - l_q :], input_ids[:, rank * n : (rank + 1) * n]], 1)
    positions = torch.cat([torch.arange(l_a + l_q), torch.arange(rank * n, (rank + 1) * n)])
    return ids, positions.to(input_ids.device)


class ApbAttention:
    """The context's ``approximate``: one layer's APB attention (HF layout in, ``[B, n_a + n, H, D]`` out), and
    the block's K/V ``[B, H_kv, n, D]`` with their global positions into ``cache.store`` when a cache is given."""

    def __init__(
        self, mesh: SeqParMesh, spec: ApbSpec, block: int, layer_of: dict[int, int], cache: Any
    ) -> None:
        self.mesh, self.spec, self.cache, self.layer_of = mesh, spec, cache, layer_of
        rank = mesh.coords.sp_rank
        self.positions = torch.arange(rank * block, (rank + 1) * block)

    def __call__(
        self, module, query, key, value, *, causal, scaling, window, chunk, softcap, sinks, alibi_slopes
    ):
        name = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
        refused = {
            "is_causal": None if causal else False,
            "attention chunk": chunk,
            "alibi_slopes": alibi_slopes,
        }
        refused = {k: v for k, v in refused.items() if v is not None}
        if refused:
            what = next(iter(refused))
            raise UnsupportedModelError(
                f"{name}: APB / Star prefill runs causal softmax attention with an optional sliding window, softcap "
                f"and sinks; this layer's {what} is not honoured by it: use sequence_parallel.inference.prefill="
                "'exact' for this model"
            )
        out = apb_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mesh=self.mesh,
                            spec=self.spec, softmax_scale=scaling, window=window, softcap=softcap, sinks=sinks)  # fmt: skip
        if self.cache is not None:
            n_a = self.spec.anchor_rows
            layer = self.layer_of.get(id(module), getattr(module, "layer_idx", None))
            self.cache.store(layer, key[:, :, n_a:], value[:, :, n_a:], self.positions.to(key.device))
        return out


def _refuse_model(wrapper: Any, doc_ids: torch.Tensor | None) -> None:
    hf = wrapper._parts.hf
    name = type(hf).__name__
    if has_recurrent_layers(hf):
        raise UnsupportedModelError(
            f"{name} has recurrent layers; APB / Star prefill approximates attention only and would feed the "
            "recurrent states with block-local inputs: use sequence_parallel.inference.prefill='exact'"
        )
    if wrapper._parts.positions is not None:
        raise UnsupportedModelError(
            f"{name} derives its position ids from the token ids; APB / Star rows repeat the anchor tokens at "
            "their own positions: use sequence_parallel.inference.prefill='exact'"
        )
    if doc_ids is not None:
        raise ValueError(
            "doc_ids with an APB / Star prefill: the anchor and passing blocks would cross document boundaries; "
            "prefill one document per row, or use sequence_parallel.inference.prefill='exact'"
        )


def apb_prefill_logits(
    wrapper: Any,
    input_ids: torch.Tensor,
    spec: ApbSpec,
    cache: Any = None,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits ``[B, V]`` of the last prompt position (the same on every SP rank) after an APB / Star prefill of the
    whole prompt ``input_ids [B, S]`` (every rank passes the same ids) through ``wrapper`` (a ``SeqParCausalLM``);
    fills ``cache`` (``store(layer, key, value, positions)``) with this rank's block. Runs under no_grad."""
    _refuse_model(wrapper, doc_ids)
    mesh = wrapper.mesh
    world, rank = mesh.sp_size, mesh.coords.sp_rank
    ids, positions = apb_rows(input_ids, rank, world, spec)
    block = input_ids.shape[1] // world
    ctx = wrapper._context(None)
    ctx.approximate = ApbAttention(mesh, spec, block, wrapper._parts.layer_of, cache)
    token = ACTIVE_CONTEXT.set(ctx)
    try:
        with torch.no_grad():
            out = wrapper._parts.decoder(input_ids=ids, position_ids=positions.expand(ids.shape[0], -1),
                                         use_cache=False, **{CONTEXT_KEY: ctx})  # fmt: skip
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
            wrapper._check_calls(ctx)
            last = _from_last_rank(mesh, hidden[:, -1:].contiguous())
            return wrapper._parts.logits(last)[:, -1]
    finally:
        ACTIVE_CONTEXT.reset(token)


def _from_last_rank(mesh: SeqParMesh, hidden: torch.Tensor) -> torch.Tensor:
    """The last SP rank's ``hidden [B, 1, E]`` on every SP rank (one broadcast, counted as ``broadcast``)."""
    members = mesh.members["sp"]
    if len(members) == 1:
        return hidden
    dist.broadcast(hidden, src=members[-1], group=mesh.group("sp"))
    if mesh.coords.sp_rank == len(members) - 1:
        mesh.comm_stats.record_tensors("broadcast", hidden, peers=members[:-1])
    return hidden
