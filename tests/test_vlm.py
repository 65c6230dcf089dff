"""Vision-language models under SP vs the same model without SP (gloo, 4 ranks, tiny models from configs):
the loss and every gradient of the language model, the projector and the vision tower, with images cut by the
shards, several images per row, videos and packed documents; the split vision tower; ZeRO-3; refusals."""

from __future__ import annotations

import pytest

from ds_seqpar.integrations.vision.split_tower import assign_units
from tests.helpers.vlm_ab import (
    tower_split_vs_whole,
    vlm_refusals,
    vlm_sp_vs_reference,
    vlm_variant_vs_reference,
    vlm_zero3_vs_reference,
)
from tests.helpers.vlm_models import VIDEO_KINDS, VLM_KINDS


def spec_of(kind: str) -> list[list]:
    """Two images and a video (Gemma 3: three images) in one row, cut by the shards of 4 ranks."""
    middle = "video" if kind in VIDEO_KINDS else "image"
    return [[3 if kind == "qwen3_vl" else 5, "image", 7, middle, 3, "image", 4]]


def packed_spec(kind: str) -> list[list]:
    middle = "video" if kind in VIDEO_KINDS else "image"
    return [[5, "image", 3], [2, middle, 4, "image", 2], [6]]


MESHES = [(2, "zigzag"), (1, "zigzag")]  # U2 x R2, ring of 4


@pytest.mark.parametrize("kind", VLM_KINDS)
def test_vlm_loss_and_every_gradient_equal_the_plain_model(dist_pool, kind):
    for u, layout in MESHES:
        for rep in dist_pool(4).run(vlm_sp_vs_reference, kind, u, layout, spec_of(kind)):
            assert rep["split_runs"] >= 1, rep  # an image / video lies on two ranks' shards
            assert rep["vision_grads"] > 0, rep
            assert rep["loss_err"] <= 1e-5, (u, layout, rep)
            assert max(rep["grad"].values()) <= 1e-5, (u, layout, rep)


@pytest.mark.parametrize("kind", VLM_KINDS)
def test_two_rows_of_several_images_with_padding(dist_pool, kind):
    """B = 2: one row with an image and a video, one with three images, padded on the right; stripes of U2 x R2."""
    middle = "video" if kind in VIDEO_KINDS else "image"
    spec = [[5, "image", 7, middle, 3], [2, "image", 3, "image", 1, "image", 2]]
    for rep in dist_pool(4).run(vlm_sp_vs_reference, kind, 2, "stripe", spec):
        assert rep["split_runs"] >= 1, rep
        assert rep["loss_err"] <= 1e-5 and max(rep["grad"].values()) <= 1e-5, rep


@pytest.mark.parametrize("kind", VLM_KINDS)
def test_packed_multimodal_documents_equal_each_document_alone(dist_pool, kind):
    for rep in dist_pool(4).run(vlm_sp_vs_reference, kind, 2, "zigzag", packed_spec(kind), True):
        assert rep["loss_err"] <= 1e-5, rep
        assert max(rep["grad"].values()) <= 1e-5, rep


@pytest.mark.parametrize("kind", ["qwen2_vl", "llava_next_video"])
def test_split_vision_tower_equals_the_whole_tower(dist_pool, kind):
    """A video of 7 frames on 4 ranks: fp64 outputs and input gradients of the split tower equal the whole's."""
    for rep in dist_pool(4).run(tower_split_vs_whole, kind, 7):
        assert rep["split"], rep
        assert rep["units"] == 7, rep
        assert rep["out_err"] <= 1e-10 and rep["dx_err"] <= 1e-10, rep


def test_fewer_units_than_ranks_still_exact(dist_pool):
    """One image on 4 ranks: three ranks own no unit (they run the tower on a stand-in and contribute nothing)."""
    for rep in dist_pool(4).run(vlm_sp_vs_reference, "gemma3", 2, "zigzag", [[9, "image", 11]]):
        assert rep["loss_err"] <= 1e-5 and max(rep["grad"].values()) <= 1e-5, rep


@pytest.mark.parametrize(
    ("kind", "u", "packed"), [("qwen2_vl", 2, False), ("llava_onevision", 1, True), ("gemma3", 2, True)]
)
def test_vlm_under_zero3_matches_plain_training(dist_pool, kind, u, packed):
    spec = packed_spec(kind) if packed else spec_of(kind)
    for rep in dist_pool(4).run(vlm_zero3_vs_reference, kind, spec, u, packed):
        assert rep["loss_err"] <= 1e-5, rep
        assert max(rep["grad"].values()) <= 1e-5, rep


ZERO3_MATRIX = [(k, u, packed) for k in VLM_KINDS for u in (2, 1) for packed in (False, True)]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "u", "packed"), ZERO3_MATRIX)
def test_vlm_under_zero3_every_family_and_mesh(dist_pool, kind, u, packed):
    """Every family, U2 x R2 and a ring of 4, one row of images and a video cut by the shards, and packed documents."""
    spec = packed_spec(kind) if packed else spec_of(kind)
    for rep in dist_pool(4).run(vlm_zero3_vs_reference, kind, spec, u, packed):
        assert rep["loss_err"] <= 1e-5, rep
        assert max(rep["grad"].values()) <= 1e-5, rep


def test_assign_units_balances_whole_units():
    costs = [16, 16, 16, 64, 4, 4, 4, 4]
    owners = assign_units(costs, 4)
    load = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(4)]
    assert max(load) <= sum(costs) / 4 + max(costs)
    assert owners[3] == 0 and sorted(set(owners)) == [0, 1, 2, 3]
    assert assign_units([5], 4) == [0]


def test_refusals_name_what_they_cannot_honour(dist_pool):
    rep = dist_pool(4).run(vlm_refusals)[0]
    assert "token_type_ids" in rep["token_type_ids"] and "'paligemma'" in rep["token_type_ids"], rep
    assert "sees later tokens" in rep["probe"] and "query 6 sees key 7" in rep["probe"], rep
    assert "pixel_mask" in rep["unknown"], rep
    assert "cross_attention_states" in rep["language_keyword"], rep
    assert "language_model" in rep["text_model"], rep
    assert "grid_thw" in rep["grid"] and "16 patches" in rep["grid"], rep
    assert "mask" in rep["tower_tensor"], rep


@pytest.mark.parametrize("mode", ["gc", "lora", "memory"])
def test_checkpointing_lora_and_memory_savings_stay_exact(dist_pool, mode):
    """HF gradient checkpointing (the tower's layers recomputed in backward), PEFT LoRA, and ds_seqpar's layer
    checkpointing that re-runs the exchanges."""
    for worst in dist_pool(4).run(vlm_variant_vs_reference, "qwen2_vl", mode):
        assert worst <= 1e-10, worst
