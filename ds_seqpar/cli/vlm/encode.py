"""One record through the model's own processor: token ids, labels and the vision inputs.

Labels (docs/multimodal_data.md, "Labels"): the input ids, with -100 at every visual token of the family
(image / video placeholders, vision start / end), at the prompt's tokens, and at the first token of the
document (nothing before it in the document predicts it). The tokenizer's EOS ends each document and is
labelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ds_seqpar.cli.vlm.families import TOKEN_KEYS, VlmFamily, masked_token_ids
from ds_seqpar.cli.vlm.records import IMAGE, VIDEO, VlmRecord, load_images
from ds_seqpar.cli.vlm.video import check_video_config
from ds_seqpar.errors import SeqParConfigError

IGNORE_INDEX = -100


@dataclass
class EncodedRecord:
    """``input_ids``, ``labels``, ``mm_token_type_ids``: ``[L]``; ``vision``: the processor's vision outputs
    (e.g. ``pixel_values [patches, C*T*P*P]``, ``image_grid_thw [images, 3]``)."""

    where: str
    input_ids: torch.Tensor
    labels: torch.Tensor
    mm_token_type_ids: torch.Tensor
    vision: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.input_ids.numel())


class VlmEncoder:
    """Runs ``processor`` on records of ``family``; ``config`` is the model config (its token ids)."""

    def __init__(
        self,
        processor: Any,
        family: VlmFamily,
        config: Any,
        videos_supported: bool = True,
        model_path: str | None = None,
    ):
        self.processor, self.family = processor, family
        self.videos_supported = videos_supported
        self.model_path = model_path  # its video processor config is checked before the first own-path video
        self.video_config_checked = False
        self.masked = torch.tensor(masked_token_ids(family, config))
        self.eos_id = processor.tokenizer.eos_token_id

    def encode(self, record: VlmRecord) -> EncodedRecord:
        """The record's tokens, labels and vision inputs (``[L]`` each)."""
        self._check(record)
        out = self._process(
            record.prompt + record.text, record.images, record.videos, record.where, record.fps
        )
        ids = out["input_ids"][0].long()
        mm = out.get("mm_token_type_ids", torch.zeros_like(ids[None]))[0].long()
        n_prompt = self._prompt_length(record, ids) if record.prompt else 0
        if self.eos_id is not None:
            ids = torch.cat([ids, ids.new_tensor([self.eos_id])])
            mm = torch.cat([mm, mm.new_zeros(1)])
        labels = ids.clone()
        labels[:n_prompt] = IGNORE_INDEX
        labels[torch.isin(ids, self.masked)] = IGNORE_INDEX
        labels[0] = IGNORE_INDEX
        vision = {k: v for k, v in out.items() if k in self.family.vision_keys}
        return EncodedRecord(record.where, ids, labels, mm, vision)

    def _check(self, record: VlmRecord) -> None:
        if record.videos and not self.family.videos:
            raise SeqParConfigError(
                f"{record.where}: a record with videos; model_type {self.family.model_type!r} is read for images "
                f"only ({self.family.no_videos}); fix: drop the videos, or train a family that reads them"
            )
        if record.videos and self.family.video_seconds and record.fps is None:
            raise SeqParConfigError(
                f"{record.where}: a record with videos and no 'fps'; model_type {self.family.model_type!r} spaces "
                'a video\'s temporal patches by second_per_grid_ts = temporal_patch_size / fps; fix: add "fps": '
                "the frames per second of the listed frames"
            )
        if record.videos and self.family.encode_video is not None:
            self._check_video_config()
        elif record.videos and not self.videos_supported:
            raise SeqParConfigError(
                f"{record.where}: a record with videos, but transformers' video processor needs torchvision, "
                "which is not installed; fix: pip install torchvision (the build matching your torch), or "
                "drop the videos"
            )
        for token in self.family.reserved:
            if token in record.prompt + record.text:
                raise SeqParConfigError(
                    f"{record.where}: the text holds the family's own token {token!r}; fix: write {IMAGE} / "
                    f"{VIDEO} where an image / video goes (the reader inserts {self.family.image_text!r})"
                )

    def _check_video_config(self) -> None:
        if not self.video_config_checked:
            if self.model_path is None:
                raise SeqParConfigError(
                    "VlmEncoder(model_path=None) got a record with videos; the video processor config must be "
                    "checked; fix: pass model_path"
                )
            check_video_config(self.model_path, self.processor.image_processor)
            self.video_config_checked = True

    def _process(
        self, text: str, images: tuple, videos: tuple, where: str, fps: float | None = None
    ) -> dict[str, torch.Tensor]:
        text = text.replace(IMAGE, self.family.image_text)
        own = self.family.encode_video is not None and bool(videos)
        # own path: the processor sees each video as its text with no video token (it refuses video tokens
        # without videos); the tokens are inserted after it ran (_insert_videos)
        video_text = self.family.video_text.replace(self.processor.video_token, "") if own else None
        text = text.replace(VIDEO, video_text or self.family.video_text)
        out = dict(
            self.processor(
                text=[text],
                images=load_images(images) if images else None,
                videos=[load_images(v) for v in videos] if videos and not own else None,
                return_tensors="pt",
            )
        )
        if own:
            out = self._insert_videos(out, videos, where)
            if self.family.video_seconds:
                tp = int(self.processor.image_processor.temporal_patch_size)
                out["second_per_grid_ts"] = torch.full((len(videos),), tp / fps)
        unknown = sorted(k for k in out if k not in TOKEN_KEYS and k not in self.family.vision_keys)
        if unknown:
            raise SeqParConfigError(
                f"{where}: the processor returned {unknown}, which the reader does not pack (it packs "
                f"{', '.join(TOKEN_KEYS + self.family.vision_keys)}); fix: a processor configured without "
                "them, or extend the VlmFamily of this model type"
            )
        return out

    def _insert_videos(
        self, out: dict[str, torch.Tensor], videos: tuple, where: str
    ) -> dict[str, torch.Tensor]:
        """Each video through ``family.encode_video``, and its t*h*w/merge^2 video tokens (``[1, L]`` keys,
        modality type 2) put between the vision start / end tokens of its (empty) video text, in order."""
        head, tail = self.family.video_text.split(self.processor.video_token)
        start, end = self.processor.tokenizer.convert_tokens_to_ids([head, tail])
        ids = out["input_ids"][0]
        slots = [i + 1 for i in range(len(ids) - 1) if ids[i] == start and ids[i + 1] == end]
        if len(slots) != len(videos):
            raise SeqParConfigError(
                f"{where}: {len(slots)} empty video slots {head}{tail} in the tokens for {len(videos)} videos; "
                f"fix: write {VIDEO} where a video goes and not {head}{tail}"
            )
        merge = int(self.processor.image_processor.merge_size)
        built = [
            self.family.encode_video(self.processor.image_processor, load_images(v), where) for v in videos
        ]
        counts = [int(b["video_grid_thw"][0].prod()) // merge**2 for b in built]
        fill = {"input_ids": self.processor.video_token_id, "attention_mask": 1, "mm_token_type_ids": 2}
        for key in [k for k in TOKEN_KEYS if k in out]:
            row, pieces, last = out[key][0], [], 0
            for slot, n in zip(slots, counts):
                pieces += [row[last:slot], row.new_full((n,), fill[key])]
                last = slot
            out[key] = torch.cat([*pieces, row[last:]])[None]
        return out | {k: torch.cat([b[k] for b in built]) for k in built[0]}

    def _prompt_length(self, record: VlmRecord, ids: torch.Tensor) -> int:
        """Tokens of the prompt alone (its own images / videos), which must be a prefix of the record's."""
        n_img, n_vid = record.prompt.count(IMAGE), record.prompt.count(VIDEO)
        prompt = self._process(
            record.prompt, record.images[:n_img], record.videos[:n_vid], record.where, record.fps
        )
        head = prompt["input_ids"][0].long()
        if len(head) > len(ids) or not torch.equal(ids[: len(head)], head):
            raise SeqParConfigError(
                f"{record.where}: the tokens of the prompt alone are not the first tokens of prompt + text (the "
                "tokenizer merges across the boundary); fix: end the prompt with a space or a newline"
            )
        return len(head)
