"""Long-context fine-tuning with ds_seqpar: see `python train.py --help` and docs/train.md."""

from ds_seqpar.cli import main
from ds_seqpar.user_errors import run_main

if __name__ == "__main__":
    run_main(main)  # a configuration or input error is reported once, without a traceback
