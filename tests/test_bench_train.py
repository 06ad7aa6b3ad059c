"""The training benchmark (benchmarks.train): a tiny end-to-end run through fresh worker
processes, the T_block arithmetic, and the training loop with engines in process.
No timing is asserted: only that every number is there, finite and sane, and the check passes."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from benchmarks import train
from benchmarks import train_engines as te

PEERS = ["none"]  # the peers run in process below: a fresh worker costs ~6 s of imports
CKPTIO = ["ckptio_eager", "ckptio_lazy"]
MAY_BE_NEGATIVE = {"overhead_pct"}  # a run can be faster than the baseline: noise


def numbers(value: Any, key: str = "") -> list[tuple[str, float]]:
    """(key, number) for every int or float nested in ``value`` (bools left out)."""
    if isinstance(value, dict):
        return [n for k, v in value.items() for n in numbers(v, str(k))]
    if isinstance(value, list):
        return [n for v in value for n in numbers(v, key)]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [(key, float(value))]
    return []


def test_tiny_run_reports_every_engine(tmp_path: Path) -> None:
    available = [e for e in CKPTIO if te.unavailable_reason(e) is None]
    scratch, out = tmp_path / "scratch", tmp_path / "train.json"
    argv = ["--gb", "0.01", "--steps", "5", "--every", "2", "--reps", "1", "--idle", "0",
            "--engines", ",".join(PEERS + CKPTIO), "--dir", str(scratch), "--json", str(out),
            "--markdown", str(tmp_path / "train.md")]
    assert train.main(argv) == 0
    assert not scratch.exists(), "the scratch directory must be removed"
    report = json.loads(out.read_text())
    runs = {r["engine"]: r for r in report["runs"]}
    assert sorted(runs) == sorted(PEERS + available)
    assert sorted(report["summary"]["unavailable"]) == sorted(set(CKPTIO) - set(available))
    for name, run in runs.items():
        assert "error" not in run, run
        assert run["bitwise_ok"], name
        assert len(run["step_s"]) == 5
        assert [c["step"] for c in run["checkpoints"]] == ([] if name == "none" else [2, 4])
        for key, value in numbers(run):
            assert math.isfinite(value), (name, key)
            assert key in MAY_BE_NEGATIVE or value >= 0, (name, key, value)
        for c in run["checkpoints"]:
            assert c["t_block_s"] >= c["call_s"] and c["persist_s"] > 0, c
    assert (tmp_path / "train.md").read_text().count("| ") > len(runs)


def test_t_block_adds_waits_and_slower_steps_only_for_async_engines() -> None:
    c = {"call_s": 0.1, "wait_after_s": 0.2}
    assert train.t_block(c, [1.5, 1.0, 0.7], base=1.0, is_async=True) == pytest.approx(0.5)
    assert train.t_block(c, [0.5, 0.5], base=1.0, is_async=True) == pytest.approx(0.3)  # floor 0
    assert train.t_block(c, [1.5, 1.5], base=1.0, is_async=False) == pytest.approx(0.3)


def test_annotate_uses_the_same_rep_baseline() -> None:
    none = {"engine": "none", "rep": 0, "step_s": [9.0, 1.0, 1.0, 1.0, 1.0], "train_s": 13.0,
            "checkpoints": []}
    eager = {"engine": "ckptio_eager", "rep": 0, "step_s": [9.0, 1.0, 1.5, 1.0, 1.0],
             "train_s": 13.6, "checkpoints": [{"step": 2, "call_s": 0.1, "wait_after_s": 0.0},
                                               {"step": 4, "call_s": 0.1}]}
    train.annotate([none, eager])
    assert eager["base_step_s"] == 1.0 and eager["base_from"] == "none, same rep"
    assert [c["t_block_s"] for c in eager["checkpoints"]] == pytest.approx([0.6, 0.1])
    assert eager["overhead_pct"] == pytest.approx(100 * (13.6 / 13.0 - 1))


def test_checkpoint_schedule_leaves_steps_after_the_last_save() -> None:
    assert train.checkpoint_steps(5, 2) == [2, 4]
    assert train.checkpoint_steps(40, 10) == [10, 20, 30]


@pytest.mark.parametrize("name", ["torch_save", "dcp_async_thread", "dcp_async_stager",
                                  "ckptio_lazy"])
def test_loop_in_process(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop, the engine glue and each engine's own loader, in this process."""
    if (why := te.unavailable_reason(name)) is not None:
        pytest.skip(why)
    for var in ("MASTER_ADDR", "MASTER_PORT"):  # DCP's saver sets them; restored afterwards
        monkeypatch.setenv(var, "")
    engine = te.ENGINES[name]
    model, opt, cfg = train.build_training(0.01, 0)
    assert engine.make is not None
    saver = engine.make(te.Context(opt, te.pool_bytes_for(None)))
    args = argparse.Namespace(steps=5, every=2, batch=1, seq=16)
    tokens = torch.randint(cfg.vocab, (5, 1, 17))
    run = train.train_loop(args, model, opt, tokens, train.SaveTimeline(saver, tmp_path))
    saver.close()
    assert train.verify_last(engine, run.pop("last"))["bitwise_ok"]
    assert [c["step"] for c in run["checkpoints"]] == [2, 4]
    assert all(c["persist_s"] > 0 and c["call_s"] >= 0 for c in run["checkpoints"])
    if name == "ckptio_lazy":
        assert all(c["reported"]["skipped"] is False for c in run["checkpoints"])
        assert not opt._optimizer_step_pre_hooks, "wait() on the training thread removes the hooks"
    if name == "dcp_async_stager":
        assert not opt._optimizer_step_pre_hooks, "close() removes the staging hook"


def test_ckptio_engines_report_unavailable_without_async_save(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckptio, "async_save", None, raising=False)  # lazy: delattr is a no-op
    assert te.unavailable_reason("ckptio_eager") == "ckptio has no async_save yet"
    assert (te.unavailable_reason("nonsense") or "").startswith("unknown engine")


def test_build_model_is_seeded_with_its_head_tied() -> None:
    """ckptio.tuning.state.build_model, the model benchmarks/train.py trains."""
    from ckptio.tuning import state

    cfg = state.gpt_config(0.002)
    one, two = (state.build_model(cfg, state.Filler(3)) for _ in range(2))
    assert one.lm_head.weight is one.tok_emb.weight
    assert all(torch.equal(a, b) for a, b in zip(one.state_dict().values(),
                                                  two.state_dict().values()))
