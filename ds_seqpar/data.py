"""Shard batches for sequence parallelism: pad, pre-shift labels, reorder by layout, keep this rank's slice.

Legend: B = batch, S = global sequence length (after padding), P = SP degree, n = S / P.

Every rank of an SP group receives the SAME full batch (the sampler uses the dp rank), and
``shard_batch`` turns it into this rank's part:

1. pad S up to the multiple the layout needs (``input_layout(mesh).multiple``): input ids with
   ``pad_token_id``, labels with -100, RoPE positions continue the last document;
2. pre-shift labels (``shift_labels[t] = labels[t + 1]``, last -100) BEFORE sharding, so the label of
   the last token of every shard is the first token of the next one, not lost;
3. derive document ids: packed rows (``position_ids`` restarting at 0) and padding inside the row
   (``attention_mask == 0``, which also gets label -100) become per-token document ids ``[B, S]``
   (-1 = padding), which the attention masks with; plain rows need none (causal attention never
   lets a real token see the end padding);
4. reorder by the layout and keep this rank's n tokens of ``input_ids``, ``shift_labels`` and
   ``position_ids`` (RoPE positions; GLOBAL, so zigzag/stripe shards get the right rotary angles).

Outputs (a dict): ``input_ids [B, n]``, ``shift_labels [B, n]``, ``position_ids [B, n]``,
``doc_ids [B, S] | None`` (global order, consumed by the attention of every layer) and
``seq_len`` (S).

``objective="masked"`` (bidirectional encoders, ``SeqParMaskedLM``): labels are NOT shifted (the label
of a token is its own masked-out id; output key ``labels``), and every padded position (the layout's
end padding included) gets document id -1, because a bidirectional attention would otherwise let
real tokens see the padding. ``SeqParCollator`` wraps any collator; ``seqpar_dataloader`` builds a DataLoader
whose sampler splits the data over the dp ranks only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ds_seqpar.layout import UspLayout
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.settings import input_layout

IGNORE_INDEX = -100
BATCH_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")
# What padding-free collators (TRL's DataCollatorForLanguageModeling) add next to position_ids: the same
# document boundaries in the forms flash-attention's varlen kernels and short convolutions take.
# shard_batch derives the boundaries from position_ids; these are checked against them (_check_packed_boundaries)
# and dropped.
PACKED_BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _pad_right(x: torch.Tensor, length: int, value: int) -> torch.Tensor:
    if x.shape[1] == length:
        return x
    return torch.nn.functional.pad(x, (0, length - x.shape[1]), value=value)


def _continue_positions(pos: torch.Tensor, length: int) -> torch.Tensor:
    """Pad RoPE positions ``[B, S0]`` to ``length`` by continuing each row's last document."""
    extra = length - pos.shape[1]
    if extra == 0:
        return pos
    steps = torch.arange(1, extra + 1, device=pos.device, dtype=pos.dtype)
    return torch.cat([pos, pos[:, -1:] + steps], dim=1)


def doc_ids_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Document id per token ``[B, S]`` of packed rows: a new document starts wherever the position drops."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] <= position_ids[:, :-1]
    return torch.cumsum(starts.long(), dim=1) - 1


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` -> next-token labels ``[B, S]`` (last position -100)."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


OBJECTIVES = ("causal", "masked")


def check_objective(objective: str) -> str:
    if objective not in OBJECTIVES:
        raise ValueError(
            f"objective={objective!r}; valid: 'causal' (next-token loss, labels pre-shifted) or 'masked' "
            "(masked-LM loss of a bidirectional encoder, labels at their own tokens)"
        )
    return objective


def shard_batch(
    batch: dict[str, Any],
    mesh: SeqParMesh,
    *,
    pad_token_id: int = 0,
    layout: UspLayout | None = None,
    objective: str = "causal",
    whole: Sequence[str] = (),
) -> dict[str, Any]:
    """This rank's shard of a full batch (see the module docstring).

    Args:
        batch: ``input_ids [B, S0]`` and optionally ``labels`` (default: the input ids; the masked
            objective needs them), ``attention_mask`` (0 = padding), ``position_ids`` (restarting per
            packed document).
        mesh: the SP mesh; the shard is ``mesh.coords.sp_rank``'s.
        pad_token_id: id used to pad ``input_ids`` to the layout's multiple.
        layout: defaults to ``input_layout(mesh)``.
        objective: ``"causal"`` (pre-shifted ``shift_labels``) or ``"masked"`` (unshifted ``labels``,
            padding always masked out of the attention through ``doc_ids``).
        whole: batch keys passed on unchanged, the same on every rank (a VLM's vision inputs:
            ``SeqParVisionLM.whole_inputs``).
    """
    passed = {k: batch[k] for k in whole if k in batch}
    batch = {k: v for k, v in batch.items() if k not in passed}
    masked = check_objective(objective) == "masked"
    ids, labels, positions, attn = _checked_inputs(batch, masked)
    b, s0 = ids.shape
    layout = layout or input_layout(mesh)
    mult = layout.multiple
    seq_len = max(mult, -(-s0 // mult) * mult)

    if attn is not None:
        attn = torch.as_tensor(attn).bool()
        labels = labels.masked_fill(~attn, IGNORE_INDEX)
    shifted = labels if masked else shift_labels(labels)
    if attn is not None:
        shifted = shifted.masked_fill(~attn, IGNORE_INDEX)  # padding queries predict nothing

    packed = positions is not None
    if positions is None:
        positions = torch.arange(s0).expand(b, s0)
    positions = torch.as_tensor(positions).long()
    doc_ids = _doc_ids(positions, attn, packed, padded_end=masked and seq_len > s0, seq_len=seq_len)
    layout = layout.for_batch(doc_ids)  # ring.layout='documents': this batch's document placement
    rank = mesh.coords.sp_rank
    return {
        "input_ids": layout.shard(_pad_right(ids, seq_len, pad_token_id), rank),
        ("labels" if masked else "shift_labels"): layout.shard(
            _pad_right(shifted, seq_len, IGNORE_INDEX), rank
        ),
        "position_ids": layout.shard(_continue_positions(positions, seq_len), rank),
        "doc_ids": doc_ids,
        "seq_len": seq_len,
        **passed,
    }


def _checked_inputs(batch: dict[str, Any], masked: bool) -> tuple[torch.Tensor, torch.Tensor, Any, Any]:
    """``(input_ids, labels, position_ids, attention_mask)`` of a batch, every key and shape checked."""
    if "input_ids" not in batch:
        raise ValueError(f"shard_batch needs 'input_ids' in the batch; got keys {sorted(batch)}")
    unknown = sorted(k for k in batch if k not in BATCH_KEYS and k not in PACKED_BOUNDARY_KEYS)
    if unknown:
        raise ValueError(
            f"shard_batch got batch keys {unknown} that sequence parallelism does not split or honour; valid: "
            f"{', '.join(BATCH_KEYS)} (packed documents: position_ids restarting at 0); remove them from the "
            "examples or the collator"
        )
    _check_packed_boundaries(batch)
    ids = torch.as_tensor(batch["input_ids"])
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S]; got shape {tuple(ids.shape)}")
    if masked and batch.get("labels") is None:
        raise ValueError(
            "shard_batch(objective='masked') needs 'labels': the original ids at the masked positions and -100 "
            "elsewhere (ds_seqpar.tasks.masking.mask_tokens builds them)"
        )
    labels = torch.as_tensor(batch["labels"]) if batch.get("labels") is not None else ids.clone()
    positions, attn = batch.get("position_ids"), batch.get("attention_mask")
    for name, t in (("labels", labels), ("position_ids", positions), ("attention_mask", attn)):
        if t is not None and tuple(torch.as_tensor(t).shape) != tuple(ids.shape):
            raise ValueError(
                f"{name} has shape {tuple(torch.as_tensor(t).shape)} but input_ids is {tuple(ids.shape)}"
            )
    return ids, labels, positions, attn


def _doc_ids(
    positions: torch.Tensor, attn: torch.Tensor | None, packed: bool, padded_end: bool, seq_len: int
) -> torch.Tensor | None:
    """Document id per token ``[B, S]`` (padded to ``seq_len`` with -1), or None when one document per row
    under the plain causal mask is exact (no packing, no padding inside, no end padding a bidirectional
    attention would see)."""
    b, s0 = positions.shape
    padded_inside = attn is not None and not bool(attn.all())
    if not (packed or padded_inside or padded_end):
        return None
    doc_ids = doc_ids_from_positions(positions) if packed else torch.zeros(b, s0, dtype=torch.long)
    if padded_inside:
        doc_ids = doc_ids.masked_fill(~attn, -1)
    doc_ids = _pad_right(doc_ids, seq_len, -1)
    if packed and int(doc_ids.max()) == 0 and not padded_inside and not padded_end:
        return None  # one document per row: the plain causal mask is exact
    return doc_ids


def _check_packed_boundaries(batch: dict[str, Any]) -> None:
    """The boundary keys of a padding-free batch must describe the documents that ``position_ids`` gives.

    Documents start wherever the position drops (``doc_ids_from_positions``); ``cu_seq_lens_*`` must be
    those starts (and the row's end), ``max_length_*`` the longest document, ``seq_idx`` the document id
    of every token. They describe one packed row, so the batch must have one row.
    """
    present = [k for k in PACKED_BOUNDARY_KEYS if k in batch]
    if not present:
        return
    positions = batch.get("position_ids")
    if positions is None:
        raise ValueError(
            f"batch keys {present} describe packed documents but the batch has no position_ids; valid: "
            "position_ids restarting at 0 per document (what padding-free collators also return)"
        )
    positions = torch.as_tensor(positions)
    if positions.dim() != 2 or positions.shape[0] != 1:
        raise ValueError(
            f"batch keys {present} describe one packed row, but position_ids has shape {tuple(positions.shape)}; "
            "valid: a padding-free batch of shape [1, S]"
        )
    docs = doc_ids_from_positions(positions)[0]
    starts = torch.nonzero(torch.diff(docs, prepend=docs.new_tensor([-1]))).flatten()
    lengths = torch.diff(torch.cat([starts, starts.new_tensor([docs.numel()])]))
    expected = {
        "cu_seq_lens_q": torch.cat([starts, starts.new_tensor([docs.numel()])]),
        "max_length_q": lengths.max(),
        "seq_idx": docs[None],
    }
    expected["cu_seq_lens_k"], expected["max_length_k"] = expected["cu_seq_lens_q"], expected["max_length_q"]
    for key in present:
        value = torch.as_tensor(batch[key]).long().cpu()
        if value.shape != expected[key].shape or not torch.equal(value, expected[key].long().cpu()):
            raise ValueError(
                f"{key} does not match the documents of position_ids (documents start at {starts.tolist()}); "
                "ds_seqpar takes packed documents from position_ids: make the two agree or drop the key"
            )


def _stack(examples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Default collation: stack equal-length examples (lists or tensors) key by key."""
    keys = examples[0].keys()
    return {k: torch.stack([torch.as_tensor(e[k]) for e in examples]) for k in keys}


class SeqParCollator:
    """Collate examples into a full batch, then shard it for this rank (``shard_batch``)."""

    def __init__(
        self,
        mesh: SeqParMesh,
        base: Callable[[Sequence[Any]], dict[str, Any]] | None = None,
        pad_token_id: int = 0,
        objective: str = "causal",
        whole: Sequence[str] = (),
    ) -> None:
        self.mesh = mesh
        self.base = base or _stack
        self.pad_token_id = pad_token_id
        self.objective = check_objective(objective)
        self.whole = tuple(whole)

    def __call__(self, examples: Sequence[Any]) -> dict[str, Any]:
        batch = dict(self.base(examples))
        return shard_batch(
            batch, self.mesh, pad_token_id=self.pad_token_id, objective=self.objective, whole=self.whole
        )


def seqpar_dataloader(
    dataset: Dataset,
    mesh: SeqParMesh,
    batch_size: int,
    *,
    collate_fn: Callable[[Sequence[Any]], dict[str, Any]] | None = None,
    shuffle: bool = True,
    seed: int = 0,
    pad_token_id: int = 0,
    drop_last: bool = True,
    objective: str = "causal",
    whole: Sequence[str] = (),
    **loader_kwargs: Any,
) -> DataLoader:
    """A DataLoader over ``dataset`` for this rank: dp-sharded sampling, SP-sharded sequences.

    The sampler splits samples over the ``mesh.dp_size`` data-parallel replicas (rank =
    ``mesh.coords.dp_rank``), so all SP ranks of one group read the same samples; each batch is
    then sharded along the sequence by ``SeqParCollator`` (``whole``: keys passed on unsharded). Call ``loader.sampler.set_epoch(e)``
    each epoch when shuffling. ``loader_kwargs`` (``num_workers``, ``pin_memory``, ...) go to the DataLoader.
    """
    collate = SeqParCollator(mesh, collate_fn, pad_token_id, objective, whole)
    return dp_dataloader(dataset, mesh, batch_size, collate, shuffle, seed, drop_last, **loader_kwargs)


def dp_dataloader(
    dataset: Dataset,
    mesh: SeqParMesh,
    batch_size: int,
    collate_fn: Callable[[Sequence[Any]], dict[str, Any]],
    shuffle: bool,
    seed: int,
    drop_last: bool,
    **loader_kwargs: Any,
) -> DataLoader:
    """A DataLoader whose sampler splits ``dataset`` over the ``mesh.dp_size`` data-parallel replicas only (every
    SP rank of a group reads the same samples); ``collate_fn`` makes this rank's batch."""
    sampler = DistributedSampler(
        dataset,
        num_replicas=mesh.dp_size,
        rank=mesh.coords.dp_rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
        **loader_kwargs,
    )
