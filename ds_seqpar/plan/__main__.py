"""``python -m ds_seqpar.plan``: the planner's command line (``plan/cli.py``)."""

from ds_seqpar.plan.cli import main

raise SystemExit(main())
