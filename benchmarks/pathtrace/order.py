"""python order.py TRACE.json: each path's counted spine modules in the order they first appear
on the traced stacks (rank 0's chains in the order recorded, then rank 1's), the functions seen."""
import json
import sys

sys.path.insert(0, ".")
from tracer import own_part  # noqa: E402

result = json.load(open(sys.argv[1]))
for path in "12345":
    order: dict[str, list[str]] = {}
    for k in ("rank0", "rank1"):
        for r in result[path].get(k, []):
            chain = own_part(r["chain"]) or r["chain"]
            for m, fn in chain:
                fns = order.setdefault(m, [])
                if fn not in fns:
                    fns.append(fn)
    print(f"== path {path}")
    for i, (m, fns) in enumerate(order.items(), 1):
        print(f"  {i}. {m}: {', '.join(fns[:8])}")
