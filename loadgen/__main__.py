"""``python -m loadgen``: see ``loadgen.cli``."""

from loadgen.cli import main

raise SystemExit(main())
