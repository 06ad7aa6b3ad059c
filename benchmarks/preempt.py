"""Preemption benchmark: SIGTERM to a training process, timed until its step is durable on disk
(docs/BENCH_LOOP.md, "Preemption").

Each run is a fresh training process (the train benchmark's GPT and AdamW of --gb GB, real
optimizer steps) in the loop docs/MANAGER.md shows: ``mgr.save(step, state,
asynchronous=True)``, ``if mgr.reached_preemption(step): break``, ``mgr.close()``. The driver
sends SIGTERM at a random moment of a random step in [K+1, 2K-1] (not due on disk); the
child reports its clocks (CLOCK_MONOTONIC, the same in both processes) over its stdout: when
each step began, when the final save was called, when it committed in the first tier
(``handle.wait()``) and when close() returned (the step durable on disk). The driver times the
exit, then checks with ckptio that the step is committed (and verifies) on disk and in memory.
Configurations: ``tiers`` (shm:// every step + a disk Tier every K), ``tiers_paced`` (the same
with ``drain_rate``: the preempted step's drain is unpaced), ``disk`` (one disk directory,
every K: the comparison). The configurations alternate on benchmarks/harness.py's schedule (the
order reversed on odd repetitions).

    python -m benchmarks.preempt --gb 1 --reps 3 \
        --json docs/results/i45/preempt.json --markdown docs/results/i45/preempt.md
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness, worker_env, write_reports

__all__ = ["CONFIGS", "main"]

CONFIGS = ("tiers", "tiers_paced", "disk")
NOTES = {
    "tiers": "`Tier(\"shm://run\", keep_last=2)` every step + `Tier(disk, every=K, "
             "keep_last=2)`, `preemption=True`",
    "tiers_paced": "the same with `drain_rate` (lifted for the preempted step)",
    "disk": "`CheckpointManager(disk, keep_last=2, save_every=K, preemption=True)`",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.preempt",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="state size in GB (AdamW included)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--every", type=int, default=4, help="K: the disk's interval")
    p.add_argument("--rate", type=float, default=100e6, help="tiers_paced's drain_rate, B/s")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--dir", type=Path, default=Path("bench-preempt"))
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------- the training child


def _emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def _manager(args: argparse.Namespace, disk: Path) -> Any:
    import ckptio

    if args.worker == "disk":
        return ckptio.CheckpointManager(disk, keep_last=2, save_every=args.every,
                                        preemption=True)
    rate = args.rate if args.worker == "tiers_paced" else None
    return ckptio.CheckpointManager(
        tiers=[ckptio.Tier("shm://run", keep_last=2),
               ckptio.Tier(str(disk), every=args.every, keep_last=2)],
        preemption=True, drain_rate=rate)


def worker_main(args: argparse.Namespace) -> int:
    from benchmarks.train import build_training, checkpoint_state, train_step
    from ckptio.tuning import state as gpt_state

    model, opt, cfg = build_training(args.gb, args.seed)
    mgr = _manager(args, args.dir / "disk")
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(cfg.vocab, (8, args.batch, args.seq + 1), generator=gen)
    _emit(event="ready")
    step, handle, called = 0, None, 0.0
    while True:
        step += 1
        _emit(event="begin", step=step, t=time.monotonic())
        train_step(model, opt, tokens[step % len(tokens)])
        called = time.monotonic()
        handle = mgr.save(step, checkpoint_state(model, opt, step, args.batch),
                          asynchronous=True)
        if mgr.reached_preemption(step):
            break
    if handle is not None:
        handle.wait()  # committed in the first tier (memory; the disk for "disk")
    committed = time.monotonic()
    mgr.close()  # the final step drained to every slower tier
    closed = time.monotonic()
    copied = [c for t in mgr.status()[1:] for c in t.get("copied", []) if c["step"] == step]
    nbytes = gpt_state.tensor_nbytes(checkpoint_state(model, opt, step, args.batch))
    _emit(event="end", final=step, save_called=called, committed=committed, closed=closed,
          drain_s=copied[-1]["durable_s"] if copied else None, bytes=nbytes)
    return 0


# ---------------------------------------------------------------- the driver


def one_run(args: argparse.Namespace, config: str, rep: int, env: dict[str, str],
            rng: random.Random) -> dict[str, Any]:
    """Train ``config`` in a fresh child, SIGTERM it at a random moment of a step between the
    disk's first and second interval (a step not due on disk by its number) -> the run's
    clocks, relative to the signal, and what was durable."""
    shutil.rmtree(args.dir, ignore_errors=True)
    shutil.rmtree(Path(env["CKPTIO_SHM_DIR"]), ignore_errors=True)
    target = rng.randint(args.every + 1, max(args.every + 1, 2 * args.every - 1))
    cmd = harness.command("benchmarks.preempt", config, "--gb", args.gb, "--every", args.every,
                          "--rate", args.rate, "--batch", args.batch, "--seq", args.seq,
                          "--dir", args.dir, "--seed", args.seed + rep)
    with tempfile.TemporaryFile("w+") as log:  # the drain's warnings must never fill a pipe
        child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        events, killed = _follow(child, target, rng)
        code = child.wait()
        exited = time.monotonic()
        log.seek(0)
        err = log.read()
    end = next((e for e in events if e["event"] == "end"), None)
    if killed is None or end is None:
        return {"config": config, "rep": rep, "exit_code": code, "error": err[-2000:]}
    begins = {e["step"]: e["t"] for e in events if e["event"] == "begin"}
    landed = max(s for s, t in begins.items() if t <= killed)
    durable_at = end["committed"] if config == "disk" else end["closed"]
    times = sorted(begins.values())
    return {"config": config, "rep": rep, "exit_code": code, "bytes": end["bytes"],
            "signal_in_step": landed, "final_step": end["final"],
            "step_s": statistics.median(b - a for a, b in zip(times, times[1:])),
            "to_save_call_s": end["save_called"] - killed,
            "to_memory_s": None if config == "disk" else end["committed"] - killed,
            "to_durable_s": durable_at - killed, "to_close_s": end["closed"] - killed,
            "save_to_durable_s": durable_at - end["save_called"],
            "drain_s": end["drain_s"], "to_exit_s": exited - killed,
            **durability(args, end["final"], config != "disk")}


def _follow(child: subprocess.Popen[str], target: int,
            rng: random.Random) -> tuple[list[dict[str, Any]], float | None]:
    """Read the child's events; once step ``target`` begins, SIGTERM it at a random moment of
    that step (uniform over the previous step's length) -> the events, when it was sent."""
    assert child.stdout is not None
    events: list[dict[str, Any]] = []
    killed = None
    for line in child.stdout:
        if not line.startswith("{"):
            continue
        events.append(json.loads(line))
        begins = [e["t"] for e in events if e["event"] == "begin"]
        if killed is None and len(begins) >= 2 and events[-1].get("step") == target:
            time.sleep(rng.uniform(0.0, begins[-1] - begins[-2]))
            killed = time.monotonic()
            child.send_signal(signal.SIGTERM)
    return events, killed


def durability(args: argparse.Namespace, step: int, memory: bool) -> dict[str, Any]:
    """What ckptio finds after the child exited: the step committed on disk (and verified), and
    in the memory tier."""
    import ckptio

    out: dict[str, Any] = {}
    with ckptio.CheckpointManager(args.dir / "disk", keep_last=2) as disk:
        out["on_disk"] = step in disk.steps()
        out["verified_bytes"] = disk.verify(step) if out["on_disk"] else 0
    if memory:
        with ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://run", keep_last=2)]) as shm:
            out["in_memory"] = step in shm.steps()
    return out


def _median(values: list[Any]) -> float | None:
    got = harness.spread(values)
    return None if got is None else got["median"]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for config in dict.fromkeys(r["config"] for r in runs):
        mine = [r for r in runs if r["config"] == config and "error" not in r]
        keys = ("step_s", "to_save_call_s", "to_memory_s", "drain_s", "to_durable_s",
                "save_to_durable_s", "to_exit_s")
        out[config] = {k: _median([r.get(k) for r in mine]) for k in keys} | {
            "runs": len(mine), "failed": len([r for r in runs if r["config"] == config]) -
            len(mine), "exit_codes": sorted({r["exit_code"] for r in runs
                                              if r["config"] == config}),
            "durable": f"{sum(bool(r.get('on_disk')) for r in mine)}/{len(mine)}",
            "in_memory": None if config == "disk" else
            f"{sum(bool(r.get('in_memory')) for r in mine)}/{len(mine)}"}
    return out


def _f(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) \
        else str(value)


def markdown(doc: dict[str, Any], args: argparse.Namespace) -> str:
    gb = doc["bytes"] / 1e9 if doc["bytes"] else args.gb
    lines = [f"`{doc['command']}`", "",
             f"State S = {gb:.3f} GB (GPT + AdamW), batch {args.batch} x seq {args.seq}, disk "
             f"K = {args.every}; SIGTERM at a random moment of a random step in "
             f"[K+1, 2K-1]; {args.reps} fresh processes per configuration, medians, seconds from "
             f"the signal. Disk write ceiling in this run (S bytes, O_DIRECT, to fsync): "
             f"{_f(doc['write_gbps'])} GB/s.", "",
             "| config | runs | step s | to save() s | to memory commit s | drain s | "
             "to durable on disk s | save() to durable s | to exit s | exit codes | durable on "
             "disk | in memory | what |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|"]
    for config, s in doc["summary"].items():
        lines.append(
            f"| {config} | {s['runs']} | {_f(s['step_s'])} | {_f(s['to_save_call_s'])} | "
            f"{_f(s['to_memory_s'])} | {_f(s['drain_s'])} | {_f(s['to_durable_s'])} | "
            f"{_f(s['save_to_durable_s'])} | {_f(s['to_exit_s'])} | {s['exit_codes']} | "
            f"{s['durable']} | {_f(s['in_memory'])} | {NOTES[config]} |")
    lines += ["", "| config | rep | signal in step | step saved | to memory s | to durable s "
              "| to exit s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in doc["runs"]:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['rep']} | failed: {r['error'][-120:]!r} ||||")
            continue
        lines.append(f"| {r['config']} | {r['rep']} | {r['signal_in_step']} | "
                     f"{r['final_step']} | {_f(r['to_memory_s'])} | {_f(r['to_durable_s'])} | "
                     f"{_f(r['to_exit_s'])} |")
    lines += ["", "to save(): the rest of the step the signal landed in (the loop saves at its "
              "end; < 0: it landed in that save() call, before reached_preemption); to memory "
              "commit: that step committed in shm://; drain: the drain's copy of it, from its "
              "commit in memory to durable on disk; to durable on disk: close() returned "
              "(tiers) or the save committed (disk); save() to durable: from the final save's "
              "call to durable on disk (what the checkpoint adds to the rest of the step); to "
              "exit: the child's exit seen by the driver.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    from ckptio.tuning.ceiling import write_ceiling
    from ckptio.tuning.state import gpt_config, state_nbytes

    shm = Path("/dev/shm") / f"ckptio-bench-preempt-{os.getpid()}"
    os.environ["CKPTIO_SHM_DIR"] = str(shm)  # the driver's own checks read the memory tier
    env = {**worker_env(), "CKPTIO_SHM_DIR": str(shm)}
    rng = random.Random(args.seed)
    runs: list[dict[str, Any]] = []
    try:
        args.dir.mkdir(parents=True, exist_ok=True)
        write = write_ceiling(args.dir / "ceiling.bin", state_nbytes(gpt_config(args.gb)))
        configs = [c for c in args.configs.split(",") if c]
        runs = harness.repeat(configs, args.reps,
                              lambda config, rep: one_run(args, config, rep, env, rng),
                              progress=lambda run, _i, _n: json.dumps(run)[:400])
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(args.dir, ignore_errors=True)
    doc = {"command": "python -m benchmarks.preempt " + " ".join(argv or sys.argv[1:]),
           "bytes": next((r["bytes"] for r in runs if "bytes" in r), None),
           "write_gbps": float(write["bytes"]) / float(write["seconds"]) / 1e9,
           "runs": runs, "summary": summarize(runs)}
    write_reports(doc, args.json, args.markdown, markdown(doc, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
