"""The shell commands of README.md and the pages under docs/ run as typed (collected and run
as tests/typed_commands.py says: verbatim, fresh processes, the user's environment, a
deadline), each followed by a check of what the page promises; the examples' docstring
commands are run by tests/test_examples.py.

A documented command that cannot run here is classified in NOT_RUN with why, and their number
is pinned, so a new one fails here until it is run (CASES) or classified.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from docs_blocks import marked_blocks
from test_examples import EXPECT as EXAMPLE_COMMANDS
from typed_commands import ROOT, Case, documented, run_case

# What cannot run here, each with why: (a pattern of the command, the reason).
NOT_RUN: list[tuple[str, str]] = [
    (r"^python3 -m venv ", "makes a virtual environment for the pip install after it"),
    (r"pip install ", "installs torch and the extras over the network (minutes)"),
    (r"^\.venv/bin/python -m pytest -q$", "the whole suite, about 25 minutes: CI runs it"),
    (r"^\.venv/bin/ckptio demo$", "trains for minutes (165 s on a busy 2-core machine): too "
                                  "slow beside the rest; tests/test_resume_real.py runs the "
                                  "demo with --quick"),
    (r"-m benchmarks\.", "a benchmark run as its page recorded it: minutes to hours of "
                         "measuring on a quiet machine, several with placeholders ([--pin], N, "
                         "...); it checks nothing"),
    (r"^python dev/", "a development probe run as its page recorded it (a measurement on a "
                      "quiet machine); it checks nothing"),
]
# README: venv, 2 pip installs, the demo, the whole suite; BENCH_S3_CLIENTS: venv, pip; 49
# benchmarks (the latest: BENCH_RECOVERY's three and docs/results/i66's three runs under load,
# its --quick smoke run is run by tests/test_bench_recovery.py; BENCH_RESTART's round three,
# BENCH_REDUNDANCY's peers and BENCH_LOOP's rollback restore, which issue 66/67 added;
# BENCH_RESTART's round four, three; BENCH_LOOP section 13's three, issue 65's call;
# BENCH_REDUNDANCY's fewer hosts and peers round two, three; this stop, nine more: BENCH_GPU
# run 11, BENCH_LOOP sections 14 and 15, BENCH_RESTART round five, BENCH_REDUNDANCY's two
# holders; BENCH_LOOP section 17 (issue 65): the loop and three dev/tier_trace.py probes;
# issue 66's one pass over the received step: BENCH_REDUNDANCY's two; BENCH_RESTART round six's four;
# BENCH_RECOVERY's in-process run and its --quick smoke run, which tests/test_bench_recovery.py runs;
# BENCH_RESTART round six's A/B and final runs, three; BENCH_LOOP section 18's
# dev/manifest_encode.py probe, one; BENCH_RECOVERY's survivor's restore: two
# dev/survivor_restore.py probes; BENCH_REDUNDANCY's parity chains, two; BENCH_RESTART round
# seven's A/B, three; the seventh session's quiet runs: BENCH_RESTART round seven's A/B, one;
# BENCH_RECOVERY's in-process round two, two; BENCH_REDUNDANCY's parity chains A/B, two;
# BENCH_LOOP section 20's dev/call_counts.py probe, one; BENCH_REDUNDANCY's step landing in the
# tier's pages, one (its A/B command is the chains'); BENCH_LOOP section 21's dev/call_counts.py
# probes, three (its first is section 20's); section 21's call timing (benchmarks.call_overhead
# with --reps 3 --json), one; BENCH_RESTART round eight's 2- and 4-rank reruns, two;
# BENCH_LOOP's call phases timed inside the call: dev/call_phases.py and dev/call_parts.py, two;
# BENCH_LOOP section 22's load probe, dev/load_calls.py, one; BENCH_REDUNDANCY's meetings'
# cost, one; BENCH_LOOP section 23's restore A/B and its dev/restore_thread_start.py probe, three;
# BENCH_LOOP section 24's dev/resumed_saves.py probe, three)
NOT_RUN_COUNT = 120


def _not_run(command: str) -> str | None:
    return next((why for pattern, why in NOT_RUN if re.search(pattern, command)), None)


def _training_state(here: Path, env: dict[str, str]) -> None:
    """What docs/guides/convert.md converts: a run's step 1000 and a torch.save file."""
    import ckptio

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    ckptio.save({"model": model, "optim": opt, "rng": ckptio.RNGState(), "step": 1000},
                here / "ckpts" / "step-1000")
    torch.save({"model": model.state_dict(), "step": 7}, here / "run.pt")


def _hf_folder_is_the_model(here: Path) -> None:
    from safetensors.torch import load_file

    keys = sorted(load_file(here / "out" / "hf" / "model.safetensors"))
    assert keys == ["model.0.bias", "model.0.weight", "model.2.bias", "model.2.weight"], keys


def _s3_run(here: Path, env: dict[str, str], done: int) -> None:
    """After the bucket is made: the guide's Python block that saves s3://ckpt/run-1, run in
    a fresh process."""
    if done != 0:
        return
    (code,) = [c for c, _ in marked_blocks(ROOT / "docs/guides/s3.md") if "s3://ckpt/run-1" in c]
    ran = subprocess.run([sys.executable, "-c", code], cwd=here, env=env, capture_output=True,
                         text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]


CASES: dict[str, Case] = {
    "readme_first_check": Case(((".venv/bin/python -m pytest -q tests/test_docs_blocks.py",
                                 r"\d+ passed"),), timeout=120),
    "convert": Case((
        ("ckptio convert ckpts/step-1000 out/step-1000.dcp --to dcp          # DCP's own "
         "FileSystemWriter files", "DCP checkpoint"),
        ("ckptio convert ckpts/step-1000 out/step-1000.pt  --to torch.save   # one torch.save "
         "file", "torch.save file"),
        ("ckptio convert ckpts/step-1000 out/hf --to safetensors --drop-non-tensors  # Hugging "
         "Face folder", r"optim \(\d+ keys\), rng \(\d+ keys\), step[\s\S]*ckptio export "
                        r"ckpts/step-1000 out/hf --keys model\."),
        ("ckptio convert run.pt ckpts/imported                                # (default --to "
         "ckptio)", "ckptio checkpoint")), needs=("safetensors",), setup=_training_state,
        check=_hf_folder_is_the_model),
    "s3_guide": Case((
        ("python -c \"import boto3; boto3.client('s3').create_bucket(Bucket='ckpt')\"   # once",
         ""),
        ("ckptio ls s3://ckpt/run-1            # the run's steps", r"committed"),
        ("ckptio verify s3://ckpt/run-1/step-2", r"step-2: OK")), needs=("boto3", "weed"),
        after=_s3_run, s3=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_documented_command_runs_as_typed(name: str, tmp_path: Path) -> None:
    run_case(CASES[name], tmp_path)


def test_every_documented_command_is_run_or_classified() -> None:
    found = documented()
    run = {c for case in CASES.values() for c, _ in case.commands} | set(EXAMPLE_COMMANDS)
    stale = sorted(run - set(found))
    assert not stale, f"run here but no longer documented (update CASES): {stale}"
    not_run = {c: where for c, where in found.items() if c not in run}
    unclassified = [f"{where}: {c}" for c, where in not_run.items() if _not_run(c) is None]
    assert not unclassified, ("documented commands neither run here (CASES) nor classified "
                              "(NOT_RUN, with why):\n" + "\n".join(unclassified))
    assert len(not_run) == NOT_RUN_COUNT, (
        f"{len(not_run)} documented commands are not run (NOT_RUN_COUNT {NOT_RUN_COUNT}): "
        "a new one must be run in CASES or classified; update the count and say why")


# A documented probe run as typed (`python dev/NAME.py` from the checkout) has only dev/ on its
# path, not the checkout: run each one's module level that way and import what it names.
_PROBE_IMPORTS = r"""
import importlib, re, runpy, sys
from pathlib import Path
base = [p for p in sys.path[1:] if p not in ("", ".")]
for script in sys.argv[1:]:
    sys.path[:] = [str(Path(script).resolve().parent), *base]
    for name in [m for m in sys.modules if m == "benchmarks" or m.startswith("benchmarks.")]:
        del sys.modules[name]
    runpy.run_path(script, run_name="documented_probe")
    for name in re.findall(r"^\s*(?:from|import) (benchmarks[.\w]*)", Path(script).read_text(), re.M):
        importlib.import_module(name)
    print("ok", script)
"""


def test_the_documented_probes_find_what_they_import_when_run_as_typed() -> None:
    typed = sorted({m.group(1) for c in documented()
                    for m in [re.match(r"^python (dev/\w+\.py)", c)] if m})
    assert len(typed) >= 5, typed
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ran = subprocess.run([sys.executable, "-c", _PROBE_IMPORTS, *typed], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.count("ok ") == len(typed), ran.stdout
    modules = sorted({m.group(1) for c in documented()
                      for m in [re.search(r"-m (benchmarks\.\w+)", c)] if m})
    missing = [m for m in modules if not (ROOT / (m.replace(".", "/") + ".py")).exists()]
    assert not missing, f"documented benchmark modules that do not exist: {missing}"


def test_the_first_check_needs_the_test_extra() -> None:
    """The README's "first check in seconds" runs pytest, which only the second command's
    test extra installs (the first installs the base): the README says so with the promise."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("pytest") for d in project["dependencies"])
    assert any(d.startswith("pytest") for d in project["optional-dependencies"]["test"])
    readme = " ".join((ROOT / "README.md").read_text().split())
    (promise,) = [s for s in readme.split(". ") if "pytest -q tests/test_docs_blocks.py" in s]
    assert "first check" in promise and "test extra" in promise, promise
