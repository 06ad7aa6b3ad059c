"""A Checkpointer's saves run on its long-lived threads (saving/workers.py, each a Calls on the
one background-thread class, io/worker.py): a steady save starts no thread (issue 65: two or
three thread starts per save were part of the call's cost), a background failure is still
raised once by wait() (or else by the next save), close() joins the threads and a later save
makes them again, and a save left in flight at interpreter exit still commits."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio.errors import CkptError

SAVE_THREADS = {"ckptio-save", "ckptio-hash", "ckptio-cleanup"}


def _state() -> dict[str, Any]:
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt}


def _save_threads(other: frozenset[int] = frozenset()) -> set[str]:
    """The names of the save threads alive now, leaving out ``other`` (threads of other
    Checkpointers: the module-level one other tests in this process saved with)."""
    return {t.name for t in threading.enumerate()
            if t.name in SAVE_THREADS and t.is_alive() and t.ident not in other}


def _others() -> frozenset[int]:
    return frozenset(t.ident or 0 for t in threading.enumerate() if t.name in SAVE_THREADS)


@pytest.mark.parametrize("how", ["sync", "eager", "lazy"])
def test_twenty_steady_saves_start_no_thread(tmp_path, monkeypatch, how):
    state = _state()
    opt = state["optim"]
    other = _others()
    ck = ckptio.Checkpointer()

    saved: list[torch.Tensor] = []

    def save(i: int) -> None:
        saved[:] = [state["model"][0].weight.detach().clone()]
        path = tmp_path / f"s{i % 3}"  # rotating: each save supersedes files (a cleanup)
        if how == "sync":
            ck.save(state, path)
            return
        handle = ck.async_save(state, path, lazy=how == "lazy",
                               optimizers=[opt] if how == "lazy" else ())
        if how == "lazy":
            opt.step()
        handle.wait()

    started: list[str] = []
    real_start = threading.Thread.start

    def counted(thread: threading.Thread) -> None:
        started.append(thread.name)
        real_start(thread)

    try:
        for i in range(3):  # the first saves make the threads (and the pool, the backend)
            save(i)
        monkeypatch.setattr(threading.Thread, "start", counted)
        for i in range(20):
            save(i)
        assert started == [], f"threads started by 20 steady saves: {started}"
        assert _save_threads(other) == SAVE_THREADS
    finally:
        ck.close()
    assert _save_threads(other) == set(), "close() joined the save threads"
    assert ckptio.load(tmp_path / "s1")["model"]["0.weight"].equal(saved[0]), "the last save"


def test_a_background_failure_is_raised_once_and_the_threads_go_on(tmp_path):
    """The save's steps fail on the long-lived thread (the directory cannot be made: a file is
    in the way): wait() raises it once; the next save on the same threads commits. A failure
    nobody waited for is raised by the next save, once."""
    state = _state()
    (tmp_path / "blocker").write_text("a file, not a directory")
    ck = ckptio.Checkpointer()
    try:
        ck.async_save(state, tmp_path / "ok0").wait()
        failed = ck.async_save(state, tmp_path / "blocker" / "ck")
        with pytest.raises(CkptError):
            failed.wait()
        assert ck.async_save(state, tmp_path / "ok1").wait().nbytes > 0, "not raised again"
        ck.async_save(state, tmp_path / "blocker" / "ck2")  # nobody waits for this one
        with pytest.raises(CkptError, match="blocker"):
            ck.async_save(state, tmp_path / "ok2")
        ck.async_save(state, tmp_path / "ok3").wait()  # raised once: this one commits
    finally:
        ck.close()
    for name in ("ok0", "ok1", "ok3"):
        assert ckptio.load(tmp_path / name)["model"]["0.weight"].equal(
            state["model"][0].weight.detach())
    assert not (tmp_path / "ok2").exists(), "the save after an unseen failure wrote nothing"


def test_close_joins_the_threads_and_a_later_save_makes_them_again(tmp_path):
    state = _state()
    other = _others()
    ck = ckptio.Checkpointer()
    ck.async_save(state, tmp_path / "a").wait()
    ck.close()
    assert _save_threads(other) == set()
    ck.async_save(state, tmp_path / "b").wait()
    assert "ckptio-save" in _save_threads(other)
    ck.close()
    assert _save_threads(other) == set()
    assert ckptio.load(tmp_path / "b")["model"]["1.bias"].equal(state["model"][1].bias.detach())


_RUN = """
import os, sys, torch, ckptio
root = sys.argv[1]
state = {"w": torch.arange(1000, dtype=torch.float32)}
ck = ckptio.Checkpointer()
ck.async_save(state, f"{root}/parent").wait()
"""


def _python(tmp_path: Path, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, check=False)


def test_a_save_in_flight_at_exit_commits(tmp_path):
    """The script ends right after async_save returns (no wait, no close): the save's steps,
    queued on a long-lived (daemon) thread, finish and commit before the interpreter goes."""
    done = _python(tmp_path, _RUN + """
big = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(40)}
ck.async_save(big, f"{root}/last")
""")
    assert done.returncode == 0, done.stderr
    loaded = ckptio.load(tmp_path / "last")
    assert loaded["t39"].equal(torch.full((1 << 18,), 39.0))
