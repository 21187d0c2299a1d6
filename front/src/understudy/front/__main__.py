"""``python -m understudy.front serve ...``: the front without the ``understudy``
dispatcher (whose entry-point scan costs a restarted front tens of
milliseconds before it accepts); the same command as ``understudy front serve``."""

import sys

from understudy.front.cli import main

sys.exit(main())
