"""python measure.py TRACE.json REV: for each path, besides the count (run.py), the lines of the
files counted (at git revision REV of the checkout in $CKPTIO_REPO, default .), the functions
seen on the own spine, and the jumps back up (a chain re-entering a module it left for another one: A > B > A)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, ".")
from tracer import own_part, summarise  # noqa: E402


def lines(rev: str, module: str) -> int:
    rel = module.replace(".", "/")
    for path in (f"{rel}.py", f"{rel}/__init__.py"):
        repo = os.environ.get("CKPTIO_REPO", ".")
        out = subprocess.run(["git", "-C", repo, "show", f"{rev}:{path}"],
                             capture_output=True, text=True)
        if out.returncode == 0:
            return len(out.stdout.splitlines())
    raise SystemExit(f"{module} not at {rev}")


def main(trace: str, rev: str, deciders: dict[str, list[str]]) -> None:
    result = json.load(open(trace))
    for path in "12345":
        records = [r for k in ("rank0", "rank1") for r in result[path].get(k, [])]
        s = summarise(records)
        counted = set(s["own"]) | set(deciders[path]) | {"ckptio"}
        nfuncs = sum(len(v) for v in s["own"].values())
        jumps = set()
        for r in records:
            chain = own_part(r["chain"]) or r["chain"]
            mods = [m for m, _ in chain]
            seen, prev = [], None
            for m in mods:
                if m != prev:
                    if m in seen:
                        jumps.add(" > ".join(dict.fromkeys(mods)))  # one per distinct chain shape
                        break
                    seen.append(m)
                prev = m
        nlines = sum(lines(rev, m) for m in counted)
        print(f"path {path}: files {len(counted)}, lines {nlines}, functions {nfuncs}, "
              f"chains jumping back up {len(jumps)}")


if __name__ == "__main__":
    before = {"1": ["ckptio.packed"], "2": ["ckptio.packed", "ckptio.distributed.rankplan",
              "ckptio.planning.globalplan", "ckptio.planning.regular"],
              "3": ["ckptio.planning.reshard"], "4": [], "5": ["ckptio.managing.ranks"]}
    after = {"1": ["ckptio.packed"], "2": ["ckptio.packed", "ckptio.distributed.rankplan",
             "ckptio.planning.globalplan", "ckptio.planning.regular_items"],
             "3": ["ckptio.planning.reshard"], "4": [], "5": ["ckptio.managing.agreement"]}
    main(sys.argv[1], sys.argv[2], before if sys.argv[3] == "before" else after)
