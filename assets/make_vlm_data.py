"""Regenerate ``assets/vlm_data``: a tiny multimodal data set for ``assets/tiny-qwen2-vl``.

Run once: ``.venv/bin/python assets/make_vlm_data.py``. The files it writes are committed. Images are
coloured shapes on black (56 x 56 = 4 image tokens, 84 x 84 = 9); videos are 4 frames of 56 x 56 of a white
square that moves one way (2 x 2 x 2 video tokens). ``train.jsonl``: 16 records with images (and 2 text
only); ``videos.jsonl``: 4 records with videos; ``mixed.jsonl``: 6 image records, the 4 video records between
them, and one record with an image and a video.
The record format is docs/multimodal_data.md's.
"""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image, ImageDraw

OUT = Path(__file__).resolve().parent / "vlm_data"
COLORS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 60, 230), "yellow": (230, 220, 30)}
SHAPES = ("square", "circle")
MOVES = {"right": (1, 0), "left": (-1, 0), "down": (0, 1), "up": (0, -1)}


def shape_image(color: str, shape: str, size: int) -> Image.Image:
    image = Image.new("RGB", (size, size), (0, 0, 0))
    draw = ImageDraw.Draw(image)
    box = (size // 4, size // 4, 3 * size // 4, 3 * size // 4)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLORS[color])
    return image


def video_frames(move: str, frames: int = 4, size: int = 56) -> list[Image.Image]:
    dx, dy = MOVES[move]
    out = []
    for t in range(frames):
        image = Image.new("RGB", (size, size), (0, 0, 0))
        x, y = size // 2 - 8 + dx * 6 * (t - 1), size // 2 - 8 + dy * 6 * (t - 1)
        ImageDraw.Draw(image).rectangle((x, y, x + 16, y + 16), fill=(255, 255, 255))
        out.append(image)
    return out


def image_records() -> list[dict]:
    records = []
    for i, (color, shape) in enumerate((c, s) for s in SHAPES for c in COLORS):
        size = 56 if i % 2 == 0 else 84
        name = f"img/{color}_{shape}.png"
        shape_image(color, shape, size).save(OUT / name)
        records.append({"prompt": "<image> what is in the picture ? ", "text": f"a {color} {shape} .",
                        "images": [name]})  # fmt: skip
        records.append({"prompt": "what color is it ? <image> ", "text": f"{color} .", "images": [name]})
    pairs = [("red_square", "blue_circle"), ("green_circle", "yellow_square")]
    for a, b in pairs:
        text = f"the first is a {a.replace('_', ' ')} and the second is a {b.replace('_', ' ')} ."
        records.append({"prompt": "<image> <image> describe it . ", "text": text,
                        "images": [f"img/{a}.png", f"img/{b}.png"]})  # fmt: skip
    records += [
        {"text": "a red square and a blue circle ."},
        {"text": "what is in the picture ? a green square ."},
    ]
    return records[:14] + records[-4:]


def video_records() -> list[dict]:
    records = []
    for move in MOVES:
        folder = OUT / "vid" / move
        folder.mkdir(parents=True, exist_ok=True)
        names = []
        for t, frame in enumerate(video_frames(move)):
            frame.save(folder / f"{t}.png")
            names.append(f"vid/{move}/{t}.png")
        records.append({"prompt": "<video> which way does the square go ? ", "text": f"it moves {move} .",
                        "videos": [names]})  # fmt: skip
    return records


def mixed_records(images: list[dict], videos: list[dict]) -> list[dict]:
    both = {"prompt": "<image> <video> the picture , then the video . ", "text": "it moves right .",
            "images": ["img/red_square.png"], "videos": videos[0]["videos"]}  # fmt: skip
    return [r for pair in zip(images[:4], videos) for r in pair] + images[4:6] + [both]


def main() -> None:
    (OUT / "img").mkdir(parents=True, exist_ok=True)
    images, videos = image_records(), video_records()
    files = (
        ("train.jsonl", images),
        ("videos.jsonl", videos),
        ("mixed.jsonl", mixed_records(images, videos)),
    )
    for name, records in files:
        with open(OUT / name, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    main()
