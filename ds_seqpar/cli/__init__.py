"""``train.py``'s command line: flags and checks (``args.py``), data (``data.py``), output (``log.py``) and the
training run (``run.py``). ``python train.py --help`` lists every flag; docs/train.md describes them."""

from ds_seqpar.cli.args import DEFAULT_CONFIG, DEFAULT_MLM_MODEL, DEFAULT_MODEL, build_parser, parse_args
from ds_seqpar.cli.log import RunLog
from ds_seqpar.cli.run import main, max_seq_len_search, memory_report

__all__ = [
    "DEFAULT_CONFIG",
    "DEFAULT_MLM_MODEL",
    "DEFAULT_MODEL",
    "RunLog",
    "build_parser",
    "main",
    "max_seq_len_search",
    "memory_report",
    "parse_args",
]
