"""One readable line per pydantic error of the section: the key, the bad value and a valid alternative,
e.g. ``sequence_parallel.ulysses_degree=3 does not divide size=8; valid: 1, 2, 4, 8``."""

from __future__ import annotations

import difflib
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel

from ds_seqpar.config.section import SECTION, SequenceParallelConfig

__all__ = ["config_field_paths", "format_error"]


def _fmt_choices(values: list[Any]) -> str:
    return ", ".join(str(v) for v in values)


def config_field_paths(model: type[BaseModel] = SequenceParallelConfig, prefix: str = SECTION) -> list[str]:
    """Dotted names of every field, e.g. ``sequence_parallel.ring.layout`` (used by the docs test)."""
    paths: list[str] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}"
        paths.append(path)
        sub = submodel(field.annotation)
        if sub is not None:
            paths.extend(config_field_paths(sub, path))
    return paths


def submodel(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field's annotation holds (inside Optional / unions), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        sub = submodel(arg)
        if sub is not None:
            return sub
    return None


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel]:
    """The model class that owns the last element of a pydantic error location."""
    model: type[BaseModel] = SequenceParallelConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        sub = submodel(field.annotation) if field is not None else None
        if sub is None:
            break
        model = sub
    return model


def _literal_choices(annotation: Any) -> list[Any]:
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    out: list[Any] = []
    for arg in get_args(annotation):
        out.extend(_literal_choices(arg))
    return out


def _accepts_int(annotation: Any) -> bool:
    if annotation is int:
        return True
    return any(_accepts_int(arg) for arg in get_args(annotation))


def format_error(err: dict[str, Any]) -> str:
    """One readable line for one pydantic error: key, bad value, valid alternative."""
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p in {"int", "literal['auto']"}))
    loc = tuple(p for p in loc if not str(p).startswith(("constrained-int", "function-")))
    key = ".".join([SECTION, *(str(p) for p in loc)]) if loc else SECTION
    kind = err["type"]
    bad = err.get("input")
    if kind == "value_error":
        return str(err["ctx"]["error"]) if "ctx" in err else err["msg"]
    if kind == "extra_forbidden":
        owner = _model_at(loc)
        valid = list(owner.model_fields)
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"{key} is not a known key{hint}; valid keys: {_fmt_choices(valid)}"
    if kind == "missing":
        return f"{key} is required; e.g. {key}=8 (the number of ranks that split one sequence)"
    field = _model_at(loc).model_fields.get(str(loc[-1])) if loc else None
    annotation = field.annotation if field is not None else None
    choices = _literal_choices(annotation)
    if choices and _accepts_int(annotation):
        # a union such as `int >= 1 | "auto"`: one message for whichever branch complained
        return f"{key}={bad!r} is not valid; valid: a positive integer or {_fmt_choices(choices)}"
    if choices:
        return f"{key}={bad!r} is not valid; valid: {_fmt_choices(choices)}"
    if kind == "greater_than_equal":
        return f"{key}={bad!r} must be >= {err['ctx']['ge']}; valid: e.g. 1, 2, 4, 8"
    if kind == "greater_than":
        return f"{key}={bad!r} must be > {err['ctx']['gt']}; valid: e.g. 1, 2, 4, 8"
    if kind in {"int_type", "int_parsing", "int_from_float"}:
        return f"{key}={bad!r} must be an integer (JSON number without quotes); valid: e.g. 1, 2, 4, 8"
    if kind in {"float_type", "float_parsing", "finite_number"}:
        return f"{key}={bad!r} must be a number (a JSON number without quotes)"
    if kind in {"bool_type", "bool_parsing"}:
        return f"{key}={bad!r} must be a boolean; valid: true, false"
    if kind in {"model_type", "dict_type", "model_attributes_type"}:
        owner = submodel(annotation) if annotation is not None else None
        valid = _fmt_choices(list(owner.model_fields)) if owner else "an object"
        return f"{key}={bad!r} must be an object (JSON dict); valid keys: {valid}"
    return f"{key}={bad!r}: {err['msg']}"
