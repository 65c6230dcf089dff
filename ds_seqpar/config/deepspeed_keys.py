"""The DeepSpeed keys a config may hold next to the section, taken from DeepSpeed itself, so a typo such as
``"zero_optimisation"`` (which DeepSpeed would ignore: the run trains without ZeRO) is refused by name.

* Top level: the keys ``DeepSpeedConfig._initialize_params`` and ``_do_warning_check`` read (the getters
  of DeepSpeed's ``runtime/config.py`` and every sub-config they build: ZeRO, activation checkpointing,
  comms logger, monitors, flops profiler, autotuning, data efficiency, checkpoint, AIO, compile, ...),
  found by running them on a dict that records every key asked for; plus ``EXTRA_TOP_LEVEL_KEYS``, read
  elsewhere by DeepSpeed; plus the section.
  HF Trainer and accelerate write only DeepSpeed's own keys into the config (their ``"auto"`` values are
  filled in place), so they need nothing more.
* Inside ``zero_optimization``: the fields and aliases of the pydantic ``DeepSpeedZeroConfig`` (and of
  its sub-models, e.g. ``offload_param``), which DeepSpeed itself only checks at ``deepspeed.initialize``,
  after the process groups exist.
* Keys DeepSpeed has removed (``nebula``, ``amp``, ``elasticity``, ...): DeepSpeed's own message.

Values are not checked here (DeepSpeed does that, and HF's ``"auto"`` values stay accepted).
"""

from __future__ import annotations

import difflib
import functools
import logging
from typing import Any

from pydantic import AliasChoices, BaseModel

from ds_seqpar.config.messages import submodel
from ds_seqpar.config.section import SECTION
from ds_seqpar.errors import SeqParConfigError

__all__ = [
    "EXTRA_TOP_LEVEL_KEYS",
    "check_deepspeed_keys",
    "deepspeed_top_level_keys",
    "model_keys",
    "zero_config_model",
]

log = logging.getLogger(__name__)

EXTRA_TOP_LEVEL_KEYS = {
    "sequence_parallel_size": "DeepSpeedConfig.__init__ and deepspeed.initialize (load_config sets it)",
    "data_parallel_size": "deepspeed.initialize (with sequence_parallel_size: its mesh device)",
    "allgather_size": 'read_zero_config_deprecated (the old "zero_optimization": true form)',
}
"""Top-level keys DeepSpeed 0.19.8 reads outside ``_initialize_params`` (key -> where)."""

ZERO = "zero_optimization"


class _ReadRecorder(dict):
    """A dict that records every key looked up in it (``get``, ``[]``, ``in``, ``keys()``)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.seen: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.seen.add(key)  # type: ignore[arg-type]
        return super().__contains__(key)

    def keys(self) -> Any:  # `KEY in param_dict.keys()` is how several getters ask
        return _RecordedKeys(self)


class _RecordedKeys:
    def __init__(self, owner: _ReadRecorder) -> None:
        self.owner = owner

    def __contains__(self, key: object) -> bool:
        return key in self.owner

    def __iter__(self) -> Any:
        return iter(dict.keys(self.owner))

    def __len__(self) -> int:
        return dict.__len__(self.owner)


@functools.cache
def deepspeed_top_level_keys() -> frozenset[str] | None:
    """Every top-level key DeepSpeed reads, or None (logged once) when this DeepSpeed cannot be probed."""
    try:
        from deepspeed.runtime.config import DeepSpeedConfig

        probe = _ReadRecorder({"train_micro_batch_size_per_gpu": 1})  # non-empty: some getters skip {}
        config = DeepSpeedConfig.__new__(DeepSpeedConfig)
        config.world_size, config.global_rank, config._param_dict = 1, 0, probe
        config._initialize_params(probe)
        config._do_warning_check()  # reads vocabulary_size
    except Exception as exc:  # another DeepSpeed release: DeepSpeed alone checks the keys then
        log.warning(
            "could not read DeepSpeed's config keys (%s: %s); its top-level keys are not checked here",
            type(exc).__name__,
            exc,
        )
        return None
    return frozenset(k for k in probe.seen if isinstance(k, str)) | frozenset(EXTRA_TOP_LEVEL_KEYS)


@functools.cache
def deepspeed_version() -> str:
    """The installed DeepSpeed's version, for the messages."""
    try:
        from importlib.metadata import version

        return version("deepspeed")
    except Exception:  # pragma: no cover - DeepSpeed is a dependency
        return "(unknown version)"


def zero_config_model() -> type[BaseModel] | None:
    """DeepSpeed's ``DeepSpeedZeroConfig`` (None when it cannot be imported)."""
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except Exception:  # pragma: no cover - DeepSpeed is a dependency
        return None
    return DeepSpeedZeroConfig


def _alias_names(alias: Any) -> list[str]:
    if isinstance(alias, str):
        return [alias]
    if isinstance(alias, AliasChoices):
        return [c for c in alias.choices if isinstance(c, str)]
    return []


def model_keys(model: type[BaseModel]) -> dict[str, type[BaseModel] | None]:
    """The keys a pydantic model accepts (field names and their aliases) -> the sub-model each holds."""
    keys: dict[str, type[BaseModel] | None] = {}
    for name, field in model.model_fields.items():
        sub = submodel(field.annotation)
        for key in (name, *_alias_names(field.alias), *_alias_names(field.validation_alias)):
            keys[key] = sub
    return keys


def _unknown(key: str, where: str, valid: list[str]) -> str:
    """One line for an unknown key: the closest valid key, or (none close) every valid key."""
    close = difflib.get_close_matches(key, valid, n=1)
    place = f" in '{where.rstrip('.')}'" if where else " at the top level"
    fix = f"did you mean '{close[0]}'?" if close else f"valid keys{place}: {', '.join(sorted(valid))}"
    return (
        f"'{where}{key}' is not a DeepSpeed {deepspeed_version()} config key{place}, so DeepSpeed would "
        f"ignore it or fail late; {fix} (fix the spelling or remove the key)"
    )


def _model_problems(value: dict[str, Any], model: type[BaseModel], where: str) -> list[str]:
    """Unknown keys of ``value`` against ``model`` (and its sub-models, for dict values)."""
    keys = model_keys(model)
    problems: list[str] = []
    for key, item in value.items():
        if key not in keys:
            problems.append(_unknown(str(key), where, list(keys)))
        elif keys[key] is not None and isinstance(item, dict):
            problems.extend(_model_problems(item, keys[key], f"{where}{key}."))
    return problems


def _removed(ds_config: dict[str, Any]) -> list[str]:
    """DeepSpeed's own message for each key it has removed (it raises them at deepspeed.initialize)."""
    try:
        from deepspeed.runtime import config as ds_runtime_config
    except Exception:  # pragma: no cover - DeepSpeed is a dependency
        return []
    top = getattr(ds_runtime_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {})
    zero = getattr(ds_runtime_config, "_REMOVED_ZERO_CONFIG_KEYS", {})
    found = [f"'{key}': {message}" for key, message in top.items() if key in ds_config]
    inner = ds_config.get(ZERO)
    if isinstance(inner, dict):
        found += [f"'{ZERO}.{key}': {message}" for key, message in zero.items() if key in inner]
    return found


def check_deepspeed_keys(ds_config: dict[str, Any], source: str) -> None:
    """Raise ``SeqParConfigError`` naming ``source`` for every unknown or removed DeepSpeed key of
    ``ds_config`` (top level, and inside ``zero_optimization``), with the closest valid key."""
    problems = _removed(ds_config)
    removed = {p.split("'", 2)[1] for p in problems}
    top = deepspeed_top_level_keys()
    if top is not None:
        valid = sorted(top | {SECTION})
        problems += [_unknown(str(k), "", valid) for k in ds_config if k not in valid and k not in removed]
    zero, model = ds_config.get(ZERO), zero_config_model()
    if isinstance(zero, dict) and model is not None:
        problems += [p for p in _model_problems(zero, model, f"{ZERO}.") if p.split("'", 2)[1] not in removed]
    if problems:
        raise SeqParConfigError(f"{source}: " + f"\n{source}: ".join(problems))
