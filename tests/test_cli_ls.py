"""The ``ckptio`` command for people who make mistakes (issue 30, section 5): ``ls RUN_DIR`` lists
a CheckpointManager's steps (committed, incomplete, being deleted: never an internal
``.deleting-*`` name as a checkpoint) with sizes people read, ``--version``, ``verify`` naming
every damaged tensor with verify's own advice, ``diff`` of a converted checkpoint comparing data
(or one line naming ``--data``), and progress bars drawn on a real terminal (a pty).

Everything runs the command in a process of its own on real checkpoints: forked from a warm
interpreter (ckptio.testing.cli_process: torch imported once, not per command), and
``python -m ckptio`` itself where a fresh interpreter is the point (``--version``, and that the
warm runs say what ``python -m ckptio`` says); in-process runs (``cli.main``) only where a module
constant is changed for the test.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio import cli
from ckptio.cli import diff as cli_diff
from ckptio.cli.ls import human_size
from ckptio.storage.local.local_root import LocalRoot
from ckptio.testing.cli_process import run_cli, start_cli

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def python_m_ckptio(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m ckptio ARGS`` in a fresh interpreter, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "ckptio", *args], capture_output=True,
                          text=True, env=ENV, timeout=120, check=False)


def ckptio_cmd(*args: str) -> subprocess.CompletedProcess[str]:
    """``ckptio ARGS`` in a process of its own forked from a warm interpreter (stdout and
    stderr pipes); test_warm_runs_say_what_python_m_ckptio_says checks it against the above."""
    return run_cli(*args, env=ENV)


def _run_dir(tmp_path: Path) -> Path:
    """A manager's run: steps 10 and 20 committed, 30 interrupted (its manifest never
    committed), 5 hidden by a retention and not yet removed (as a kill between the rename and
    the removal leaves it)."""
    run = tmp_path / "run"
    manager = ckptio.CheckpointManager(run, keep_last=None)
    for step in (5, 10, 20, 30):
        manager.save(step, {"w": torch.full((256, 64), float(step)), "step": step})
    manager.close()
    (run / "step-30" / "manifest.json").unlink()  # what a save killed before its commit leaves
    assert LocalRoot(str(run)).hide(5)  # the retention's own rename: .deleting-step-5-<hex>
    assert any(p.name.startswith(".deleting-step-5-") for p in run.iterdir())
    return run


# ------------------------------------------------------------------------------------------------
# ls


def test_ls_of_a_run_lists_its_steps_and_never_a_deleting_name_as_a_checkpoint(tmp_path: Path):
    run = _run_dir(tmp_path)
    done = ckptio_cmd("ls", str(run))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"{run}: 3 step(s): 2 committed, 1 incomplete; 1 being deleted;")
    rows = [line.split() for line in lines[2:]]
    # STEP STATE SIZE LOGICAL FILES TIME BASE: a committed step's LOGICAL is a size, its BASE
    # "full" (or the steps a delta references); other steps show "-" and no base
    assert [(r[0], " ".join(r[1:-6] if r[-1] != "full" else r[1:-8])) for r in rows] == [
        ("5", "being deleted"), ("10", "committed"), ("20", "committed"), ("30", "incomplete")]
    assert ".deleting" not in done.stdout
    assert rows[1][-1] == "full" and rows[0][-4] == "-"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", rows[1][-3])

    doc = json.loads(ckptio_cmd("ls", "--json", str(run)).stdout)
    assert doc["schema"] == "ckptio.run/1" and doc["location"] == str(run)
    by_step = {s["step"]: s for s in doc["steps"]}
    assert {s: by_step[s]["state"] for s in by_step} == {
        5: "being deleted", 10: "committed", 20: "committed", 30: "incomplete"}
    assert by_step[10]["nbytes"] == sum(p.stat().st_size for p in (run / "step-10").iterdir())
    assert by_step[10]["path"] == str(run / "step-10")
    assert by_step[10]["files"] == len(list((run / "step-10").iterdir()))
    assert abs(by_step[10]["mtime"] - (run / "step-10" / "manifest.json").stat().st_mtime) < 1
    assert rows[1][-8:-6] == human_size(by_step[10]["nbytes"]).split()  # 64.8 KiB, not bytes
    assert rows[1][-8:-6][1] == "KiB"
    assert by_step[10]["bases"] == [] and by_step[10]["logical_nbytes"] == 64 * 256 * 4
    assert by_step[30]["logical_nbytes"] is None

    exact = ckptio_cmd("ls", "--bytes", str(run)).stdout.splitlines()
    assert exact[3].split()[2] == str(by_step[10]["nbytes"])


def test_ls_of_one_step_still_lists_what_it_holds(tmp_path: Path):
    run = _run_dir(tmp_path)
    done = ckptio_cmd("ls", str(run / "step-20"))
    assert done.returncode == 0, done.stderr
    assert "ckptio checkpoint" in done.stdout.splitlines()[0]
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()[2:]}
    assert rows["w"][1:4] == ["tensor", "float32", "[256,"] and rows["w"][5:7] == ["64.0", "KiB"]
    exact = {line.split()[0]: line.split() for line in
             ckptio_cmd("ls", "--bytes", str(run / "step-20")).stdout.splitlines()[2:]}
    assert exact["w"][5] == str(256 * 64 * 4)
    # an interrupted step is an error naming what it is, not a listing
    bad = ckptio_cmd("ls", str(run / "step-30"))
    assert bad.returncode == 2 and "interrupted" in bad.stderr and "Traceback" not in bad.stderr


def test_ls_of_a_directory_of_nothing_says_so(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    done = ckptio_cmd("ls", str(tmp_path / "empty"))
    assert done.returncode == 2 and "holds no ckptio checkpoint" in done.stderr


@pytest.mark.parametrize(("nbytes", "text"), [(0, "0 B"), (48, "48 B"), (1023, "1023 B"),
                                              (1536, "1.5 KiB"), (3 * 2**30, "3.0 GiB")])
def test_human_sizes(nbytes: int, text: str):
    assert human_size(nbytes) == text


def test_version():
    done = python_m_ckptio("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"ckptio {ckptio.__version__}"


def test_warm_runs_say_what_python_m_ckptio_says(tmp_path: Path):
    """The forked runs of ckptio_cmd (this file's and tests/test_cli_interop.py's) against
    ``python -m ckptio`` in a fresh interpreter: the same exit status, stdout and stderr for a
    report of damage (read through torch), a one-line error, a diff and a conversion."""
    ckptio.save({f"t{i}": torch.full((1024,), float(i)) for i in range(3)}, tmp_path / "a")
    ckptio.save({f"t{i}": torch.full((1024,), float(i + 1)) for i in range(3)}, tmp_path / "b")
    torch.save({"w": torch.ones(4)}, tmp_path / "m.pt")
    _flip(tmp_path / "b", {"t1"})
    for args in (("verify", str(tmp_path / "b")), ("ls", str(tmp_path / "nope")),
                 ("diff", str(tmp_path / "a"), str(tmp_path / "b"))):
        fresh, warm = python_m_ckptio(*args), ckptio_cmd(*args)
        assert (warm.returncode, warm.stdout, warm.stderr) == (
            fresh.returncode, fresh.stdout, fresh.stderr), args
        assert fresh.stdout or fresh.stderr, args
    # a command that writes (and imports what a conversion needs on its own): the same words
    fresh = python_m_ckptio("convert", str(tmp_path / "m.pt"), str(tmp_path / "fresh"))
    warm = ckptio_cmd("convert", str(tmp_path / "m.pt"), str(tmp_path / "warm"))
    said = warm.stdout.replace(str(tmp_path / "warm"), str(tmp_path / "fresh"))
    assert (warm.returncode, said, warm.stderr) == (
        fresh.returncode, fresh.stdout, fresh.stderr) and fresh.returncode == 0, fresh.stderr


# ------------------------------------------------------------------------------------------------
# verify


def _flip(path: Path, keys: set[str]) -> None:
    """Flip one byte inside each of ``keys``' stored bytes."""
    manifest = json.loads((path / "manifest.json").read_bytes().split(b"\n", 1)[1])
    for entry in manifest["tensors"]:
        if entry["key"] in keys:
            with open(path / entry["file"], "r+b") as f:
                f.seek(entry["offset"] + 7)
                byte = f.read(1)
                f.seek(entry["offset"] + 7)
                f.write(bytes([byte[0] ^ 0x10]))


def test_verify_names_every_damaged_tensor_with_advice_for_verify(tmp_path: Path):
    path = tmp_path / "c"
    ckptio.save({f"t{i}": torch.full((4096,), float(i)) for i in range(6)}, path)
    assert ckptio_cmd("verify", str(path)).returncode == 0
    _flip(path, {"t1", "t4"})
    done = ckptio_cmd("verify", str(path))
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"{path}: DAMAGED, 2 of 6 tensor(s) fail verification")
    assert [line.split()[0] for line in lines[1:3]] == ["t1", "t4"]
    assert all("checksum mismatch" in line for line in lines[1:3])
    assert "restore an earlier checkpoint" in lines[-1]
    # a load's advice ("a load that stops here may have filled ...") is not verify's
    assert "load that stops" not in done.stdout and "load an earlier" not in done.stdout


def test_verify_names_every_tensor_of_a_truncated_file(tmp_path: Path):
    path = tmp_path / "c"
    ckptio.save({f"t{i}": torch.full((1024,), float(i)) for i in range(4)}, path)
    (data,) = path.glob("data-*")
    manifest = json.loads((path / "manifest.json").read_bytes().split(b"\n", 1)[1])
    t2 = next(e for e in manifest["tensors"] if e["key"] == "t2")
    os.truncate(data, t2["offset"] + 10)  # t0 and t1 whole, t2 cut, t3 gone
    done = ckptio_cmd("verify", str(path))
    assert done.returncode == 1, (done.stdout, done.stderr)
    (cut,) = done.stdout.splitlines()[1:-1]  # one line for the short file
    assert cut.endswith(f"is truncated: it ends at byte {t2['offset'] + 10} of the "
                        f"{4 * 4096} bytes the manifest records; the 2 tensor(s) stored past "
                        "that fail (t2, t3)"), cut
    data.unlink()  # every tensor gone: named as missing, and no "the keys not listed" advice
    gone = ckptio_cmd("verify", str(path))
    lines = gone.stdout.splitlines()
    assert gone.returncode == 1 and [line.split()[0] for line in lines[1:-1]] == [
        "t0", "t1", "t2", "t3"], gone.stdout
    assert all("the file is missing" in line for line in lines[1:-1]), gone.stdout
    assert lines[-1].endswith("does not load: restore an earlier checkpoint or another copy of "
                              "this one")


# ------------------------------------------------------------------------------------------------
# diff of a converted checkpoint


def _dcp_and_converted(tmp_path: Path, shift: float = 0.0) -> tuple[Path, Path]:
    state = {"w": torch.randn(64, 8, generator=torch.Generator().manual_seed(0)), "step": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    state["w"][0, 0] += shift
    ckptio.save(state, tmp_path / "c")
    return tmp_path / "dcp", tmp_path / "c"


def test_diff_of_a_converted_checkpoint_compares_data(tmp_path: Path):
    a, b = _dcp_and_converted(tmp_path)
    same = ckptio_cmd("diff", str(a), str(b))
    assert same.returncode == 0, same.stdout
    assert same.stdout.strip().endswith("the same (1 tensor(s) compared by their data (other "
                                        "checksum algorithms (crc32 vs xxh3_64_tree)), the rest by "
                                        "stored checksums)")
    other_a, other_b = _dcp_and_converted(tmp_path / "x", shift=0.5)
    differs = ckptio_cmd("diff", str(other_a), str(other_b))
    assert differs.returncode == 1
    assert differs.stdout.splitlines()[0].split()[:4] == ["~", "w", "data", "differs:"]


def test_diff_of_objects_saved_through_state_dict_and_their_conversions(tmp_path: Path):
    """The README's way (the model and optimizer themselves in the state): the state_dict()
    mark only ckptio's format records is no difference from a torch.save conversion; a DCP
    conversion keys the optimizer's state by parameter name (DCP's get_state_dict form), the
    only difference diff shows; between two ckptio checkpoints the mark still is one."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    opt.step()
    ckptio.save({"model": model, "optim": opt, "step": 3}, tmp_path / "step-3")
    for to, name in (("dcp", "conv.dcp"), ("torch.save", "conv.pt")):
        assert ckptio_cmd("convert", str(tmp_path / "step-3"), str(tmp_path / name),
                          "--to", to).returncode == 0
        same = ckptio_cmd("diff", str(tmp_path / name), str(tmp_path / "step-3"))
        if to == "torch.save":
            assert same.returncode == 0 and "the same" in same.stdout, same.stdout
            continue
        lines = [line.split()[1] for line in same.stdout.splitlines()[:-1]]
        assert same.returncode == 1 and lines, same.stdout
        assert all(k.startswith(("optim.state.", "optim.param_groups.0.params.")) for k in lines)
        assert "optim.state.weight.exp_avg" in lines and "optim.state.0.exp_avg" in lines
    ckptio.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 3},
                tmp_path / "plain")
    marked = ckptio_cmd("diff", str(tmp_path / "plain"), str(tmp_path / "step-3"))
    assert marked.returncode == 1 and "nesting dict/dict -> dict/state_dict/dict" in marked.stdout


def test_diff_too_large_to_read_says_in_one_line_which_flag_does(monkeypatch, tmp_path: Path,
                                                                 capsys):
    a, b = _dcp_and_converted(tmp_path)
    monkeypatch.setattr(cli_diff, "AUTO_DATA_NBYTES", 1024)  # w is 2 KiB
    assert cli.main(["diff", str(a), str(b)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("? w ") and lines[0].endswith(
        "not compared: other checksum algorithms (crc32 vs xxh3_64_tree); ckptio diff --data reads "
        "and compares them")
    assert cli.main(["diff", "--data", str(a), str(b)]) == 0


# ------------------------------------------------------------------------------------------------
# progress bars, on a terminal


def test_follow_draws_an_async_save_to_its_end(tmp_path: Path, capsys, monkeypatch):
    """progress.follow, the hook convert uses for its save: 100 % drawn before the bar goes."""
    from ckptio.cli import progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    state = {f"t{i}": torch.full((64 << 10,), float(i)) for i in range(8)}
    result = progress.follow(ckptio.async_save(state, tmp_path / "c"), "convert", True)
    assert result.nbytes >= 8 * (256 << 10)
    assert "100%" in capsys.readouterr().err
    assert ckptio_cmd("verify", str(tmp_path / "c")).returncode == 0


def _on_a_terminal(*args: str) -> tuple[int, str]:
    """Run ``ckptio ARGS`` with stderr on a pty (stdout a pipe); -> (status, what the pty got)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    proc, out, _ = start_cli(*args, env=ENV, stderr_fd=slave)
    os.close(slave)
    got = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the pty
                break
            if not chunk:
                break
            got += chunk
        elif proc.exitcode is not None:
            break
    proc.join(timeout=60)
    os.close(master)
    os.close(out)
    return proc.exitcode, got.decode(errors="replace")


@pytest.mark.parametrize("command", ["verify", "diff --data", "convert", "convert --to safetensors",
                                     "export"])
def test_long_commands_draw_a_moving_bar_on_a_terminal(tmp_path: Path, command: str):
    state: dict[str, Any] = {f"t{i}": torch.full((64 << 10,), float(i)) for i in range(8)}
    ckptio.save(state, tmp_path / "a")
    torch.save(state, tmp_path / "a.pt")
    args = {"verify": ["verify", str(tmp_path / "a")],
            "diff --data": ["diff", "--data", str(tmp_path / "a"), str(tmp_path / "a")],
            "convert": ["convert", str(tmp_path / "a.pt"), str(tmp_path / "b")],
            "convert --to safetensors": ["convert", "--to", "safetensors", str(tmp_path / "a"),
                                         str(tmp_path / "st")],
            "export": ["export", "--keys", "", str(tmp_path / "a"), str(tmp_path / "hf")],
            }[command]
    status, drawn = _on_a_terminal(*args)
    assert status == 0, drawn
    name = args[0]
    assert f"{name}:" in drawn and "0%" in drawn and "100%" in drawn, drawn  # tqdm's bar
    again = [*args[:1], "--no-progress", *args[1:]]
    if name != "verify" and args[0] != "diff":
        again.insert(2, "--overwrite")
    quiet, silent = _on_a_terminal(*again)
    assert quiet == 0 and "%" not in silent, silent


def test_every_command_and_argument_says_what_it_is() -> None:
    """Each subcommand has a help line, each of its arguments a help text (positional ones
    included); verify's description states its exit statuses; the top-level description lists
    every command, one per line, within 100 columns."""
    import argparse

    from ckptio.cli import _parser

    parser = _parser([])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helped = {c.dest for c in sub._choices_actions if c.help}
    assert helped == set(sub.choices), set(sub.choices) - helped
    for name, command in sub.choices.items():
        for action in command._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, f"ckptio {name}: {action.dest} has no help"
    assert "Exit 0: every byte checks; 1: damage found" in sub.choices["verify"].description
    lines = parser.description.splitlines()
    assert max(map(len, lines)) <= 100
    assert [n for n in sub.choices if not any(line.startswith(f"  {n} ") for line in lines)] == []


def test_verify_of_a_run_checks_every_committed_step(tmp_path, capsys) -> None:
    """``ckptio verify RUN``: each committed step reported in turn, a damaged one named in
    the summary with exit 1 (the others still checked), an incomplete one said unchecked."""
    import torch

    import ckptio
    from ckptio.cli import main

    run = tmp_path / "run"
    mgr = ckptio.CheckpointManager(run)
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.full((4,), float(step))})
    mgr.close()
    assert main(["verify", str(run), "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"{run}: 3 committed step(s) checked, every one OK")
    data = next((run / "step-2").glob("data-*.bin"))
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))
    (run / "step-4").mkdir()
    (run / "step-4" / "data-0000000000000000000-r00000-0000.bin").write_bytes(b"\0" * 8)
    assert main(["verify", str(run), "--no-progress"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == (f"{run}: 3 committed step(s) checked, 1 damaged: steps [2]; incomplete "
                       "steps [4] not checked (no committed manifest)")
    assert f"{run}/step-3: OK" in "\n".join(out)


def test_verify_of_a_file_cut_halfway_says_where_it_ends_in_one_line(tmp_path: Path) -> None:
    """94 tensors, their data file cut in the middle: one line names the file and the byte it
    ends at, and the tensors past it, not one line per tensor."""
    ckptio.save({f"layer{i}.weight": torch.full((64, 64), float(i)) for i in range(94)},
                tmp_path / "ck")
    (data,) = tmp_path.joinpath("ck").glob("data-*")
    half = data.stat().st_size // 2 + 1000  # inside a tensor
    os.truncate(data, half)
    done = ckptio_cmd("verify", "--no-progress", str(tmp_path / "ck"))
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) <= 4, done.stdout
    (cut,) = [line for line in lines if "is truncated" in line]
    assert f"{data.name} is truncated: it ends at byte {half} of the" in cut, cut
    assert re.search(r"the 47 tensor\(s\) stored past that fail \(layer47\.weight \.\.\. "
                     r"layer93\.weight\)", cut), cut


def test_status_of_one_checkpoint_or_a_directory_of_other_names_is_not_a_run(
        tmp_path: Path) -> None:
    ckptio.save({"w": torch.zeros(4)}, tmp_path / "ck")
    done = ckptio_cmd("status", str(tmp_path / "ck"))
    assert done.returncode == 2, done.stdout
    assert "not a run: it is itself a ckptio checkpoint" in done.stdout, done.stdout
    assert "committed -" not in done.stdout
    (tmp_path / "runs" / "run-a").mkdir(parents=True)
    (tmp_path / "runs" / "run-b").mkdir()
    done = ckptio_cmd("status", str(tmp_path / "runs"))
    assert done.returncode == 2 and "not a run: it holds no step-<N> checkpoint, only run-a, " \
                                      "run-b" in done.stdout, done.stdout
    (tmp_path / "fresh").mkdir()  # a tier nothing was saved in yet: as before
    done = ckptio_cmd("status", str(tmp_path / "fresh"))
    assert done.returncode == 0 and "committed -" in done.stdout, done.stdout
