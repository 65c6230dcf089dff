"""``python -m ds_seqpar.verify``: is ds_seqpar exact on YOUR model? (docs/verify.md)

Runs the model of ``--model`` for ``--steps`` optimizer steps with sequence parallelism (the config's
``sequence_parallel`` section through ``ds_seqpar.initialize``, its ZeRO stage included) and without (the
plain HF forward on the full sequence, same initial weights, data and SGD step, in every rank), then prints
the loss of each per step and the worst gradient difference per module, and exits 1 naming the worst
module when a relative difference exceeds ``--tolerance``.

Parts: ``args.py`` (flags and every check, before any process group), ``ds_config.py`` (what of the user's
DeepSpeed config is replaced for the comparison), ``compare.py`` (the two runs, on every rank),
``report.py`` (tables and verdict), ``run.py`` (``main``: the launcher's ranks, or torch's own launcher).
"""

from ds_seqpar.verify.args import build_parser, parse_args
from ds_seqpar.verify.compare import module_of, run_comparison
from ds_seqpar.verify.run import main

__all__ = ["build_parser", "main", "module_of", "parse_args", "run_comparison"]
