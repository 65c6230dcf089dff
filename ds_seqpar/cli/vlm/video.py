"""A video's frame files as a Qwen2-VL-style video input, without torchvision (docs/multimodal_data.md, "Videos").

transformers' video processors need torchvision. The Qwen2-VL video layout is built here from the IMAGE
processor instead: each frame goes through the image processor (its smart_resize, rescale and normalization;
it returns the frame repeated over the temporal patch), one copy is kept, ``temporal_patch_size`` consecutive
frames are stacked into one temporal patch (an odd last frame repeated, as the video processor does), and
the rows keep the image path's patch order (t, h/merge, w/merge, merge, merge), each row (C, tp, p, p):

    pixel_values_videos  [T/tp * h * w, C * tp * p * p]      video_grid_thw  [1, 3] = (T/tp, h, w)

Nothing is communicated. The video processor's config (video_preprocessor_config.json) must describe the
same resize / normalization as the image processor's and sample no frames; anything else is refused by name.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ds_seqpar.errors import SeqParConfigError

# video processor settings that must equal the image processor's (the frames go through the latter)
SAME_AS_IMAGE = (
    "do_resize",
    "size",
    "resample",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "do_convert_rgb",
    "patch_size",
    "merge_size",
    "temporal_patch_size",
)
# video processor settings that would change which frames are used or their size; refused when set
NOT_HONOURED = ("do_sample_frames", "fps", "num_frames", "cap_pixels_per_frame", "max_frames", "min_frames")


def check_video_config(model_path: str, image_processor: Any) -> None:
    """Refuses (by name) a video processor config the frames-through-the-image-processor path would not honour."""
    path = os.path.join(model_path, "video_preprocessor_config.json")
    if not os.path.isfile(path):
        raise SeqParConfigError(
            f"{model_path} has no video_preprocessor_config.json; the reader builds videos with the image "
            "processor and must check the video processor describes the same frames; fix: save the processor "
            "with processor.save_pretrained(DIR) (transformers writes it), or drop the videos"
        )
    with open(path, encoding="utf-8") as fh:
        video = json.load(fh)
    image = json.loads(json.dumps(image_processor.to_dict(), default=str))  # tuples -> lists, as in the file
    for key in NOT_HONOURED:
        if video.get(key) not in (None, False):
            raise SeqParConfigError(
                f"{path}: {key}={video[key]!r}, which the video reader does not honour (it uses every frame "
                f"file as given, at the image processor's size); fix: remove {key} (sample the frames into the "
                "record's frame list instead)"
            )
    for key in SAME_AS_IMAGE:
        if key in video and video[key] != image.get(key):
            raise SeqParConfigError(
                f"{path}: {key}={video[key]!r} but the image processor has {image.get(key)!r}; the video reader "
                "resizes and normalizes frames with the image processor; fix: make the two configs agree"
            )


def qwen2_vl_video(image_processor: Any, frames: list[Any], where: str) -> dict[str, torch.Tensor]:
    """Frames (RGB Pillow images, one video) -> ``pixel_values_videos [T/tp*h*w, C*tp*p*p]`` and
    ``video_grid_thw [1, 3]``, the layout of transformers' Qwen2-VL video processor."""
    tp = int(image_processor.temporal_patch_size)
    out = image_processor(images=frames, return_tensors="pt")
    grids = out["image_grid_thw"]
    if not bool((grids == grids[0]).all()):
        raise SeqParConfigError(
            f"{where}: the frames of a video resize to different grids {sorted(set(map(tuple, grids.tolist())))}; "
            "fix: frames of one size per video"
        )
    _, gh, gw = (int(v) for v in grids[0])
    rows = gh * gw
    # [F, rows, C, tp, p, p]: each frame's patches, repeated tp times by the image processor; keep one copy
    per_frame = out["pixel_values"].view(len(frames), rows, -1, tp, *(image_processor.patch_size,) * 2)[
        :, :, :, 0
    ]
    if pad := -len(frames) % tp:
        per_frame = torch.cat([per_frame, per_frame[-1:].expand(pad, *per_frame.shape[1:])])
    t = per_frame.shape[0] // tp
    # [t, tp, rows, C, p, p] -> [t, rows, C, tp, p, p]
    grouped = per_frame.view(t, tp, *per_frame.shape[1:]).permute(0, 2, 3, 1, 4, 5)
    return {
        "pixel_values_videos": grouped.reshape(t * rows, -1).contiguous(),
        "video_grid_thw": torch.tensor([[t, gh, gw]]),
    }


def unpatchify_video(
    pixel_values_videos: torch.Tensor, grid_thw: tuple[int, int, int], patch: int, merge: int, tp: int
) -> torch.Tensor:
    """Inverse of the video layout for one video: ``[t*h*w, C*tp*p*p]`` -> frames ``[t*tp, C, h*p, w*p]``."""
    t, h, w = grid_thw
    x = pixel_values_videos.view(t, h // merge, w // merge, merge, merge, -1, tp, patch, patch)
    # (t, H/m, W/m, mh, mw, C, tp, ph, pw) -> (t, tp, C, H/m, mh, ph, W/m, mw, pw)
    x = x.permute(0, 6, 5, 1, 3, 7, 2, 4, 8)
    return x.reshape(t * tp, x.shape[2], h * patch, w * patch)
