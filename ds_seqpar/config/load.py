"""Reading the section: from a dict (``parse_section``), with overrides (``with_overrides``), or out of a whole
DeepSpeed config file or dict (``load_config``), every problem reported in one ``SeqParConfigError``."""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from pydantic import ValidationError

from ds_seqpar.config.deepspeed_keys import check_deepspeed_keys
from ds_seqpar.config.messages import format_error
from ds_seqpar.config.section import SECTION, SequenceParallelConfig
from ds_seqpar.errors import SeqParConfigError
from ds_seqpar.settings import divisors

__all__ = ["current_world_size", "load_config", "parse_section", "with_overrides"]


def _fmt_choices(values: list[Any]) -> str:
    return ", ".join(str(v) for v in values)


def current_world_size() -> int:
    """The world size: torch.distributed's when it is up, else the launcher's ``WORLD_SIZE`` (1 alone)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    value = os.environ.get("WORLD_SIZE", "1")
    if not value.isdigit() or int(value) < 1:
        raise SeqParConfigError(f"WORLD_SIZE={value!r} in the environment is not a positive integer")
    return int(value)


def parse_section(section: dict[str, Any], world_size: int | None = None) -> SequenceParallelConfig:
    """Validate a ``sequence_parallel`` dict; raise ``SeqParConfigError`` listing every problem.

    ``size: "auto"`` is resolved here to ``world_size / data_parallel_size`` (``world_size`` defaults
    to :func:`current_world_size`), so the returned section always has an integer ``size``.
    """
    if not isinstance(section, dict):
        raise SeqParConfigError(
            f"{SECTION}={section!r} must be an object (JSON dict); valid: "
            f'{{"{SECTION}": {{"size": 8, "ulysses_degree": 2}}}}'
        )
    try:
        parsed = SequenceParallelConfig.model_validate(section)
    except ValidationError as exc:
        lines = [format_error(e) for e in exc.errors()]
        raise SeqParConfigError("\n".join(dict.fromkeys(lines))) from None
    if parsed.size != "auto":
        return parsed
    world = current_world_size() if world_size is None else world_size
    dp = parsed.data_parallel_size or 1
    if world % dp != 0:
        raise SeqParConfigError(
            f'sequence_parallel.size="auto" with data_parallel_size={dp}: {dp} does not divide the world size '
            f"{world}; valid: data_parallel_size in {_fmt_choices(divisors(world))}"
        )
    return parse_section({**section, "size": world // dp}, world)


def with_overrides(
    section: SequenceParallelConfig, changes: dict[str, Any], world_size: int | None = None
) -> SequenceParallelConfig:
    """``section`` with its top-level keys ``changes`` replaced, validated like the JSON (keys the user left
    unset stay unset, so their defaults and "auto" still apply): how flags override a config file."""
    return parse_section({**section.model_dump(exclude_unset=True), **changes}, world_size)


def load_config(
    config: str | os.PathLike[str] | dict[str, Any],
    world_size: int | None = None,
) -> tuple[SequenceParallelConfig, dict[str, Any]]:
    """Read a whole DeepSpeed config (path or dict) and split off the ``sequence_parallel`` section.

    ``world_size`` resolves ``size: "auto"`` (default: :func:`current_world_size`).

    Every other top-level key must be one DeepSpeed reads, and every key of ``zero_optimization`` a field
    of DeepSpeed's ZeRO config (``config/deepspeed_keys.py``): a typo is an error naming the file, the
    key and the closest valid key, before any process group exists.

    Returns:
        ``(section, ds_config)``: the validated section, and a copy of the DeepSpeed dict without the
        section and with DeepSpeed's own ``sequence_parallel_size`` set to ``section.size`` (1 when
        sequence parallelism is disabled).
    """
    source = "the DeepSpeed config dict"
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        source = f"DeepSpeed config '{path}'"
        if not os.path.isfile(path):
            raise SeqParConfigError(
                f"DeepSpeed config file '{path}' does not exist; valid: a path to a JSON file such as "
                "ds_configs/usp_zero3.json"
            )
        with open(path, encoding="utf-8") as fh:
            try:
                raw = json.load(fh)
            except json.JSONDecodeError as exc:
                raise SeqParConfigError(
                    f"DeepSpeed config file '{path}' is not valid JSON ({exc.msg} at line {exc.lineno}, "
                    f"column {exc.colno}); fix the JSON syntax there"
                ) from None
    elif isinstance(config, dict):
        raw = config
    else:
        raise SeqParConfigError(
            f"config={type(config).__name__} is not supported; valid: a path to a DeepSpeed JSON file or a dict"
        )
    ds_config = copy.deepcopy(raw)
    if SECTION not in ds_config:
        raise SeqParConfigError(
            f"the DeepSpeed config has no '{SECTION}' section; valid: add "
            f'"{SECTION}": {{"size": <ranks per sequence>}} (see docs/configuration.md)'
        )
    check_deepspeed_keys(ds_config, source)
    section = parse_section(ds_config.pop(SECTION), world_size)
    sp_size = section.size if section.enabled else 1
    existing = ds_config.get("sequence_parallel_size")
    if existing is not None and existing != sp_size:
        raise SeqParConfigError(
            f"sequence_parallel_size={existing} (DeepSpeed's key) disagrees with {SECTION}.size={sp_size}; "
            f"valid: remove sequence_parallel_size or set it to {sp_size}"
        )
    ds_config["sequence_parallel_size"] = sp_size
    return section, ds_config
