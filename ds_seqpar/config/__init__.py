"""The ``"sequence_parallel"`` section of a DeepSpeed JSON, as a typed and validated model.

Example (all keys optional except ``size``, which may be ``"auto"``: every rank of the world, or
world / ``data_parallel_size``)::

    "sequence_parallel": {
      "enabled": true,
      "size": 8,
      "ulysses_degree": 2,
      "ring": {"layout": "zigzag", "inner_size": null, "overlap": true},
      "attention": "usp",
      "kernel": "auto"
    }

Mesh vocabulary: ``size`` = P (SP degree), ``ulysses_degree`` = U, ring degree R = P / U,
``ring.inner_size`` = ranks per inner ring of the double ring (R_inner; R_outer = R / R_inner).

Two validation stages:

* ``load_config(path_or_dict)`` checks everything the section alone can check (types, choices,
  divisibility, unknown keys), checks the file's other keys against DeepSpeed's own (top level and
  ``zero_optimization``, ``deepspeed_keys.py``: a misspelt DeepSpeed key is an error with the closest valid
  key), and returns the section plus the DeepSpeed dict with DeepSpeed's own ``sequence_parallel_size`` set.
* ``section.validate(model_config, world_size)`` (``settings.resolve_settings``) checks what needs the
  model or the world (heads vs U, world vs size) and resolves every ``"auto"`` into the frozen
  ``SeqParSettings`` a mesh holds; nothing reads the section afterwards.

Names of layouts, schedules and kernels are the registries' (``layout.LAYOUTS``, ``comm.schedules.SCHEDULES``,
the kernel registries of ``ops/``): a registered extension is configurable by name, and the error of a bad
name lists the registered ones.

Every error is a ``SeqParConfigError`` whose message names the key, the bad value and a valid
alternative, e.g. ``sequence_parallel.ulysses_degree=3 does not divide size=8; valid: 1, 2, 4, 8``.
"""

from ds_seqpar.config.deepspeed_keys import check_deepspeed_keys, deepspeed_top_level_keys
from ds_seqpar.config.load import current_world_size, load_config, parse_section, with_overrides
from ds_seqpar.config.messages import config_field_paths
from ds_seqpar.config.section import (
    SECTION,
    LinearConfig,
    MemoryConfig,
    RingConfig,
    SequenceParallelConfig,
    SparseConfig,
)
from ds_seqpar.errors import MissingFileError, SeqParConfigError
from ds_seqpar.settings import auto_ulysses_degree, divisors, head_counts

__all__ = [
    "SECTION",
    "LinearConfig",
    "MemoryConfig",
    "MissingFileError",
    "RingConfig",
    "SeqParConfigError",
    "SequenceParallelConfig",
    "SparseConfig",
    "auto_ulysses_degree",
    "check_deepspeed_keys",
    "config_field_paths",
    "current_world_size",
    "deepspeed_top_level_keys",
    "divisors",
    "head_counts",
    "load_config",
    "parse_section",
    "with_overrides",
]
