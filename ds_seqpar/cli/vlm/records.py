"""Read multimodal JSON Lines records (docs/multimodal_data.md, "Record format").

One JSON object per line::

    {"prompt": "<image> what is in the picture ?", "text": "a red square .", "images": ["img/a.png"],
     "videos": [["vid/b/0.png", "vid/b/1.png", "vid/b/2.png", "vid/b/3.png"]]}

``text`` (required) is trained on; ``prompt`` (optional) comes before it and gets no label. Each ``<image>``
in prompt + text stands for the next entry of ``images``, each ``<video>`` for the next entry of ``videos``
(a list of frame files). Paths are relative to the JSONL file's folder (absolute paths as they are). Every
defect (not JSON, an unknown field, a count of placeholders that is not the count of files, a missing or
unreadable file) raises ``SeqParConfigError`` naming file, line and fix, before any process group exists.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from ds_seqpar.errors import MissingFileError, SeqParConfigError

IMAGE, VIDEO = "<image>", "<video>"
FIELDS = ("text", "prompt", "images", "videos", "fps")
EXAMPLE = '{"prompt": "<image> what is in the picture ?", "text": "a red square .", "images": ["img/a.png"]}'


@dataclass(frozen=True)
class VlmRecord:
    """One record: ``where`` (``file:line``), prompt (``""`` if none), text, and the absolute paths of its
    images and of each video's frames, in placeholder order; ``fps``: frames per second of the listed frames
    of every video of the record, or None."""

    where: str
    prompt: str
    text: str
    images: tuple[str, ...]
    videos: tuple[tuple[str, ...], ...]
    fps: float | None = None


def has_vision(path: str) -> bool:
    """Whether any record of the JSONL file at ``path`` has a non-empty ``images`` or ``videos`` field."""
    if not path.endswith((".jsonl", ".json")) or not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and (record.get("images") or record.get("videos")):
                return True
    return False


def read_records(path: str) -> list[VlmRecord]:
    """Every record of the JSONL file at ``path``, checked; files are opened with Pillow once."""
    if not os.path.isfile(path):
        raise MissingFileError(f"--data {path!r} does not exist; pass a .jsonl file of multimodal records")
    folder = os.path.dirname(os.path.abspath(path))
    records = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                records.append(_record(_json_object(line, f"{path}:{lineno}"), f"{path}:{lineno}", folder))
    if not records:
        raise SeqParConfigError(f"--data {path}: no record; each line must be one object such as {EXAMPLE}")
    return records


def _json_object(line: str, where: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise SeqParConfigError(
            f"{where} is not valid JSON ({exc.msg} at column {exc.colno}); each line must be one object such "
            f"as {EXAMPLE}"
        ) from None
    if not isinstance(record, dict):
        raise SeqParConfigError(
            f"{where} is not a JSON object; each line must be one object such as {EXAMPLE}"
        )
    unknown = sorted(set(record) - set(FIELDS))
    if unknown:
        raise SeqParConfigError(
            f"{where}: fields {unknown} are not read by the multimodal reader (valid: {', '.join(FIELDS)}); "
            "fix: remove them (audio and other inputs are not supported), or convert them to these fields"
        )
    return record


def _record(record: dict[str, Any], where: str, folder: str) -> VlmRecord:
    text, prompt = record.get("text"), record.get("prompt", "")
    for name, value in (("text", text), ("prompt", prompt)):
        if not isinstance(value, str):
            raise SeqParConfigError(
                f"{where}: field {name!r} must be a string, got {value!r}; e.g. {EXAMPLE}"
            )
    if not text.strip():
        raise SeqParConfigError(f"{where}: field 'text' is blank; it holds what the model is trained on")
    images = _paths(record.get("images", []), f"{where}: field 'images'", folder)
    videos = record.get("videos", [])
    if not isinstance(videos, list):
        raise SeqParConfigError(f"{where}: field 'videos' must be a list of frame lists, got {videos!r}")
    frames = tuple(
        _paths(v, f"{where}: field 'videos'[{i}]", folder, video=True) for i, v in enumerate(videos)
    )
    both = prompt + text
    for token, files, name in ((IMAGE, images, "images"), (VIDEO, frames, "videos")):
        if both.count(token) != len(files):
            raise SeqParConfigError(
                f"{where}: {both.count(token)} {token} placeholders in prompt + text but {len(files)} {name}; "
                f"fix: one {token} per entry of {name!r}, at the place the model should see it"
            )
    fps = record.get("fps")
    if fps is not None and (
        isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0 or not frames
    ):
        raise SeqParConfigError(
            f"{where}: field 'fps' must be a number > 0 (frames per second of the listed frames) on a record with "
            f"videos, got {fps!r}"
        )
    return VlmRecord(where, prompt, text, images, frames, None if fps is None else float(fps))


def _paths(value: Any, where: str, folder: str, video: bool = False) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        kind = "a list of frame file paths" if video else "a list of image file paths"
        raise SeqParConfigError(f"{where} must be {kind}, got {value!r}")
    if video and not value:
        raise SeqParConfigError(f"{where} has no frame; a video is a non-empty list of frame files")
    paths = tuple(p if os.path.isabs(p) else os.path.join(folder, p) for p in value)
    for given, path in zip(value, paths):
        _check_image(given, path, where)
    return paths


def _check_image(given: str, path: str, where: str) -> None:
    from PIL import Image, UnidentifiedImageError

    if not os.path.isfile(path):
        raise MissingFileError(
            f"{where}: {given!r} does not exist (looked for {path}); paths are relative to the JSONL file's folder"
        )
    try:
        with Image.open(path) as image:
            image.verify()
    except (UnidentifiedImageError, OSError) as exc:
        raise SeqParConfigError(f"{where}: {given!r} is not an image Pillow can read ({exc})") from None


def load_images(paths: tuple[str, ...]) -> list[Any]:
    """The files as RGB Pillow images."""
    from PIL import Image

    out = []
    for path in paths:
        with Image.open(path) as image:
            out.append(image.convert("RGB"))
    return out
