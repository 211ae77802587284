"""`python -m hf_speculators ...`: the `hf-speculators` command line."""

from .tools.cli import main

raise SystemExit(main())
