"""The recovery benchmark (benchmarks/recovery.py, docs/BENCH_RECOVERY.md): its smoke run as a
user types it (``python -m benchmarks.recovery --quick``, a fresh process: 2 hosts, torchrun's
elastic agents, host 1 killed, its memory wiped, a replacement agent) restores every rank from a
checkpoint (host 1 from its partner's copy) and ends bitwise where an uninterrupted run does, with
every phase on the time line; the same without a relaunch (``--restart inprocess``: a hot spare
takes the lost rank, the survivor keeps its process); and the report's phases from hand-made
events: they add up to the total, a wrong final state or a rank started fresh fails the run.
On benchmarks/harness.py: the sources' run order (harness.schedule: reversed on odd
repetitions), the report's medians (harness.spread) and tables (harness.markdown_table), the
disk checkpoints' eviction (harness.cold with only=True: those files alone, no drop_caches),
and every documented command line (docs/BENCH_RECOVERY.md, the module's docstring) still parses.

The smoke run takes the best hosts possible here (network namespaces as root; else hosts simulated
on 127.0.0.1 with CKPTIO_HOST_ID, as tests/test_hosts.py does), and says which in its output.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import harness, recovery
from benchmarks.recovery import QUICK, parse_args, run_all
from benchmarks.recovery_report import PHASES, markdown, summarize, timeline

ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_recovers_bitwise(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.recovery", "--quick", "--timeout",
                           "120", "--dir", str(tmp_path / "w"), "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    (run,) = result["summary"]["runs"]
    assert run["ok"] and run["bitwise"], run.get("why")
    assert [r["step"] for r in run["ranks"]] == [2, 2]  # the kill step, protected on both
    assert [r["source"] for r in run["ranks"]] == ["own", "partner"]
    assert all(run["phases"][p] is not None and run["phases"][p] >= 0 for p in PHASES)
    assert abs(sum(run["phases"].values()) - run["total_s"]) < 1e-6
    assert run["detail"]["replacement_agent_ready"] is not None  # host 1's agent was replaced
    assert "| partners | 1/1 |" in done.stdout


def test_quick_run_without_a_relaunch_recovers_bitwise(tmp_path: Path) -> None:
    """``--restart inprocess``: no agent; the survivor keeps its process and rolls back from its
    own memory, the hot spare (a third host) takes rank 1 and restores its partner's copy."""
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.recovery", "--quick", "--restart",
                           "inprocess", "--timeout", "120", "--dir", str(tmp_path / "w"),
                           "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run,) = json.loads(out.read_text())["summary"]["runs"]
    assert run["ok"] and run["bitwise"], run.get("why")
    assert [(r["step"], r["source"]) for r in run["ranks"]] == [(2, "own"), (2, "partner")]
    assert list(run["phases"]) == ["detection", "reform", "restore", "first_step"]
    assert all(v is not None and v >= 0 for v in run["phases"].values())
    assert abs(sum(run["phases"].values()) - run["total_s"]) < 1e-6
    assert run["detail"]["spare_told"] is not None  # the spare took the lost rank
    assert "restart: inprocess" in done.stdout and "| partners | 1/1 |" in done.stdout


def _ev(t: float, ev: str, kind: str, pid: int, **extra: Any) -> dict[str, Any]:
    return {"t": t, "ev": ev, "kind": kind, "pid": pid, **extra}


def _run(digests: list[str], restored: tuple[int, int] = (4, 4)) -> dict[str, Any]:
    """Two hosts, host 1 killed at t=100: its old agent (pid 2) gone, a replacement (pid 3)."""
    events = [_ev(90, "agent_start", "a", 1, host="0"), _ev(90, "agent_start", "a", 2, host="1")]
    events += [_ev(100.5, "workers_failed", "a", 1, host="0"),
               _ev(100.6, "rendezvous_begin", "a", 1, host="0"),
               _ev(100.2, "agent_start", "a", 3, host="1"),
               _ev(102.0, "agent_ready", "a", 3, host="1"),
               _ev(102.1, "rendezvous_begin", "a", 3, host="1")]
    for pid in (1, 3):
        events += [_ev(103, "rendezvous_end", "a", pid, host=str(pid // 3)),
                   _ev(103.1, "start_workers_end", "a", pid, host=str(pid // 3)),
                   _ev(120, "agent_exit", "a", pid, host=str(pid // 3))]
    for rank in (0, 1):
        pid = 10 + rank
        events += [_ev(103.2, "start", "w", pid, rank=rank), _ev(105, "imported", "w", pid, rank=rank),
                   _ev(105.1 + rank, "pg", "w", pid, rank=rank),
                   _ev(106.5, "built", "w", pid, rank=rank),
                   _ev(107, "engine", "w", pid, rank=rank),
                   _ev(107.5 + rank / 10, "restored", "w", pid, rank=rank, step=restored[rank],
                       source="own"),
                   _ev(108, "step", "w", pid, rank=rank, step=5),
                   _ev(109, "final", "w", pid, rank=rank, digest=digests[rank])]
    return {"source": "partners", "rep": 0, "t_kill": 100.0, "victim": 1, "codes": [0, 0],
            "cfg": {"kill": "host"}, "events": sorted(events, key=lambda e: e["t"])}


def test_phases_add_up_from_events() -> None:
    out = timeline(_run(["a", "b"]), ["a", "b"])
    assert out["ok"], out["why"]
    got = {k: round(v, 3) for k, v in out["phases"].items()}
    assert got == {"detection": 0.5, "relaunch": 1.6, "rendezvous": 4.0, "build": 0.4,
                   "restore": 1.1, "first_step": 0.4}
    assert round(out["total_s"], 3) == 8.0 and round(out["restore_s"], 3) == 1.1
    assert out["detail"]["replacement_agent_ready"] == pytest.approx(2.0)


def test_wrong_state_or_a_fresh_start_fails_the_run() -> None:
    wrong = timeline(_run(["a", "x"]), ["a", "b"])
    assert not wrong["ok"] and "ranks [1]" in wrong["why"]
    fresh = timeline(_run(["a", "b"], restored=(4, 0)), ["a", "b"])
    assert not fresh["ok"] and "not every rank from a checkpoint" in fresh["why"]


def test_report_marks_targets() -> None:
    result = {"args": {"hosts": "2", "mb": "2", "kill": "host", "victim": "1", "kill_step": "4",
                       "kill_delay": "0.3", "every": "2", "reps": "1"}, "mode": "netns",
              "reference": ["a", "b"], "runs": [_run(["a", "b"])]}
    result["summary"] = summarize(result)
    text = markdown(result, "python -m benchmarks.recovery ...")
    assert "| partners | met | met | met |" in text  # 8.0 s <= 10 s; 1.1 / 8.0 <= 20 %


def test_quick_defaults_and_checks() -> None:
    args = parse_args(["--quick", "--steps", "6"])
    assert args.hosts == QUICK["hosts"] and args.sources == "partners" and args.steps == 6
    full = parse_args([])
    assert (full.hosts, full.mb, full.sources) == (4, 256, "partners,parity,disk,dcp,tcp")
    with pytest.raises(SystemExit):
        parse_args(["--victim", "0"])  # host 0 holds the rendezvous store
    assert parse_args(["--restart", "inprocess"]).sources == "partners,parity,disk"
    for wrong in (["--sources", "dcp"], ["--kill", "rank"]):
        with pytest.raises(SystemExit):
            parse_args(["--restart", "inprocess", *wrong])  # ckptio's sources, hosts killed


def test_the_sources_alternate_on_the_harness_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every source once per repetition, reversed on odd ones (was: --sources order always)."""
    calls: list[tuple[str, int]] = []

    def fake(args: Any, source: str, rep: int, mode: str) -> dict[str, Any]:
        calls.append((source, rep))
        return {"source": source, "rep": rep, "codes": [0] * args.hosts}

    monkeypatch.setattr(recovery, "one_run", fake)
    args = parse_args(["--hosts", "3", "--reps", "3", "--sources", "partners,disk,dcp"])
    runs = run_all(args, ["partners", "disk", "dcp"], "simulated")
    order = [("partners", 0), ("disk", 0), ("dcp", 0), ("dcp", 1), ("disk", 1), ("partners", 1),
             ("partners", 2), ("disk", 2), ("dcp", 2)]
    assert calls == order and [(r["source"], r["rep"]) for r in runs] == order


def test_the_report_takes_medians_and_tables_from_the_harness() -> None:
    """Three runs of one source: the medians row (harness.spread) in harness.markdown_table's
    table, a failed run counted in 'runs ok' but left out of the medians."""
    runs = []
    for rep, (shift, digests) in enumerate([(0.3, ["a", "b"]), (0.1, ["a", "b"]),
                                            (0.2, ["a", "b"]), (5.0, ["a", "x"])]):
        run = _run(digests)
        for e in run["events"]:  # the first step later by ``shift``: total 8 + shift
            e["t"] += shift if e["ev"] in ("step", "final") else 0
        runs.append({**run, "rep": rep})
    result = {"args": {"hosts": "2", "mb": "2", "kill": "host", "victim": "1", "kill_step": "4",
                       "kill_delay": "0.3", "every": "2", "reps": "4"}, "mode": "netns",
              "reference": ["a", "b"], "runs": runs}
    result["summary"] = summarize(result)
    by = result["summary"]["by_source"]["partners"]
    assert (by["n"], by["of"]) == (3, 4) and by["total_s"] == pytest.approx(8.2)
    assert by["phases"]["first_step"] == pytest.approx(0.6)
    lines = markdown(result, "python -m benchmarks.recovery ...").splitlines()
    header = "| source | runs ok | " + " | ".join(PHASES) + " | kill -> step | restore, " \
        "slowest rank | restore share |"
    at = lines.index(header)
    assert lines[at + 1] == "| " + " | ".join(["---"] * (len(PHASES) + 5)) + " |"
    assert lines[at + 2] == "| partners | 3/4 | 0.50 | 1.60 | 4.00 | 0.40 | 1.10 | 0.60 | " \
        "8.20 | 1.10 | 13 % |"
    assert "| partners | met | met | **missed** |" in lines  # one run not bitwise


def test_disk_checkpoints_leave_the_cache_alone(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    """harness.cold(paths, only=True): one POSIX_FADV_DONTNEED per file under ``paths`` and no
    drop_caches even where it would work (the job's code stays cached)."""
    import ckptio.tuning.ceiling

    for name in ("a/0.bin", "a/b/1.bin", "c.bin"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * 4096)
    advised: list[int] = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, how: advised.append(how))

    def dropped(paths: Any = ()) -> str:
        raise AssertionError("drop_caches: the whole page cache")

    monkeypatch.setattr(ckptio.tuning.ceiling, "drop_page_cache", dropped)
    assert harness.cold([tmp_path / "a"], only=True) == "fadvise"
    assert advised == [os.POSIX_FADV_DONTNEED] * 2  # a/0.bin, a/b/1.bin; not c.bin


def _documented() -> list[str]:
    """Every ``python -m benchmarks.recovery`` command of the docs' bash blocks and of the
    module's docstring (continuation lines joined, comments dropped), "..." ones left out."""
    docs = (ROOT / "docs" / "BENCH_RECOVERY.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", docs, re.S) + [recovery.__doc__ or ""]
    found = []
    for block in blocks:
        for cmd in block.replace("\\\n", " ").splitlines():
            cmd = cmd.split("#")[0].strip()
            if cmd.startswith("python -m benchmarks.recovery ") and "..." not in cmd:
                found.append(cmd)
    return found


def test_the_documented_commands_parse() -> None:
    commands = _documented()
    assert len(commands) >= 6, commands  # BENCH_RECOVERY's 5, the module's 2
    for cmd in commands:
        args = parse_args(shlex.split(cmd)[3:])
        assert args.hosts >= 2 and args.reps >= 1, cmd
    main = parse_args(shlex.split(commands[0])[3:])
    assert (main.hosts, main.mb, main.reps, str(main.dir)) == (4, 256, 3, "/tmp/bench-recovery")
