"""The ``ckptio`` command against bad input, as a red team fed it: a full disk or a Ctrl-C in
the middle of ``convert`` (one line or "interrupted", never torch's RuntimeError, and no
temporary left), ``--overwrite`` onto a directory holding a checkpoint of another format (refused:
the writer would leave the old checkpoint beside the new one), and a path that is a symbolic
link leading nowhere (named as such, not as a missing path "spelled like" itself), and a DST
that the checks and the writer read differently (an empty one, the working directory to the
writer; a ``file://`` URL): the directory it names is checked, never replaced with its files.
What ``convert --to torch.save`` writes is read back: a complex value by ckptio itself, and the
keys ``torch.load(weights_only=True)`` refuses named exactly (a defaultdict, not a bytearray).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import io
import os
import pickle
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem

import ckptio
from ckptio import convert_writers
from ckptio.cli import main
from ckptio.convert import convert
from ckptio.testing.cli_process import run_cli
from test_cli_interop import _one_line_error

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
OPTS = ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20)


def ckptio_cmd(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env=ENV, timeout=180)


def _saved(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    ckptio.save({"model": {"w": torch.arange(4096.0)}, "step": 3}, src, options=OPTS)
    return src


class _Failing(io.FileIO):
    """A file whose writes, after its first two, fail as ``fault`` says (a full disk, or a
    Ctrl-C arriving) with half their bytes written, as a real one does: torch.save's zip writer
    then fails again as it closes, with a RuntimeError ("unexpected pos ...")."""

    fault: type[BaseException] = OSError
    writes = 0

    def write(self, data: Any) -> int:
        self.writes += 1
        if self.writes <= 2:
            return super().write(data)
        view = memoryview(data).cast("B")
        super().write(view[:len(view) // 2])
        if self.fault is OSError:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise self.fault()


def _failing(fault: type[BaseException]) -> type[_Failing]:
    return type("Failing", (_Failing,), {"fault": fault})


def _left(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name != "src")


# ------------------------------------------------------------------------------------------------
# a full disk or a Ctrl-C while convert writes


@pytest.mark.parametrize("to", ["torch.save", "torch_checkpointing"])
def test_a_full_disk_under_torch_save_is_one_line(monkeypatch, tmp_path: Path, capsys,
                                                  to: str) -> None:
    src = _saved(tmp_path)
    monkeypatch.setattr(convert_writers, "open", _failing(OSError), raising=False)
    status = main(["convert", "--to", to, str(src), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.count("\n") == 1 and err.startswith("ckptio: error: convert to "), err
    assert "No space left on device" in err and str(tmp_path / "out") in err
    assert "unexpected pos" not in err
    assert _left(tmp_path) == []  # no DST, no temporary


@pytest.mark.parametrize("to", ["torch.save", "torch_checkpointing"])
def test_ctrl_c_under_torch_save_is_an_interrupt(monkeypatch, tmp_path: Path, capsys,
                                                 to: str) -> None:
    src = _saved(tmp_path)
    monkeypatch.setattr(convert_writers, "open", _failing(KeyboardInterrupt), raising=False)
    assert main(["convert", "--to", to, str(src), str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err == "ckptio: interrupted\n"
    assert _left(tmp_path) == []


@pytest.mark.parametrize("fault", [OSError, KeyboardInterrupt])
def test_a_full_disk_or_ctrl_c_under_dcp_save(monkeypatch, tmp_path: Path, capsys,
                                              fault: type[BaseException]) -> None:
    src = _saved(tmp_path)

    @contextlib.contextmanager
    def create_stream(self: Any, path: Any, mode: str) -> Iterator[io.IOBase]:
        with _failing(fault)(str(path), mode) as stream:
            yield stream

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "torch.distributed is disabled"
        status = main(["convert", "--to", "dcp", str(src), str(tmp_path / "out")])
    err = capsys.readouterr().err
    if fault is KeyboardInterrupt:
        assert (status, err) == (130, "ckptio: interrupted\n")
    else:
        assert status == 2 and err.count("\n") == 1, err
        assert "No space left on device" in err and "dcp.save failed" not in err, err
    assert _left(tmp_path) == []


# ------------------------------------------------------------------------------------------------
# --overwrite onto another format's checkpoint


def test_overwrite_onto_another_format_is_refused_not_mixed(tmp_path: Path) -> None:
    src = _saved(tmp_path)
    dcp_dir = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(dcp_dir), no_dist=True)
    before = sorted(p.name for p in dcp_dir.iterdir())
    _one_line_error(ckptio_cmd("convert", "--overwrite", str(src), str(dcp_dir)),
                    str(dcp_dir), "holds a DCP checkpoint", "would hold both", "remove it")
    assert sorted(p.name for p in dcp_dir.iterdir()) == before  # nothing written beside it
    other = tmp_path / "other"
    ckptio.save({"w": torch.ones(2)}, other, options=OPTS)
    before = sorted(p.name for p in other.iterdir())
    _one_line_error(ckptio_cmd("convert", "--to", "safetensors", "--drop-non-tensors",
                               "--overwrite", str(src), str(other)),
                    "holds a ckptio checkpoint", "would hold both")
    _one_line_error(ckptio_cmd("export", "--overwrite", str(src), str(other)),
                    "holds a ckptio checkpoint", "would hold both")
    assert sorted(p.name for p in other.iterdir()) == before
    assert torch.equal(ckptio.load(other)["w"], torch.ones(2))
    # the same format is still replaced
    done = ckptio_cmd("convert", "--overwrite", str(src), str(other))
    assert done.returncode == 0, done.stderr
    assert torch.equal(ckptio.load(other)["model"]["w"], torch.arange(4096.0))


# ------------------------------------------------------------------------------------------------
# a symbolic link that leads nowhere


def test_a_dangling_symlink_is_named_as_one(tmp_path: Path) -> None:
    src = _saved(tmp_path)
    link = tmp_path / "ckpt"
    link.symlink_to(tmp_path / "gone")
    for args in (("ls", str(link)), ("verify", str(link)), ("convert", str(link), "x")):
        line = _one_line_error(ckptio_cmd(*args), f"{link} is a symbolic link to",
                               "fix the link")
        assert "did you mean" not in line
    line = _one_line_error(ckptio_cmd("convert", str(src), str(link)), "symbolic link",
                           "fix the link")
    assert "exists and is not a directory" not in line
    status = ckptio_cmd("status", str(link))
    assert status.returncode == 2 and "symbolic link" in status.stdout, status.stdout
    assert "did you mean" not in status.stdout


# ------------------------------------------------------------------------------------------------
# a DST spelled so that the checks and the writer saw different places


@pytest.mark.parametrize("to", ["dcp", "torch_checkpointing", "torch.save", "ckptio"])
def test_an_empty_dst_is_refused_not_the_working_directory(monkeypatch, tmp_path: Path, capsys,
                                                           to: str) -> None:
    src = _saved(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    monkeypatch.chdir(work)  # `ckptio convert src "$OUT" --to dcp` with OUT unset
    assert main(["convert", "--to", to, str(src), ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ckptio: error: convert: DST is empty") and err.count("\n") == 1, err
    assert sorted(os.listdir(work)) == ["keep.txt"]
    assert main(["export", "--overwrite", str(src), ""]) == 2
    assert "destination is empty" in capsys.readouterr().err
    assert sorted(os.listdir(work)) == ["keep.txt"]


def test_a_file_url_dst_is_checked_where_it_is_written(tmp_path: Path) -> None:
    src = _saved(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    for to in ("dcp", "torch_checkpointing"):
        _one_line_error(ckptio_cmd("convert", "--to", to, str(src), f"file://{mine}"),
                        "holds files that are not a checkpoint")
    _one_line_error(ckptio_cmd("convert", "--to", "torch.save", str(src), f"file://{mine}"),
                    "is a directory")
    assert sorted(os.listdir(mine)) == ["keep.txt"]


# ------------------------------------------------------------------------------------------------
# what convert --to torch.save writes, read back


def test_a_complex_value_round_trips_through_torch_save(tmp_path: Path) -> None:
    src = tmp_path / "src"
    ckptio.save({"w": torch.ones(2), "phase": complex(0.5, -1.0)}, src, options=OPTS)
    out = tmp_path / "out.pt"
    done = ckptio_cmd("convert", "--to", "torch.save", str(src), str(out))
    assert done.returncode == 0 and "weights_only" not in done.stdout, done
    assert torch.load(out, weights_only=True)["phase"] == complex(0.5, -1.0)
    listed = ckptio_cmd("ls", str(out))  # ckptio reads back what it wrote
    assert listed.returncode == 0 and "(0.5-1j)" in listed.stdout, listed.stderr
    same = ckptio_cmd("diff", str(src), str(out))
    assert same.returncode == 0, same.stdout + same.stderr
    assert ckptio.load(out)["phase"] == complex(0.5, -1.0)


def test_torch_save_names_exactly_what_weights_only_refuses(tmp_path: Path) -> None:
    src = tmp_path / "src"
    ckptio.save({"w": torch.ones(2), "counts": collections.defaultdict(int, {"a": 1}),
                 "raw": bytearray(b"xy"), "opt": {"lr": 0.1}}, src, options=OPTS)
    done = convert(src, tmp_path / "out.pt", to="torch.save")
    assert done.needs_pickle == ("counts",)
    with pytest.raises(pickle.UnpicklingError, match="defaultdict"):
        torch.load(tmp_path / "out.pt", weights_only=True)


# ------------------------------------------------------------------------------------------------
# keys that would break or hide a line of ls and diff


def test_odd_keys_are_one_visible_word_in_ls_and_diff(tmp_path: Path) -> None:
    src = tmp_path / "odd"
    ckptio.save({"ünï": torch.ones(2), "nl\nkey": torch.ones(1), "": torch.ones(1),
                 "tab\tk": {"in": 3}}, src, options=OPTS)
    other = _saved(tmp_path)
    flat = ckptio_cmd("ls", "--flat", str(src))
    assert flat.returncode == 0, flat.stderr
    keys = [line.split()[0] for line in flat.stdout.splitlines()[2:]]  # after header and titles
    assert keys == ["ünï", r"'nl\nkey'", "''", r"'tab\tk.in'"], flat.stdout
    tree = ckptio_cmd("ls", str(src))
    assert tree.stdout.count("\n") == 2 + 5, tree.stdout  # 5 nodes: 4 keys, 1 nested
    diff = ckptio_cmd("diff", str(src), str(other))
    assert diff.returncode == 1
    marks = [line.split()[:2] for line in diff.stdout.splitlines()[:-1]]
    assert ["-", r"'nl\nkey'"] in marks and ["-", "''"] in marks, diff.stdout
    assert all(m[0] in "-+~?" for m in marks), diff.stdout


def test_a_device_pipe_or_socket_dst_is_never_replaced(tmp_path: Path) -> None:
    """`ckptio convert ck /dev/null --to torch.save` replaced /dev/null with a regular file (as
    root), without --overwrite: every target renamed its output over whatever DST was."""
    src = _saved(tmp_path)
    fifo = tmp_path / "fifo"
    for to in ("dcp", "torch_checkpointing", "torch.save"):
        os.mkfifo(fifo)
        for extra in ((), ("--overwrite",)):
            _one_line_error(ckptio_cmd("convert", "--to", to, *extra, str(src), str(fifo)),
                            "neither a file nor a directory")
            assert fifo.is_fifo(), to
        fifo.unlink()


def test_a_terminal_without_the_keys_characters_gets_them_escaped_not_a_traceback(
        tmp_path: Path) -> None:
    """PYTHONIOENCODING=ascii (a C locale's terminal): a non-ASCII key was a UnicodeEncodeError
    traceback; now it is printed escaped, exit 0."""
    path = tmp_path / "ck"
    ckptio.save({"gewicht_\u00e4": torch.zeros(2), "\u043a\u043b\u044e\u0447": 1}, path)
    done = subprocess.run([sys.executable, "-m", "ckptio", "ls", str(path)], capture_output=True,
                          env={**os.environ, "PYTHONIOENCODING": "ascii"}, timeout=120)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert b"gewicht_\\xe4" in done.stdout and b"\\u043a\\u043b" in done.stdout
    assert b"Traceback" not in done.stderr


@pytest.mark.parametrize("to", ["ckptio", "safetensors", "dcp"])
def test_convert_into_a_managers_run_directory_is_refused_even_with_overwrite(
        tmp_path: Path, to: str) -> None:
    """`ckptio convert ts.pt run`, run a CheckpointManager's directory: a ckptio or safetensors
    target was written at its root (ls then showed it instead of the steps); now every target
    is refused, even with --overwrite, and the steps stay."""
    run = tmp_path / "run"
    with ckptio.CheckpointManager(str(run)) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((2,), float(step))})
    torch.save({"w": torch.zeros(2)}, tmp_path / "ts.pt")
    with pytest.raises(ckptio.CkptError, match="holds a run of steps .*even with --overwrite"):
        convert(tmp_path / "ts.pt", run, to=to, overwrite=True)
    assert sorted(n for n in os.listdir(run) if not n.startswith(".")) == ["step-1", "step-2"]
    assert not (run / "manifest.json").exists()
    assert ckptio.load(run / "step-2")["w"].tolist() == [2.0, 2.0]


def test_convert_refuses_a_directory_dst_for_torch_save_and_an_hf_folder_for_dcp(
        tmp_path: Path) -> None:
    """`convert ck nd/ --to torch.save` wrote a file named nd; `--to dcp --overwrite` onto a
    Hugging Face folder replaced it whole, its config.json (and a tokenizer) deleted."""
    src = tmp_path / "ck"
    ckptio.save({"w": torch.ones(2)}, src)
    with pytest.raises(ckptio.CkptError, match="is a directory, and torch.save writes one file"):
        convert(src, f"{tmp_path / 'nd'}/", to="torch.save")
    assert not (tmp_path / "nd").exists()
    hf = tmp_path / "hf"
    convert(src, hf, to="safetensors")
    (hf / "config.json").write_text("{}")
    for to in ("dcp", "torch_checkpointing"):
        with pytest.raises(ckptio.CkptError, match="would replace the directory whole"):
            convert(src, hf, to=to, overwrite=True)
    assert (hf / "config.json").read_text() == "{}" and (hf / "model.safetensors").is_file()


def test_ls_verify_and_diff_of_a_dcp_checkpoint_holding_a_pickled_object_say_their_fix(
        tmp_path: Path) -> None:
    """A DCP value item that only unpickling opens (an argparse.Namespace): the commands said
    "needs load(..., allow_pickle=True)", an option none of them has, with torch's terminal
    styling codes in the text; later they refused the whole checkpoint. Now each opens it
    without unpickling: ls lists the value as pickled bytes, verify checks them, diff
    compares them (tests/test_rt_known.py: a load names the key and the opt-in)."""
    import argparse

    path = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3), "ns": argparse.Namespace(a=1)}, checkpoint_id=str(path),
                 no_dist=True)
    listed = ckptio_cmd("ls", str(path))
    assert listed.returncode == 0 and "\x1b[" not in listed.stdout, listed
    assert any(line.split()[:2] == ["ns", "torch_pickle"] for line in listed.stdout.splitlines())
    checked = ckptio_cmd("verify", str(path))
    assert checked.returncode == 0 and "OK" in checked.stdout, checked
    same = ckptio_cmd("diff", str(path), str(path))
    assert same.returncode == 0 and "the same" in same.stdout, same
