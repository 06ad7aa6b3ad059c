"""Probe: the phases of a steady eager async_save call, timed inside the call (wall clock,
perf_counter around each phase's function; no profiler, so the times add up), 1,000 tensors,
the plan reused, the setup of benchmarks/call_overhead.py (three rotating directories, each
save waited for before the next). dev/call_parts.py times the same parts alone, and
dev/call_breakdown.py gives cProfile's shares, which its own overhead inflates.

Caller's thread: flatten (torch's ``state_dict()``s and the parameters' names inside it), the
plan's reuse check, the ranks' agreement, the layout, then waiting for the save thread's
hand-over and running the capture it hands over. Save thread, before the hand-over: the
location's claim (the directory lock and the digest of the manifest it replaces), the files'
set-up. Prints each phase's median over the calls after the first two, per process.

    python dev/call_phases.py [--saves 40] [--tensors 1000]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python dev/NAME.py` from the checkout: its benchmarks/ and ckptio/ first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import contextlib
import functools
import importlib
import logging
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

TIMES: defaultdict[str, list[float]] = defaultdict(list)

# (label, module, attribute path, whether it is a context manager), in call order
PHASES = [
    ("flatten (with torch's state_dict()s)", "ckptio.saving.save_session", "flatten", False),
    ("  module_names (named_parameters)", "ckptio.format.param_names", "module_names", False),
    ("build_plan (the reuse check)", "ckptio.saving.save_session", "build_plan", False),
    ("local_plan", "ckptio.distributed.rankplan", "local_plan", False),
    ("agree", "ckptio.distributed.collective", "agree", False),
    ("_lay_out", "ckptio.saving.save_session", "_lay_out", False),
    ("take (wait for the hand-over + capture)", "ckptio.saving.handover", "Handover.take", False),
    ("  capture (SaveJob.capture)", "ckptio.saving.persist", "SaveJob.capture", False),
    ("    move_many (fields + memmoves)", "ckptio.saving.capture_window", "move_many", False),
    ("save thread: claim (lock + digest)", "ckptio.distributed.savelock", "exclusive", True),
    ("  dirlock.lock", "ckptio.storage.local.dirlock", "lock", False),
    ("  digest of the manifest replaced", "ckptio.storage.local.local_store",
     "LocalStore._digest", False),
]


def _timed(label: str, call: Callable[..., Any], manager: bool) -> Callable[..., Any]:
    if manager:
        @contextlib.contextmanager
        def entered(*args: Any, **kwargs: Any) -> Iterator[Any]:
            start = time.perf_counter()
            with call(*args, **kwargs) as value:
                TIMES[label].append(time.perf_counter() - start)
                yield value
        return entered

    @functools.wraps(call)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            TIMES[label].append(time.perf_counter() - start)
    return timed


def _install() -> None:
    for label, module, path, manager in PHASES:
        owner: Any = importlib.import_module(module)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        setattr(owner, name, _timed(label, getattr(owner, name), manager))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--saves", type=int, default=40)
    p.add_argument("--tensors", type=int, default=1000)
    args = p.parse_args()
    import ckptio
    from benchmarks.call_overhead import many_tensors_state

    logging.getLogger("ckptio").setLevel(logging.ERROR)  # "the save replaced ..." per save
    _install()
    state = many_tensors_state(args.tensors)
    scratch = tempfile.mkdtemp()
    ck = ckptio.Checkpointer()
    calls: list[float] = []
    try:
        for i in range(args.saves):
            if i == 2:
                TIMES.clear()
            start = time.perf_counter()
            handle = ck.async_save(state, f"{scratch}/s{i % 3}")
            calls.append(time.perf_counter() - start)
            handle.wait()
    finally:
        ck.close()
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{'the whole call':44s} {statistics.median(calls[2:]) * 1e3:6.2f} ms")
    for label, *_ in PHASES:
        if TIMES[label]:
            print(f"{label:44s} {statistics.median(TIMES[label]) * 1e3:6.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
