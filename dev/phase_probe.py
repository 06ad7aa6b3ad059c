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
    patch(PROBES, _wrap)


def patch(probes: list[tuple[str, str]], wrap: Any, prefixes: tuple[str, ...] = ("ckptio",)) -> None:
    """Each ``(module, name)`` of ``probes`` replaced by ``wrap(label, fn)``: a method on its
    class, a function in every loaded module under ``prefixes`` that holds it."""
    import importlib

    for modname, qual in probes:
        mod = importlib.import_module(modname)
        if "." in qual:
            cls, attr = qual.split(".")
            owner = getattr(mod, cls)
            setattr(owner, attr, wrap(qual, getattr(owner, attr)))
            continue
        fn = getattr(mod, qual)
        wrapped = wrap(f"{modname.rsplit('.', 1)[1]}.{qual}", fn)
        for m in list(sys.modules.values()):
            if (getattr(m, "__name__", "") or "").startswith(prefixes) and getattr(m, qual, None) is fn:
                setattr(m, qual, wrapped)


def take() -> dict[str, float]:
    out = {k: round(v, 4) for k, v in TIMES.items()}
    TIMES.clear()
    return out
