"""``python -m ds_seqpar.verify --model DIR --ds_config X.json``: see ``ds_seqpar.verify`` and docs/verify.md."""

import sys

from ds_seqpar.user_errors import run_main
from ds_seqpar.verify.run import main

if __name__ == "__main__":
    sys.exit(run_main(main))  # a flag, config or model error is reported once, without a traceback
