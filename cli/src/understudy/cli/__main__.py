"""``python -m understudy.cli``: what the local runner and tests spawn."""

from understudy.cli import main

raise SystemExit(main())
