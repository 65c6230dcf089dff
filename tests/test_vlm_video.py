"""Videos without torchvision (ds_seqpar/cli/vlm/video.py, docs/multimodal_data.md "Videos"): the frames through
the image processor, grouped by temporal patch in the Qwen2-VL video layout; one process, the shipped tiny
Qwen2-VL and assets/vlm_data (videos.jsonl, mixed.jsonl)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText

from ds_seqpar.cli.vlm import (
    PackedVlmDataset,
    collate_vlm,
    family_of,
    hf_inputs,
    load_processor,
    position_function,
    read_vlm_data,
    reference_loss,
)
from ds_seqpar.cli.vlm.video import qwen2_vl_video, unpatchify_video
from ds_seqpar.errors import SeqParConfigError

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "assets" / "tiny-qwen2-vl")
DATA = ROOT / "assets" / "vlm_data"


@pytest.fixture(scope="module")
def config():
    return AutoConfig.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def image_processor():
    return load_processor(MODEL)[0].image_processor


@pytest.fixture(scope="module")
def model(config):
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()


def _noise(seed: int, width: int = 90, height: int = 60) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def test_a_frame_twice_is_that_frame_as_an_image(image_processor):
    """The image processor repeats one image over the temporal patch: a 2-frame video of it is the same."""
    frame = _noise(0)
    image = image_processor(images=[frame], return_tensors="pt")
    video = qwen2_vl_video(image_processor, [frame, frame], "x")
    assert torch.equal(video["pixel_values_videos"], image["pixel_values"])
    assert torch.equal(video["video_grid_thw"], image["image_grid_thw"])


def test_frames_and_patches_in_order(image_processor):
    """3 different 90 x 60 frames: smart_resize to 84 x 56, grid (2, 4, 6), the odd last frame repeated; the
    inverse of the layout gives each frame resized (Pillow bicubic) and normalized, in order."""
    frames = [_noise(s) for s in (1, 2, 3)]
    video = qwen2_vl_video(image_processor, frames, "x")
    assert video["video_grid_thw"].tolist() == [[2, 4, 6]]
    assert video["pixel_values_videos"].shape == (2 * 4 * 6, 3 * 2 * 14 * 14)
    got = unpatchify_video(video["pixel_values_videos"], (2, 4, 6), 14, 2, 2)
    mean = torch.tensor(image_processor.image_mean)[:, None, None]
    std = torch.tensor(image_processor.image_std)[:, None, None]
    want = []
    for f in [*frames, frames[-1]]:
        pixels = np.asarray(f.resize((84, 56), Image.Resampling.BICUBIC), dtype=np.float32) / 255.0
        want.append((torch.from_numpy(pixels).permute(2, 0, 1) - mean) / std)
    assert (got - torch.stack(want)).abs().max() <= 1e-5


def test_video_record_tokens_positions_and_loss(config, model):
    """A videos.jsonl record: the video token repeated t*h*w/4 = 8 times between vision start / end (what the
    processor's expansion gives), modality type 2, never labelled; get_rope_index gives its tokens
    (t, h, w) positions from where the video starts; the plain HF forward's loss is finite."""
    processor = load_processor(MODEL)[0]
    rec = read_vlm_data(str(DATA / "videos.jsonl"), MODEL, config, 256)[0]
    assert rec.vision["video_grid_thw"].tolist() == [[2, 4, 4]]
    text = (
        "<|vision_start|>"
        + "<|video_pad|>" * 8
        + "<|vision_end|> which way does the square go ? it moves right ."
    )
    want = processor.tokenizer(text)["input_ids"] + [processor.tokenizer.eos_token_id]
    assert rec.input_ids.tolist() == want
    assert rec.mm_token_type_ids.tolist() == processor.create_mm_token_type_ids([want])[0]
    video = rec.input_ids == config.video_token_id
    assert (
        int(video.sum()) == 8
        and (rec.mm_token_type_ids[video] == 2).all()
        and (rec.labels[video] == -100).all()
    )
    pos, _ = model.model.get_rope_index(
        rec.input_ids[None],
        mm_token_type_ids=rec.mm_token_type_ids[None],
        video_grid_thw=rec.vision["video_grid_thw"],
    )
    grid = torch.stack(torch.meshgrid(torch.arange(2), torch.arange(2), torch.arange(2), indexing="ij")).view(
        3, 8
    )
    assert torch.equal(pos[:, 0, 1:9], grid + 1)  # the vision start token is position 0
    with torch.no_grad():
        assert torch.isfinite(reference_loss(model, [rec]))


def test_mixed_images_and_videos_pack_like_each_record_alone(config, model):
    """mixed.jsonl (images, videos, one record with both) packed into rows of 128: each record's positions are
    its own rope index, the vision inputs are concatenated in record order, and the rows through the plain HF
    forward give the token-weighted loss of each record alone."""
    records = read_vlm_data(str(DATA / "mixed.jsonl"), MODEL, config, 128)
    data = PackedVlmDataset(records, 128, position_function(family_of(config), model))
    batch = collate_vlm([data[i] for i in range(len(data))])
    assert torch.equal(
        batch["video_grid_thw"],
        torch.cat([r.vision["video_grid_thw"] for r in records if "video_grid_thw" in r.vision]),
    )
    for r, row in enumerate(data.rows):
        start = 0
        for i in row:
            rec = records[i]
            grids = {k: v for k, v in rec.vision.items() if k.endswith("grid_thw")}
            own, _ = model.model.get_rope_index(
                rec.input_ids[None], mm_token_type_ids=rec.mm_token_type_ids[None], **grids
            )
            assert torch.equal(data[r]["position_ids"][:, start : start + len(rec)], own[:, 0])
            start += len(rec)
    with torch.no_grad():
        packed = model(**hf_inputs(batch)).loss
        alone = reference_loss(model, records)
    assert abs(packed.item() - alone.item()) <= 1e-5 * abs(alone.item()), (packed.item(), alone.item())


def _model_with_video_config(folder: Path, **changes) -> str:
    shutil.copytree(MODEL, folder, dirs_exist_ok=True)
    path = folder / "video_preprocessor_config.json"
    settings = json.loads(path.read_text())
    settings.update(changes)
    path.write_text(json.dumps(settings))
    return str(folder)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"do_sample_frames": True}, r"do_sample_frames=True, which the video reader does not honour"),
        ({"fps": 2}, r"fps=2, which the video reader does not honour"),
        ({"max_frames": 16}, r"max_frames=16, which the video reader does not honour"),
        ({"size": {"shortest_edge": 3136, "longest_edge": 12544}}, r"size=.* but the image processor has"),
        ({"temporal_patch_size": 1}, r"temporal_patch_size=1 but the image processor has 2"),
    ],
    ids=["sample_frames", "fps", "max_frames", "size", "temporal_patch"],
)
def test_video_processor_settings_not_honoured_are_refused(config, tmp_path, changes, message):
    path = _model_with_video_config(tmp_path / "m", **changes)
    with pytest.raises(SeqParConfigError, match=message):
        read_vlm_data(str(DATA / "videos.jsonl"), path, config, 256)
    read_vlm_data(str(DATA / "train.jsonl"), path, config, 256)  # images only: the video config is not read


def test_frames_of_different_sizes_and_a_missing_video_config_are_refused(config, tmp_path):
    _noise(0).save(tmp_path / "a.png")
    _noise(1, 140, 140).save(tmp_path / "b.png")
    line = {"prompt": "<video> ", "text": "it moves right .", "videos": [["a.png", "b.png"]]}
    (tmp_path / "v.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.raises(
        SeqParConfigError, match=r"v.jsonl:1: the frames of a video resize to different grids"
    ):
        read_vlm_data(str(tmp_path / "v.jsonl"), MODEL, config, 256)
    path = _model_with_video_config(tmp_path / "m")
    (tmp_path / "m" / "video_preprocessor_config.json").unlink()
    with pytest.raises(SeqParConfigError, match=r"has no video_preprocessor_config.json"):
        read_vlm_data(str(DATA / "videos.jsonl"), path, config, 256)
