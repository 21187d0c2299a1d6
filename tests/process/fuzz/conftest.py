"""The live-server fuzzers (issue 15): their helpers import as plain modules."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
# fuzzkit.py here; gmsprocs.py (GMS server processes, memfd_holders) next door.
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "gms"))
