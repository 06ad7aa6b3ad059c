"""benchmarks/deepspeed_engines.py on benchmarks/harness.py: its run order (the timed engines
alternating as harness.schedule orders them, the others once in the first repetition), its
table (medians through harness.spread, an engine that failed named with its error) and its
documented command line. No DeepSpeed job is run here (each takes tens of seconds)."""

from __future__ import annotations

from benchmarks import deepspeed_engines
from benchmarks.deepspeed_engines import ENGINES, TIMED, parse_args, plan, table


def test_the_timed_engines_alternate_and_the_others_run_once() -> None:
    order = plan(3)
    assert order[:len(ENGINES)] == [(0, e) for e in ENGINES]
    assert order[len(ENGINES):] == [(1, e) for e in TIMED[::-1]] + [(2, e) for e in TIMED]


def test_the_table_holds_medians_and_errors() -> None:
    runs = [{"stall_s": s, "durable_s": 2 * s, "load_s": 1.0, "peak_rss_mb": 100.0 + s}
            for s in (0.1, 0.3, 0.2)]
    text = table({"ckptio": runs, "fast": [{"error": "RuntimeError: no device"}], "torch": []})
    lines = text.splitlines()
    assert lines[0] == "| engine | save stall s | durable s | load s | peak RSS +MB |"
    assert "| ckptio | 0.20 | 0.40 | 1.00 | 100 |" in lines
    assert any(line.startswith("| fast | fails: RuntimeError: no device |") for line in lines)
    assert any(line.startswith("| torch | fails: not run |") for line in lines)


def test_the_documented_command_parses() -> None:
    """``--mb 400 --reps 3 --stage 2`` (the module docstring's command) is still accepted."""
    command = "python -m benchmarks.deepspeed_engines --mb 400 --reps 3 --stage 2"
    assert command in (deepspeed_engines.__doc__ or "")
    args = parse_args(command.split()[3:])
    assert (args.mb, args.reps, args.stage, args.worker) == (400, 3, 2, False)
