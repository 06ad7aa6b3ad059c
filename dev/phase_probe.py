"""perf_counter probes around a restore's phases (no profiler): each probed function's wall
seconds summed, printed as one JSON line after each restore. Used by dev/rollback_phases.py
--probe; ``install()`` patches the functions in every ckptio module that holds them."""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from typing import Any

TIMES: dict[str, float] = defaultdict(float)
PROBES = [
    ("ckptio.managing.manager", "CheckpointManager.wait"),
    ("ckptio.managing.manager", "CheckpointManager._staging"),
    ("ckptio.managing.manager", "CheckpointManager._listings"),
    ("ckptio.api", "Checkpointer.load"),
    ("ckptio.loading.load_session", "open_checkpoint"),
    ("ckptio.loading.matching", "match"),
    ("ckptio.loading.fill_plan", "plan"),
    ("ckptio.loading.fill", "fill_in_place"),
    ("ckptio.loading.read", "plan_spans"),
    ("ckptio.loading.direct_reads", "split"),
    ("ckptio.loading.direct_reads", "read"),
]


def _wrap(name: str, fn: Any) -> Any:
    def probe(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES[name] += time.perf_counter() - t
    probe.__wrapped__ = fn  # type: ignore[attr-defined]
    return probe


def install() -> None:
    import importlib

    for modname, qual in PROBES:
        mod = importlib.import_module(modname)
        if "." in qual:
            cls, attr = qual.split(".")
            owner = getattr(mod, cls)
            setattr(owner, attr, _wrap(qual, getattr(owner, attr)))
            continue
        fn = getattr(mod, qual)
        wrapped = _wrap(f"{modname.rsplit('.', 1)[1]}.{qual}", fn)
        for m in list(sys.modules.values()):
            if getattr(m, "__name__", "").startswith("ckptio") and getattr(m, qual, None) is fn:
                setattr(m, qual, wrapped)


def take() -> dict[str, float]:
    out = {k: round(v, 4) for k, v in TIMES.items()}
    TIMES.clear()
    return out
