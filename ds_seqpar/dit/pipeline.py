"""``load_pipeline``: a diffusers pipeline folder -> the pipeline, with weights or (``random_init=True``) with
seeded random weights built from the folder's configs (the tiny assets, docs/dit.md). Components the folder
does not hold (text encoders, tokenizers) are None: give the prompts as embeddings."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch

from ds_seqpar.errors import MissingFileError

__all__ = ["load_pipeline"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def _has_weights(folder: Path) -> bool:
    return folder.is_dir() and any(p.suffix in WEIGHT_SUFFIXES for p in folder.iterdir())


def load_pipeline(
    path: str | Path, *, random_init: bool = False, seed: int = 0, dtype: torch.dtype | None = None
) -> Any:
    """The pipeline of ``path`` (a folder with ``model_index.json``); see the module docstring."""
    import diffusers

    root = Path(path)
    index_file = root / "model_index.json"
    if not index_file.is_file():
        raise MissingFileError(
            f"{root}: no model_index.json; valid: a diffusers pipeline folder such as assets/tiny-pixart"
        )
    index = json.loads(index_file.read_text())
    pipeline_cls = getattr(diffusers, index["_class_name"])
    parts = {k: v for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[1]}
    missing = [k for k in parts if not (root / k).is_dir()]
    if missing:
        raise MissingFileError(
            f"{root}: model_index.json names {missing} but the folder has no such subfolder"
        )
    weighted = [k for k in parts if k != "scheduler" and _has_weights(root / k)]
    components: dict[str, Any] = {}
    if not random_init:
        unweighted = [k for k in parts if k not in ("scheduler", "tokenizer") and k not in weighted]
        if unweighted:
            raise MissingFileError(
                f"{root}: {unweighted} hold configs but no weights (*.safetensors / *.bin); pass random_init=True "
                "(--random-init) to build them with seeded random weights"
            )
    for name, (_library, class_name) in parts.items():
        cls = getattr(diffusers, class_name)
        config = cls.load_config(root / name)
        if name == "scheduler":
            components[name] = cls.from_config(config)
        elif random_init:
            torch.manual_seed(seed)
            components[name] = cls.from_config(config).eval()  # as from_pretrained leaves it
        else:
            components[name] = cls.from_pretrained(root / name)
        if dtype is not None and isinstance(components[name], torch.nn.Module):
            components[name] = components[name].to(dtype)
    signature = inspect.signature(pipeline_cls.__init__).parameters
    for name, parameter in signature.items():
        if name != "self" and name not in components and parameter.default is inspect.Parameter.empty:
            components[name] = None
    return pipeline_cls(**components)
