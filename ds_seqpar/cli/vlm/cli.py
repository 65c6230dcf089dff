"""``train.py --data`` with multimodal records: the checks of ``parse_args`` (before any process group), the
datasets of the curriculum's phases, and the processor's files next to the export (docs/multimodal_data.md,
"With train.py"); the loaders are ``loaders.py``'s."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from ds_seqpar.cli.vlm.encode import EncodedRecord
from ds_seqpar.cli.vlm.families import family_of
from ds_seqpar.cli.vlm.packing import PackedVlmDataset, position_function
from ds_seqpar.cli.vlm.records import has_vision
from ds_seqpar.errors import SeqParConfigError

# train.py flags the multimodal reader does not honour, with their default (what "not given" is)
UNHONOURED = {
    "objective": ("causal", "the masked-LM objective has no vision-language model"),
    "packing": ("fixed", "multimodal records are packed whole, in file order"),
    "text_field": ("text", "the record format names its fields: text, prompt, images, videos"),
    "eval_data": (None, "the held-out text set is read by the text reader"),
    "eval_generate": (False, "the passkey generation check is for the text task"),
}


def check_vlm_data(args: argparse.Namespace, config: Any, model_path: str) -> list[EncodedRecord] | None:
    """``--data``'s records encoded by the model's processor when it has images / videos (else None);
    refuses a text-only model, a flag the reader does not honour, and every defect of the records."""
    if args.data is None or not has_vision(args.data):
        return None
    if getattr(config, "vision_config", None) is None:
        raise SeqParConfigError(
            f"--data {args.data} has records with images / videos, but the model at {model_path} (model_type "
            f"{getattr(config, 'model_type', None)!r}) has no vision_config: the text reader would drop the "
            "images; fix: a vision-language model (e.g. --model assets/tiny-qwen2-vl --random-init), or "
            "records without images / videos"
        )
    for flag, (default, why) in UNHONOURED.items():
        value = getattr(args, flag, default)
        if value != default:
            raise SeqParConfigError(
                f"--{flag.replace('_', '-')} {value!r} with multimodal --data {args.data}: not honoured ({why}); "
                f"fix: drop --{flag.replace('_', '-')}"
            )
    from ds_seqpar.cli.vlm import read_vlm_data

    shortest = min(seq for seq, _ in args.phases)  # every record must fit a row of every phase
    return read_vlm_data(args.data, str(model_path), config, shortest)


def vlm_datasets(args: argparse.Namespace, model: Any, pad_token_id: int) -> tuple[list[Any], Any]:
    """One packed dataset per curriculum phase and the held-out rows (the last rows at ``--seq-len``,
    ``min(--eval-samples, rows // 10)``, at least 1, as for text)."""
    family = family_of(model.config)
    positions = position_function(family, model)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    per_step = world // args.settings.size * int(args.ds_config_dict.get("train_micro_batch_size_per_gpu", 1))
    train, held = [], None
    for seq_len, _ in args.phases:
        data = PackedVlmDataset(args.vlm_records, seq_len, positions, pad_token_id)
        n_eval = min(args.eval_samples, max(1, len(data) // 10))
        keep = range(len(data) - n_eval) if len(data) > n_eval else range(len(data))
        if len(keep) < per_step:  # the same on every rank, before any collective
            raise SeqParConfigError(
                f"--data {args.data}: {len(keep)} training rows of {seq_len} tokens (after {n_eval} held out), fewer "
                f"than the {per_step} rows one step reads (dp x micro batch); fix: more records, a shorter "
                "--seq-len, or a larger --sp-size"
            )
        train.append(torch.utils.data.Subset(data, keep))
        if seq_len == args.seq_len:
            held = torch.utils.data.Subset(data, range(len(data) - n_eval, len(data)))
    return train, held


PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")


def copy_processor_files(model_path: str, out_dir: str) -> list[str]:
    """The processor's configs of ``model_path`` next to the exported model (``AutoProcessor`` loads it from
    there); returns the files copied."""
    import os
    import shutil

    copied = []
    for name in PROCESSOR_FILES + tuple(n for n in os.listdir(model_path) if n.startswith("chat_template")):
        if os.path.isfile(os.path.join(model_path, name)):
            shutil.copy(os.path.join(model_path, name), os.path.join(out_dir, name))
            copied.append(name)
    return copied
