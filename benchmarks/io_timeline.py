"""The bytes a process reads from storage over time: a thread samples ``/proc/self/io``'s
``read_bytes`` (every read this process caused to be fetched from the block device: direct,
io_uring and buffered reads alike, not page-cache hits) while a load runs, so a rank's load
shows when its first read landed, its rate, and its last byte, whatever the engine.

Owns: the sampler and its summary. Used by benchmarks/ranks.py's load workers
(docs/BENCH_RESTART.md).
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["Timeline"]


def _read_bytes() -> int:
    with open("/proc/self/io", "rb") as f:
        for line in f:
            if line.startswith(b"read_bytes:"):
                return int(line.split()[1])
    return 0


class Timeline:
    """``Timeline().around(load, ...)`` (or ``with``); then ``summary()``. Samples every
    ``period_s``."""

    def __init__(self, period_s: float = 0.002) -> None:
        self.period_s = period_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="io-timeline", daemon=True)
        self._t0 = 0.0
        self._base = 0

    def __enter__(self) -> Timeline:
        self._base = _read_bytes()
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.perf_counter() - self._t0, _read_bytes() - self._base))

    def around(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` sampled from its first instruction to its return."""
        with self:
            return fn(*args)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append((time.perf_counter() - self._t0, _read_bytes() - self._base))

    def summary(self) -> dict[str, Any]:
        """first_read_s (first bytes seen), last_read_s (all bytes seen), read_bytes, and the
        rate between 10 % and 90 % of them (GB/s); a coarse series of (s, MB) for plots."""
        total = self.samples[-1][1] if self.samples else 0

        def when(fraction: float) -> float | None:
            return next((t for t, b in self.samples if b > 0 and b >= fraction * total), None)
        first, last = when(1e-9), when(1.0)
        t10, t90 = when(0.1), when(0.9)
        mid = 0.8 * total / (t90 - t10) / 1e9 if t10 is not None and t90 and t90 > t10 else None
        step = max(1, len(self.samples) // 40)
        series = [(round(t, 4), round(b / 1e6, 1)) for t, b in self.samples[::step]]
        return {"first_read_s": first, "last_read_s": last, "read_bytes": total,
                "mid_gbps": mid, "series": series}
