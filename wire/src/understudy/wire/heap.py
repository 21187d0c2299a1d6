"""The collector and a long-lived server process.

A server imports hundreds of thousands of objects that live as long as it
does (modules, numpy, tokenizers, aiohttp). Python's full collections walk all
of them, holding the GIL for tens of milliseconds; one landing on the first
requests after a failover showed as a 150 ms hole in the answers. Freezing the
heap once start-up is done moves those objects out of the collector's sight
(``gc.freeze``); what is allocated afterwards is collected as usual.
"""

from __future__ import annotations

import gc


def freeze() -> None:
    """Collect once, then freeze what survives: call at the end of start-up."""
    gc.collect()
    gc.freeze()
