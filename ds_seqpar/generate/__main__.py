"""``python -m ds_seqpar.generate --model DIR --ds_config X.json --prompt-file F``: see ``ds_seqpar/cli/generate.py``
and docs/inference_cli.md."""

import sys

from ds_seqpar.cli.generate import main
from ds_seqpar.user_errors import run_main

if __name__ == "__main__":
    sys.exit(run_main(main))  # a flag, config, model or prompt error is reported once, without a traceback
