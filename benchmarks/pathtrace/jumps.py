"""python jumps.py TRACE.json PATH: the distinct module sequences of path PATH's own chains that
re-enter a module they left (A > B > A), shortened to module names."""
import json
import sys

sys.path.insert(0, ".")
from tracer import own_part  # noqa: E402

result = json.load(open(sys.argv[1]))
shapes = {}
for k in ("rank0", "rank1"):
    for r in result[sys.argv[2]].get(k, []):
        chain = own_part(r["chain"]) or r["chain"]
        mods = []
        for m, _ in chain:
            m = m.removeprefix("ckptio.")
            if not mods or mods[-1] != m:
                mods.append(m)
        if len(set(mods)) < len(mods):
            shapes[" > ".join(mods)] = 1
for s in sorted(shapes):
    print(s)
