"""Compressed delta checkpoints saved by 2 gloo ranks (issue 28): every entry form (a rank's
row block as an XOR delta, a replicated tensor referenced, each rank's own value referenced on
one rank and rewritten on the other), loaded back on 2 ranks and resharded onto 1 process."""

from __future__ import annotations

import ckptio
from ckptio.testing.rank_processes import run_ranks

import delta_cases as cases
from special_values import bits_equal


def test_two_ranks_save_and_load_compressed_deltas(tmp_path):
    root = str(tmp_path)
    body = run_ranks(2, cases.save_steps, root)[0]
    assert body["version"] == 4 and body["bases"] == ["step-1"]
    forms = {(t["key"], t.get("rank")): ("ref" if "ref" in t else "xor" if "xor" in t else
                                         "plain") for t in body["tensors"]}
    assert forms[("frozen", None)] == "ref"
    assert forms[("rng", 0)] == "ref" and forms[("rng", 1)] != "ref"
    assert {forms[k] for k in forms if k[0] == "w"} == {"xor"}
    ck = ckptio.Checkpointer(cases.OPTIONS)
    out = ck.load(f"{root}/step-2", per_rank_from=1)  # 2 -> 1: the row blocks joined
    assert bits_equal(out["w"], cases.full(2))
    assert bits_equal(out["rng"], cases.own(1, 2))
    ck.verify(f"{root}/step-2")
