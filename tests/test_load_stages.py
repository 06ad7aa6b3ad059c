"""An in-place load as stages (issue 68, item 5): match (every key rule, one record out, no
byte read; the rules that wait for the agreed unexpected keys in check_agreed), plan (one read
per destination), read, put back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio.errors import StateMismatchError
from ckptio.format import manifest
from ckptio.format.flatten import flatten
from ckptio.loading import fill_plan, matching


def _saved(tmp_path: Path) -> manifest.Manifest:
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(4), "step": 3,
             "gone": torch.ones(2)}
    ckptio.save(state, tmp_path / "c")
    return manifest.decode((tmp_path / "c" / "manifest.json").read_bytes(), str(tmp_path / "c"))


def _dest() -> dict[str, Any]:
    return {"w": torch.zeros(2, 3, dtype=torch.float64), "b": torch.zeros(5),
            "new": torch.zeros(1), "step": 0}


def test_the_match_stage_decides_every_key_rule_in_one_record_before_any_read(tmp_path):
    record = _saved(tmp_path)
    flat = flatten(_dest())
    m = matching.match(record, flat, matching.Rules(strict=False, cast=True))
    matching.check_agreed(m, flat, False, m.unexpected)  # alone: this rank's keys are agreed
    assert [(leaf.key, leaf.cast, leaf.region is not None) for leaf in m.leaves] == [
        ("w", True, True), ("step", False, False)]  # w: cast in place; step: replaced
    assert m.missing == ("new",) and m.unexpected == ("gone",)
    assert m.problems == {"b": "b: shape (5,) in the state, (4,) in the checkpoint"}
    assert m.loaded() == ("w", "step")
    reads = fill_plan.plan(m)  # one read per destination: w staged in the stored dtype
    assert [r.key for r in reads.reads] == ["w"] and len(reads.casts) == 1
    assert list(reads.assign) == ["step"]
    flat = flatten(_dest())
    m = matching.match(record, flat, matching.Rules(strict=True, cast=True))
    assert m.unexpected == ("gone",) and not m.checked  # the key rule waits for the agreement
    with pytest.raises(StateMismatchError, match=r"keys differ: missing from the checkpoint "
                       r"\['new'\]; not in the state \['gone'\]"):
        matching.check_agreed(m, flat, True, m.unexpected)
    with pytest.raises(StateMismatchError, match=r"keys differ: missing from the checkpoint "
                       r"\['new'\]\. Pass"):  # no rank asks for none: only 'new' refused
        matching.check_agreed(m, flat, True, ())


def test_the_stages_together_give_what_the_match_said(tmp_path):
    _saved(tmp_path)
    dest = _dest()
    with pytest.warns(UserWarning, match=r"1 key\(s\) left as they were") as said:
        report = ckptio.load(tmp_path / "c", dest, strict=False, cast=True)
    assert said[0].filename == __file__  # the warning points at the caller's line
    assert report.loaded == ("w", "step") and report.missing == ("new",)
    assert report.unexpected == ("gone",) and len(report.mismatched) == 1
    assert torch.equal(dest["w"], torch.arange(6.0, dtype=torch.float64).reshape(2, 3))
    assert dest["step"] == 3 and torch.equal(dest["b"], torch.zeros(5))
