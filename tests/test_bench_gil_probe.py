"""The GIL probe's driver and report (benchmarks/gil_probe.py): a tiny run of every mode in
fresh processes, checked for its rows and its pinning (no timing is asserted)."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import gil_probe

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")


def test_probe_smoke_reports_every_mode(tmp_path):
    out = tmp_path / "r.json"
    md = tmp_path / "r.md"
    argv = ["--gb", "0.01", "--tensors", "50", "--ops", "30", "--reps", "1", "--base-steps", "3",
            "--warmup-steps", "2", "--dir", str(tmp_path / "d"), "--modes",
            "idle,memcpy,ckptio,ckptio_lazy", "--json", str(out), "--markdown", str(md)]
    assert gil_probe.main(argv) == 0
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["rows"]] == ["idle", "memcpy", "ckptio", "ckptio_lazy"]
    for run in report["runs"]:
        assert len(run["reps"]) == 2  # the first save of the process, then the measured one
        if run["mode"] != "idle":
            assert all(r["background_s"] > 0 for r in run["reps"])
    text = md.read_text()
    assert "| ckptio_lazy |" in text and "vs memcpy floor" in text
    assert not list((tmp_path / "d").iterdir())  # every step it wrote is removed


def test_pin_others_moves_every_other_thread(tmp_path):
    import threading

    started, stop = threading.Event(), threading.Event()
    tids: list[int] = []

    def idle() -> None:
        tids.append(threading.get_native_id())
        started.set()
        stop.wait()

    before = os.sched_getaffinity(0)
    thread = threading.Thread(target=idle)
    thread.start()
    started.wait()
    try:
        core = max(before)
        gil_probe.pin_others(threading.get_native_id(), core)
        assert os.sched_getaffinity(tids[0]) == {core}
        assert os.sched_getaffinity(0) == before  # the calling thread is left alone
    finally:
        stop.set()
        thread.join()
