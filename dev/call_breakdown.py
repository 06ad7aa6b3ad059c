"""Probe: where a steady async_save call's time goes, function by function (cProfile's
cumulative time per call of a fixed list of functions; cProfile slows Python, so read the
shares, not the sums), eager and lazy, 1,000 tensors, the plan reused.

    python dev/call_breakdown.py [--saves 30] [--tensors 1000]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python dev/NAME.py` from the checkout: its benchmarks/ and ckptio/ first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import cProfile
import pstats
import shutil
import tempfile
import threading
import time

# (label, file suffix, function name): the parts of the call, outermost first
PARTS = [
    ("async_save (whole call)", "ckptio/api.py", "async_save"),
    ("  _agree: flatten + plan + agree", "saving/save_session.py", "_agree"),
    ("    flatten", "format/flatten.py", "flatten"),
    ("      Module.state_dict (torch)", "torch/nn/modules/module.py", "state_dict"),
    ("      Optimizer.state_dict (torch)", "torch/optim/optimizer.py", "state_dict"),
    ("      module_names (named_parameters)", "format/param_names.py", "module_names"),
    ("    build_plan (reused: _again)", "planning/plan.py", "build_plan"),
    ("    local_plan", "distributed/rankplan.py", "local_plan"),
    ("    collective.agree", "distributed/collective.py", "agree"),
    ("  _lay_out", "saving/save_session.py", "_lay_out"),
    ("    lazy_order", "saving/handle.py", "lazy_order"),
    ("    plan_files", "planning/layout.py", "plan_files"),
    ("    ready_events", "saving/persist.py", "ready_events"),
    ("  stall.watched", "io/stall.py", "watched"),
    ("  thread start (Thread.start)", "threading.py", "start"),
    ("  queued on the save thread (Calls.submit)", "io/worker.py", "submit"),
    ("  SaveJob.__init__ (caller side)", "saving/persist.py", "__init__"),
    ("  capture (eager, caller)", "saving/persist.py", "capture"),
    ("  block_until_captured", "saving/handle.py", "block_until_captured"),
]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--saves", type=int, default=30)
    p.add_argument("--tensors", type=int, default=1000)
    args = p.parse_args()
    import logging

    import ckptio
    from benchmarks.call_overhead import many_tensors_state

    logging.getLogger("ckptio").setLevel(logging.ERROR)
    state = many_tensors_state(args.tensors)
    opt = state["optim"]
    scratch = tempfile.mkdtemp()
    ck = ckptio.Checkpointer()
    starts = [0]
    real_start = threading.Thread.start

    def counted(self: threading.Thread) -> None:
        starts[0] += 1
        real_start(self)

    threading.Thread.start = counted  # type: ignore[method-assign]
    try:
        for lazy in (False, True):
            extra = {"optimizers": [opt]} if lazy else {}
            for i in range(3):
                ck.async_save(state, f"{scratch}/w{i}-{lazy}", lazy=lazy, **extra).wait()
            prof = cProfile.Profile()
            plain: list[float] = []
            starts[0] = 0
            for i in range(args.saves):
                t0 = time.perf_counter()
                handle = ck.async_save(state, f"{scratch}/s{i % 3}-{lazy}", lazy=lazy, **extra)
                plain.append(time.perf_counter() - t0)
                if lazy:
                    opt.step()
                handle.wait()
            threads = starts[0] / args.saves
            for i in range(args.saves):
                prof.enable()
                handle = ck.async_save(state, f"{scratch}/s{i % 3}-{lazy}", lazy=lazy, **extra)
                prof.disable()
                if lazy:
                    opt.step()
                handle.wait()
            plain.sort()
            print(f"\n{'lazy' if lazy else 'eager'}: unprofiled call median "
                  f"{plain[len(plain) // 2] * 1e3:.2f} ms; thread starts per save (all "
                  f"threads, background included) {threads:.2f}")
            _report(pstats.Stats(prof), args.saves)
    finally:
        threading.Thread.start = real_start  # type: ignore[method-assign]
        ck.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def _report(stats: pstats.Stats, saves: int) -> None:
    table = stats.stats  # type: ignore[attr-defined]
    for label, suffix, name in PARTS:
        cum = sum(row[3] for (file, _line, func), row in table.items()
                  if func == name and file.endswith(suffix))
        print(f"  {label:42s} {cum / saves * 1e3:7.2f} ms/call (profiled)")


if __name__ == "__main__":
    raise SystemExit(main())
