"""Token layouts: shard/unshard round trips, positions, segments, packed-document metadata, errors."""

from __future__ import annotations

import pytest
import torch

from ds_seqpar.layout import LayoutError, doc_ids_from_cu_seqlens, positions_from_cu_seqlens, ring_layout


@pytest.mark.parametrize(
    ("kind", "world", "granularity"),
    [
        ("contiguous", 1, 1),
        ("contiguous", 3, 1),
        ("zigzag", 1, 1),
        ("zigzag", 4, 1),
        ("stripe", 4, 1),
        ("stripe", 3, 4),
    ],
)
def test_shard_unshard_round_trip_and_positions(kind, world, granularity):
    layout = ring_layout(kind, world, granularity)
    seq_len = layout.multiple * 3
    x = torch.randn(2, seq_len, 3)
    shards = [layout.shard(x, r) for r in range(world)]
    assert all(s.shape == (2, seq_len // world, 3) for s in shards)
    torch.testing.assert_close(layout.unshard(shards), x, rtol=0, atol=0)
    for r in range(world):
        torch.testing.assert_close(shards[r], x[:, layout.local_positions(seq_len, r)], rtol=0, atol=0)
    assert sorted(layout.permutation(seq_len).tolist()) == list(range(seq_len))
    # segments cover the local tokens, and each is a run of consecutive global positions
    for r in range(world):
        pos = layout.local_positions(seq_len, r)
        covered = []
        for a, b in layout.segments(seq_len):
            covered.extend(range(a, b))
            if kind != "stripe":
                assert torch.equal(pos[a:b], torch.arange(int(pos[a]), int(pos[a]) + b - a))
        assert covered == list(range(seq_len // world))


def test_zigzag_and_stripe_positions_written_out():
    assert ring_layout("zigzag", 2).permutation(8).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert ring_layout("stripe", 2).permutation(6).tolist() == [0, 2, 4, 1, 3, 5]
    assert ring_layout("stripe", 2, 2).permutation(8).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert ring_layout("contiguous", 2).local_positions(6, 1).tolist() == [3, 4, 5]


def test_shard_along_other_dims():
    layout = ring_layout("zigzag", 2)
    lse = torch.arange(2 * 3 * 8).reshape(2, 3, 8)  # [B, H, S]
    parts = [layout.shard(lse, r, dim=2) for r in range(2)]
    torch.testing.assert_close(layout.unshard(parts, dim=2), lse)


@pytest.mark.parametrize(
    ("layout", "seq_len", "message"),
    [
        (
            ring_layout("contiguous", 4),
            10,
            r"sequence length 10 cannot be split by layout='contiguous' over 4 ranks: it must be a multiple of 4 \(ranks\); pad it to 12",
        ),
        (ring_layout("zigzag", 4), 12, r"it must be a multiple of 8 \(2 x 4 ranks\); pad it to 16"),
        (ring_layout("stripe", 2, 64), 100, r"multiple of 128 \(2 ranks x granularity 64\); pad it to 128"),
        (ring_layout("zigzag", 2), 0, r"sequence length 0 cannot be split.*pad it to 4"),
    ],
)
def test_lengths_a_layout_cannot_split(layout, seq_len, message):
    with pytest.raises(LayoutError, match=message):
        layout.shard(torch.zeros(1, seq_len), 0)


def test_bad_layout_arguments():
    with pytest.raises(
        LayoutError, match=r"layout='ring' is not a layout; valid: contiguous, zigzag, stripe"
    ):
        ring_layout("ring", 2)
    with pytest.raises(LayoutError, match=r"granularity=4 only applies to layout='stripe'"):
        ring_layout("zigzag", 2, 4)
    with pytest.raises(LayoutError, match=r"rank=2 is outside the layout's 2 ranks; valid: 0\.\.1"):
        ring_layout("zigzag", 2).local_positions(8, 2)
    with pytest.raises(LayoutError, match=r"unshard got 1 shards for a layout over 2 ranks"):
        ring_layout("zigzag", 2).unshard([torch.zeros(1, 4)])


def test_packed_document_metadata():
    assert doc_ids_from_cu_seqlens([0, 3, 7], 9).tolist() == [0, 0, 0, 1, 1, 1, 1, -1, -1]
    assert positions_from_cu_seqlens([0, 3, 7], 9).tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5]
    assert positions_from_cu_seqlens(torch.tensor([0, 2, 5]), 5).tolist() == [0, 1, 0, 1, 2]
    with pytest.raises(LayoutError, match=r"cu_seqlens=\[1, 4\] must start at 0"):
        doc_ids_from_cu_seqlens([1, 4], 4)
    with pytest.raises(LayoutError, match=r"strictly increasing"):
        doc_ids_from_cu_seqlens([0, 3, 3, 4], 4)
    with pytest.raises(LayoutError, match=r"cu_seqlens ends at 9, beyond the sequence length 8"):
        doc_ids_from_cu_seqlens([0, 9], 8)


def test_layout_error_is_public_and_a_value_error():
    import ds_seqpar

    assert ds_seqpar.LayoutError is LayoutError and issubclass(LayoutError, ValueError)
    with pytest.raises(ds_seqpar.LayoutError, match=r"sequence length 6 .* pad it to 8"):
        ring_layout("zigzag", 2).check_length(6)
