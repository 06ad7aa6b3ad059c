"""io_backend "auto": a save that persists behind the caller (async, lazy) goes through the
POSIX backend's threads, a save the caller waits for through io_uring where this process can
use it (docs/BENCH_LOOP.md, "the backend behind the loop"); an explicit choice holds for both."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import ckptio
from ckptio import io


def _threads(prefix: str, since: set[int] | None = None) -> int:
    """Live threads named ``prefix``..., not counting those alive at ``since`` (idents): other
    tests' Checkpointers may still hold theirs."""
    return sum(t.name.startswith(prefix) and t.ident not in (since or set())
               for t in threading.enumerate())


def _idents() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.ident is not None}


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {f"w{i}": torch.randn(1 << 18, generator=gen) for i in range(4)}


def test_auto_persists_behind_the_caller_on_posix_threads(tmp_path: Path) -> None:
    state, before = _state(), _idents()
    ck = ckptio.Checkpointer()
    try:
        ck.async_save(state, tmp_path / "async").wait()
        assert _threads("ckptio-io", before) > 0, "an async save wrote without the POSIX threads"
        assert _threads("ckptio-uring", before) == 0, "an async save started io_uring's reaper"
        ck.save(state, tmp_path / "sync")
        if io.uring_unavailable_reason() is None and io.can_pin():
            assert _threads("ckptio-uring", before) == 1, "a synchronous save did not take io_uring"
        for name in ("async", "sync"):
            loaded = ck.load(tmp_path / name)
            assert all(torch.equal(loaded[k], v) for k, v in state.items())
    finally:
        ck.close()
    assert _threads("ckptio-io", before) == 0 and _threads("ckptio-uring", before) == 0, \
        "close() left I/O threads"


@pytest.mark.skipif(io.uring_unavailable_reason() is not None, reason="no io_uring here")
def test_an_explicit_backend_holds_for_saves_behind_the_caller(tmp_path: Path) -> None:
    before = _idents()
    ck = ckptio.Checkpointer(ckptio.Options(io_backend="uring"))
    try:
        ck.async_save(_state(), tmp_path / "a").wait()
        assert _threads("ckptio-uring", before) == 1 and _threads("ckptio-io", before) == 0
    finally:
        ck.close()
