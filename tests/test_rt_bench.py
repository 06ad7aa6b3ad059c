"""The benchmark harness's peers timed as the tables say: DCP's "durable" save is timed to its
directory being synced (FileSystemWriter(sync_files=True) fsyncs the data files and the
``.metadata`` temp file, then renames it and syncs no directory), in every benchmark that
times a DCP save to durable; and the commands the performance pages quote still parse."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch


def _state() -> dict[str, Any]:
    return {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(16)}


def _syncs_after_metadata(monkeypatch: pytest.MonkeyPatch, path: Path,
                          save: Callable[[], object]) -> None:
    """Run ``save`` and assert an os.sync() ran once DCP's ``.metadata`` had its final name:
    the rename, and the directory entries of every file, are durable when the clock stops."""
    seen: list[bool] = []
    real = os.sync

    def sync() -> None:
        seen.append((path / ".metadata").exists())
        real()

    monkeypatch.setattr(os, "sync", sync)
    save()
    assert (path / ".metadata").exists()
    assert seen and seen[-1], f"no os.sync() after DCP's .metadata rename in {path}: {seen}"


def test_save_load_dcp_durable_save_syncs_its_directory(tmp_path, monkeypatch) -> None:
    from benchmarks import engines

    path = tmp_path / "dcp"
    engine = engines.ENGINES["dcp_t1"]
    _syncs_after_metadata(monkeypatch, path, lambda: engine.save(_state(), path))
    assert "os.sync()" in engine.note  # the table's footnote says so


def test_interop_dcp_save_syncs_its_directory(tmp_path, monkeypatch) -> None:
    from benchmarks import interop_engines

    path = tmp_path / "dcp"
    save = interop_engines.save_filesystem(1)
    _syncs_after_metadata(monkeypatch, path, lambda: save(_state(), path))


def test_compress_dcp_save_syncs_its_directory(tmp_path, monkeypatch) -> None:
    from benchmarks import compress_engines

    session = compress_engines.DcpSession(False)
    path = Path(session.path(str(tmp_path), 1))
    _syncs_after_metadata(monkeypatch, path, lambda: session.save(str(tmp_path), 1, _state()))


def test_first_save_dcp_durable_wait_syncs(tmp_path, monkeypatch) -> None:
    """first_save's dcp modes: the wait that stops the durable clock ends with os.sync()."""
    import argparse

    from benchmarks import first_save

    seen: list[bool] = []
    real = os.sync

    def sync() -> None:
        seen.append(any((p / ".metadata").exists() for p in tmp_path.glob("d*")))
        real()

    def timed_saves(prefix: Path, start: Callable[[Path], Callable[[], object]]) -> tuple[
            list[float], list[float], float]:
        path = prefix.with_name(f"{prefix.name}0")
        wait = start(path)
        seen.clear()
        wait()
        assert seen and seen[-1], f"the durable wait did not sync after .metadata: {seen}"
        return [0.0], [0.0], 0.0

    monkeypatch.setattr(os, "sync", sync)
    monkeypatch.setattr(first_save, "timed_saves", timed_saves)
    args = argparse.Namespace(worker="dcp_async", dir=tmp_path)
    out = first_save.dcp(args, _state(), 16448, 0.0)
    assert out["mode"] == "dcp_async"


@pytest.mark.parametrize("page, module", [
    ("docs/BENCH_LIMIT.md", "benchmarks.save_load"),
    ("docs/BENCH_TORCH_CHECKPOINTING.md", "benchmarks.ranks"),
    ("docs/BENCH_TORCH_CHECKPOINTING.md", "benchmarks.tiers"),
    ("docs/BENCH_LOOP.md", "benchmarks.first_save"),
])
def test_documented_commands_parse(page: str, module: str) -> None:
    """Every ``python -m MODULE ...`` line the page quotes parses with today's arguments."""
    import importlib

    root = Path(__file__).resolve().parents[1]
    text = (root / page).read_text().replace("\\\n", " ")
    lines = [line.split("python -m " + module, 1)[1] for line in text.splitlines()
             if "python -m " + module + " " in line]
    assert lines, f"{page} quotes no {module} command"
    parse = importlib.import_module(module).parse_args
    for line in lines:
        argv = shlex.split(line.split("`")[0].split(")")[0].replace("[--pin]", "--pin")
                           .replace("{shared,pinned}", "shared").replace("--markdown ...", ""),
                           comments=True)
        parse(argv)
