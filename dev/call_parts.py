"""Probe: the parts of a steady save call timed alone (timeit, best of 5), 1,000 tensors.

    python dev/call_parts.py
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python dev/NAME.py` from the checkout: its benchmarks/ and ckptio/ first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import timeit


from benchmarks.call_overhead import many_tensors_state

from ckptio.format import param_names
from ckptio.format.flatten import flatten
from ckptio.planning.plan import PlanCache, build_plan


def main() -> None:
    state = many_tensors_state(1000)
    model, opt = state["model"], state["optim"]
    cache = PlanCache()
    build_plan(flatten(state, names=True, cache=cache.flat), allow_pickle=False, cache=cache)
    flat = flatten(state, names=True, cache=cache.flat)
    parts = {
        "model.state_dict()": lambda: model.state_dict(),
        "opt.state_dict()": lambda: opt.state_dict(),
        "module_names": lambda: param_names.module_names(state),
        "flatten, names": lambda: flatten(state, names=True),
        "flatten, names, cached": lambda: flatten(state, names=True, cache=cache.flat),
        "flatten, no names, cached": lambda: flatten(state, cache=cache.flat),
        "build_plan (reused)": lambda: build_plan(flat, allow_pickle=False, cache=cache),
    }
    for name, fn in parts.items():
        best = min(timeit.repeat(fn, number=20, repeat=5)) / 20
        print(f"{name:24s} {best * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
