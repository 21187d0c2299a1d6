from __future__ import annotations

import sys
from pathlib import Path

# tests/procs.py is shared by every tier; tests import it as a plain module.
sys.path.insert(0, str(Path(__file__).parent))
