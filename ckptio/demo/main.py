"""``ckptio demo``: train, SIGKILL mid-save, resume in a new process, compare every loss bitwise.

    ckptio demo                    # about a minute on 2 cores
    ckptio demo --quick            # a few seconds (or CKPTIO_DEMO_QUICK=1)
    ckptio demo --mode lazy --dir ./demo-run

Three training processes: (1) an uninterrupted reference run recording every loss; (2) at the
same time, the same run checkpointing in the background through ckptio.CheckpointManager, which
SIGKILLs itself while the save of a checkpoint is still being written; (3) then a new process
that builds everything afresh, restores the latest complete checkpoint and trains to the end.
Then a table compares each resumed step's loss with the reference's, bit for bit; the exit
status is 0 only if every one is equal. With matplotlib installed, a plot of both curves.

Owns: the plan (steps, interval, kill point), what is printed, the verdict and the plot.
Does not own: training (train.py) or running processes (launch.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any

from ckptio.demo.launch import DemoError, Training, bits, run_training, same_bits, start_training

__all__ = ["main"]

QUICK_ENV = "CKPTIO_DEMO_QUICK"


@dataclass(frozen=True)
class Plan:
    preset: str
    steps: int
    save_every: int
    kill_at: int
    mode: str = "eager"


PLANS = {"default": Plan("default", steps=160, save_every=20, kill_at=100),
         "quick": Plan("quick", steps=40, save_every=8, kill_at=24)}
MODES = {"eager": "asynchronous (eager: copied out, then written in the background)",
         "lazy": "asynchronous (lazy: copied while the next step runs, then written)",
         "sync": "synchronous (training waits for each save)"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ckptio demo", description="Train a small GPT, SIGKILL it "
                                "in the middle of an asynchronous checkpoint save, resume it in "
                                "a new process, and compare every loss with an uninterrupted "
                                "run's, bit for bit. Exit status 0 only if all are equal.")
    p.add_argument("--quick", action="store_true",
                   help=f"a tiny model and 40 steps: a few seconds (also {QUICK_ENV}=1)")
    p.add_argument("--dir", help="work directory (default: a new temporary one); its "
                   "checkpoints are kept")
    p.add_argument("--mode", choices=sorted(MODES), default="eager", help="how checkpoints "
                   "are saved (default eager)")
    p.add_argument("--steps", type=int, help="steps of each run (default 160, quick 40)")
    p.add_argument("--save-every", type=int, help="checkpoint interval (default 20, quick 8)")
    p.add_argument("--kill-at", type=int, help="the checkpoint step whose save is killed "
                   "(default 100, quick 24)")
    return p.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    quick = args.quick or os.environ.get(QUICK_ENV, "") not in ("", "0")
    plan = PLANS["quick" if quick else "default"]
    plan = replace(plan, mode=args.mode, steps=args.steps or plan.steps,
                   save_every=args.save_every or plan.save_every,
                   kill_at=args.kill_at or plan.kill_at)
    if plan.kill_at % plan.save_every or not plan.save_every < plan.kill_at < plan.steps:
        raise DemoError(f"--kill-at {plan.kill_at} must be a multiple of --save-every "
                        f"{plan.save_every}, after the first checkpoint and before --steps "
                        f"{plan.steps}")
    return plan


def train_args(plan: Plan, out: str, *extra: str) -> list[str]:
    return ["--out", out, "--preset", plan.preset, "--steps", str(plan.steps),
            "--save-every", str(plan.save_every), "--mode", plan.mode, *extra]


def say(text: str = "") -> None:
    print(text, flush=True)


def start_reference(plan: Plan, work: str) -> Training:
    say(f"\n[1/3] Reference: {plan.steps} training steps in one go, no checkpoints, every "
        "loss recorded. It runs in its own process, in the background, alongside step 2.")
    return start_training(train_args(plan, os.path.join(work, "reference.json"), "--no-save"),
                          capture=True)


def reference_done(plan: Plan, running: Training) -> dict[str, Any]:
    ref = running.finish()[0]
    losses = ref["losses"]
    say(f"\n[1/3] The reference run is done: {plan.steps} steps in {ref['seconds']:.1f} s "
        f"({ref['params']:,} parameters; text: {ref['text']}), loss {losses[1]:.4f} at step 1, "
        f"{losses[plan.steps]:.4f} at step {plan.steps}.")
    return ref


def killed_run(plan: Plan, work: str, ckpts: str) -> dict[str, Any]:
    when = "has returned (committed)" if plan.mode == "sync" else "has started"
    say(f"\n[2/3] The same run in a new process, saving a checkpoint every {plan.save_every} "
        f"steps through ckptio.CheckpointManager, {MODES[plan.mode]}. At step {plan.kill_at}, "
        f"right after the save of step-{plan.kill_at} {when}, the process kills itself "
        "with SIGKILL (no cleanup, no exit handlers: like a power cut or the OOM killer)."
        + ("" if plan.mode == "sync" else " That save's commit is held back, so the kill lands "
           "mid-save however fast this machine writes."))
    run = run_training(train_args(plan, os.path.join(work, "killed.json"), "--dir", ckpts,
                                  "--kill-at", str(plan.kill_at)), killed=True)[0]
    note = run["kill"]
    if note["done"]:
        state = "committed"
    elif note["written"] < note["total"]:
        state = f"still in flight, not committed: {_pct(note)} of its bytes written"
    else:
        state = ("still in flight, not committed: its bytes written, but not its manifest "
                 "(written last: the commit)")
    say(f"      killed by SIGKILL at step {note['step']}: the save of step-{note['step']} "
        f"({note['total'] / 1e6:.1f} MB) was {state}.")
    return run


def resumed_run(plan: Plan, work: str, ckpts: str) -> dict[str, Any]:
    say("\n[3/3] Resume in a new process: a freshly built model, optimizer, LR schedule and "
        "data loader; CheckpointManager.restore() loads the latest complete checkpoint into "
        f"them (weights, AdamW moments, schedule, loader position, every RNG), then training "
        f"goes on to step {plan.steps}.")
    run = run_training(train_args(plan, os.path.join(work, "resumed.json"), "--dir", ckpts,
                                  "--resume"))[0]
    say(f"      restored step-{run['start']} (complete checkpoints on disk: {run['found']}), "
        f"trained steps {run['start'] + 1}-{plan.steps} in {run['seconds']:.1f} s.")
    return run


def _pct(note: dict[str, Any]) -> str:
    return f"{100 * note['written'] / max(1, note['total']):.0f}%"


def check_kill(plan: Plan, killed: dict[str, Any], resumed: dict[str, Any]) -> None:
    """The kill really came mid-save (async), or right after a completed save (sync)."""
    note, found = killed["kill"], resumed["found"]
    if plan.mode == "sync":
        if plan.kill_at not in found:
            raise DemoError(f"the synchronous save of step-{plan.kill_at} returned but is not "
                            f"on disk (found {found})")
        say(f"      (sync: the kill came after step-{plan.kill_at} was durable; it was restored.)")
        return
    if note["done"] or plan.kill_at in found:
        raise DemoError(f"the save of step-{plan.kill_at} had already finished when the kill "
                        "landed, so this run did not test a kill in the middle of a save")
    left = "left incomplete on disk" if plan.kill_at in resumed["incomplete"] else "not on disk"
    say(f"      So the kill really interrupted a save: step-{plan.kill_at} was never committed "
        f"({left}) and is passed over; the manager restored step-{resumed['start']}, the "
        "latest complete one.")


def compare(plan: Plan, ref: dict[str, Any], killed: dict[str, Any],
            resumed: dict[str, Any]) -> tuple[list[tuple[int, float, float, bool]], bool]:
    """(table rows of the resumed steps, whether the killed run matched before its kill)."""
    want = ref["losses"]
    before = all(same_bits(loss, want[s]) for s, loss in killed["losses"].items())
    rows = [(s, want[s], resumed["losses"][s], same_bits(want[s], resumed["losses"][s]))
            for s in range(resumed["start"] + 1, plan.steps + 1)]
    return rows, before and len(killed["losses"]) == plan.kill_at


def print_table(rows: list[tuple[int, float, float, bool]], head: int = 8) -> None:
    say(f"\n{'step':>6}  {'reference loss':>16}  {'resumed loss':>16}  {'bits (float32)':>19}"
        "  bitwise equal")
    shown = [r for i, r in enumerate(rows) if i < head or i >= len(rows) - head or not r[3]]
    for i, (step, ref, got, equal) in enumerate(shown):
        if i and step != shown[i - 1][0] + 1:
            say(f"{'...':>6}  ({step - shown[i - 1][0] - 1} more rows, all equal)")
        pattern = bits(ref) if equal else f"{bits(ref)}/{bits(got)}"
        say(f"{step:>6}  {ref:>16.10f}  {got:>16.10f}  {pattern:>19}  "
            f"{'yes' if equal else 'NO'}")


def plot(path: str, plan: Plan, ref: dict[str, Any], killed: dict[str, Any],
         resumed: dict[str, Any], equal: str) -> str | None:
    """Both curves and the kill; -> where, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for run, label, color, width, alpha in (
            (ref, "uninterrupted reference", "C0", 3, 0.5),
            (killed, "run killed by SIGKILL", "C3", 1, 1.0),
            (resumed, "resumed in a new process", "C1", 1, 1.0)):
        steps = sorted(run["losses"])
        ax.plot(steps, [run["losses"][s] for s in steps], label=label, color=color, lw=width,
                alpha=alpha)
    when = "after" if plan.mode == "sync" else "during"
    ax.axvline(plan.kill_at, color="C3", ls=":", label=f"SIGKILL {when} the save of "
               f"step-{plan.kill_at}")
    ax.axvline(resumed["start"], color="grey", ls="--", label=f"restored step-{resumed['start']}")
    ax.set(xlabel="step", ylabel="training loss (nats per byte)", title="ckptio demo "
           f"({plan.mode} saves): {equal} resumed losses bitwise equal to the uninterrupted run's")
    ax.title.set_fontsize(9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def verdict(plan: Plan, rows: list[tuple[int, float, float, bool]], before: bool) -> bool:
    bad = [r[0] for r in rows if not r[3]]
    if not before:
        say("\nVERDICT: FAIL - the killed run's losses before the kill differ from the "
            "reference's: training is not deterministic here, so nothing can be compared.")
        return False
    if bad:
        say(f"\nVERDICT: FAIL - {len(bad)} of {len(rows)} resumed steps differ from the "
            f"uninterrupted run (first: step {bad[0]}).")
        return False
    when = "right after a save" if plan.mode == "sync" else "in the middle of a save"
    say(f"\nVERDICT: OK - all {len(rows)} resumed steps ({rows[0][0]}-{rows[-1][0]}) have "
        f"bitwise the same loss as the uninterrupted run: killed {when}, the job lost only the "
        "steps since its last complete checkpoint and then continued exactly as if nothing had "
        "happened.")
    return True


def run(plan: Plan, work: str) -> bool:
    ckpts = os.path.join(work, "checkpoints")
    running = start_reference(plan, work)
    try:
        killed = killed_run(plan, work, ckpts)
        ref = reference_done(plan, running)
    finally:
        running.stop()
    resumed = resumed_run(plan, work, ckpts)
    check_kill(plan, killed, resumed)
    rows, before = compare(plan, ref, killed, resumed)
    print_table(rows)
    say(f"\nThe killed run's {len(killed['losses'])} steps before the kill "
        f"{'also matched' if before else 'did NOT match'} the reference bit for bit.")
    equal = f"{sum(r[3] for r in rows)} of {len(rows)}"
    where = plot(os.path.join(work, "losses.png"), plan, ref, killed, resumed, equal)
    say(f"Plot: {where}" if where else "No plot: matplotlib is not installed "
        "(pip install matplotlib).")
    return verdict(plan, rows, before)


def intro(plan: Plan, work: str) -> None:
    from ckptio.demo.model import PRESETS

    cfg = PRESETS[plan.preset]
    when = "right after a (synchronous)" if plan.mode == "sync" else "in the middle of a"
    say("ckptio demo: train a small GPT on Python's own documentation, kill the training "
        f"process {when} checkpoint save, resume it in a new process, and check that every "
        "loss after the resume is bit for bit the loss of an uninterrupted run.")
    say(f"Model: {cfg.n_layer} transformer blocks, d_model {cfg.d_model}, {cfg.n_head} heads, "
        f"dropout {cfg.dropout}, bytes as tokens; AdamW with warmup + cosine LR; "
        f"batch {cfg.batch_size} x {cfg.block_size} bytes. Work directory: {work}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    try:
        plan = make_plan(args)
        if args.dir and os.path.exists(os.path.join(args.dir, "checkpoints")):
            raise DemoError(f"{args.dir} already holds checkpoints of an earlier demo: choose "
                            "another --dir or remove it")
        work = args.dir or tempfile.mkdtemp(prefix="ckptio-demo-")
        os.makedirs(work, exist_ok=True)
        intro(plan, work)
        ok = run(plan, work)
    except DemoError as exc:
        print(f"\nckptio demo FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    if args.dir is None:  # temporary: the losses and plot stay, the checkpoints go
        shutil.rmtree(os.path.join(work, "checkpoints"), ignore_errors=True)
    say(f"({time.perf_counter() - started:.0f} s in all; losses as JSON in {work})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
