"""python run.py OUTDIR: trace the five paths; writes OUTDIR/trace.json and prints the spines."""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.path.dirname(os.path.abspath(__file__)) + os.pathsep + \
    os.environ.get("PYTHONPATH", "")

import cases  # noqa: E402
from tracer import summarise  # noqa: E402
try:  # renamed by issue 44 (fc33b55)
    from ckptio.testing.rank_processes import run_ranks  # noqa: E402
except ImportError:
    from ckptio.testing.ranks import run_ranks  # noqa: E402


# Rule D of ../paths_before.md: pure modules that decide the branch a path takes or the question
# that defines it (they reach no primitive, so the trace cannot see them). Update the names when
# the decision moves; keep the questions.
DECIDERS_BEFORE = {  # 670eac5
    "1": {"ckptio.packed": "packing_for: None for default options = the plain branch"},
    "2": {"ckptio.packed": "packing_for: the plain branch",
          "ckptio.distributed.rankplan": "local_plan: a regular DTensor per tensor, else per chunk",
          "ckptio.planning.globalplan": "plan_global: who writes each non-regular item",
          "ckptio.planning.regular": "regular_writes: each rank's chunks of regular tensors"},
    "3": {"ckptio.planning.reshard": "plan_reads: which stored bytes fill a wanted region"},
    "4": {},
    "5": {"ckptio.managing.ranks": "verdict / DAMAGE: which load errors fall back"},
}
# After issue 44 (main): the same questions; planning/regular.py is planning/regular_items.py,
# managing/ranks.py is managing/agreement.py (fc33b55's renames).
DECIDERS_AFTER = {
    "1": {"ckptio.packed": "packing_for: None for default options = the plain branch"},
    "2": {"ckptio.packed": "packing_for: the plain branch",
          "ckptio.distributed.rankplan": "local_plan: a regular DTensor per tensor, else per chunk",
          "ckptio.planning.globalplan": "plan_global: who writes each non-regular item",
          "ckptio.planning.regular_items": "regular_writes: each rank's chunks of regular tensors"},
    "3": {"ckptio.planning.reshard": "plan_reads: which stored bytes fill a wanted region"},
    "4": {},
    "5": {"ckptio.managing.agreement": "verdict / DAMAGE: which load errors fall back"},
}
_BEFORE = importlib.util.find_spec("ckptio.tiering.manager") is not None
DECIDERS = DECIDERS_BEFORE if _BEFORE else DECIDERS_AFTER


def corrupt_memory(base: str) -> None:
    """Damage rank 1's own memory copy of step 10 (one byte of one data file)."""
    files = sorted(glob.glob(os.path.join(base, "host1", "run", "r00001", "step-10", "data-*")))
    with open(files[0], "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    result = {}
    result["1"] = {"rank0": cases.path1(out)}
    r2 = run_ranks(2, cases.path2, out, timeout_s=300)
    result["2"] = {"rank0": r2[0], "rank1": r2[1]}
    r3 = run_ranks(2, cases.path3, out, timeout_s=300)
    result["3"] = {"rank0": r3[0], "rank1": r3[1]}
    base, disk = os.path.join(out, "hosts"), os.path.join(out, "disk")
    r4 = run_ranks(2, cases.path4, base, disk, timeout_s=300)
    result["4"] = {"rank0": r4[0], "rank1": r4[1]}
    corrupt_memory(base)
    r5 = run_ranks(2, cases.path5, base, disk, timeout_s=300)
    result["5"] = {"rank0": r5[0][1:], "rank1": r5[1][1:], "outcome": [r[0] for r in r5]}
    with open(os.path.join(out, "trace.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    total, union = 0, set()
    for path in "12345":
        records = [r for key in ("rank0", "rank1") for r in result[path].get(key, [])]
        s = summarise(records)
        counted = {"ckptio (__init__)"} | set(s["own"]) | set(DECIDERS[path])
        total += len(counted)
        union |= counted
        print(f"== path {path}: COUNT {len(counted)} (entry 1 + spine {len(s['own'])} + deciders "
              f"{len(set(DECIDERS[path]) - set(s['own']))}); with sub-paths: spine "
              f"{len(s['full'])}")
        for m, fns in s["full"].items():
            mark = "" if m in s["own"] else "   (sub-path, not counted)"
            print(f"   {m}: {', '.join(fns[:6])}{' ...' if len(fns) > 6 else ''}{mark}")
        for m, why in DECIDERS[path].items():
            if m not in s["own"]:
                print(f"   {m}: [decider] {why}")
    print(f"== sum over the five paths: {total}; distinct files over all five: {len(union)}")
    print("path 5 outcome:", result["5"]["outcome"])


if __name__ == "__main__":
    main(sys.argv[1])
