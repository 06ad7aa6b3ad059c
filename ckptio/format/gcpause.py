"""Pause Python's cyclic garbage collector while building large acyclic metadata.

Decoding or assembling a manifest of many thousands of chunks allocates millions of small
objects; each allocation threshold triggers a collection that walks all of them again (the
gain on the plan-scale benchmark: docs/BENCH_RANKS.md, "Plan-only scale"). Nothing built there
forms cycles, so nothing is left for the collector to find afterwards.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["paused"]


@contextlib.contextmanager
def paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
