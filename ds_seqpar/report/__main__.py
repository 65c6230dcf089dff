"""``python -m ds_seqpar.report``."""

import sys

from ds_seqpar.report import main

sys.exit(main())
