"""Probe: Python calls per steady save (plan reused), per thread, at two state sizes, so that
the per-tensor slope shows; counts, not times (ckptio/testing/callcount.py: the profile hook's
call and c_call events, Python frames entered and built-in functions called).

A CheckpointManager with one ``shm://`` tier (under a temporary $CKPTIO_SHM_DIR; --where disk:
one disk tier; --where plain: a plain Checkpointer's async_save into a directory per step, the
staging pool's capture), a save every step (``asynchronous=True``, eager, or ``lazy=True`` with
``optimizers=[opt]``), ``opt.step()`` after each, as a loop does; the state of
benchmarks/call_overhead.py (Linear(16, 16) layers and SGD with momentum, or AdamW with
--adamw). Per save: "call" is the training thread inside
save() (the previous save's settling and retention included, as in a loop), "hooks" the
training thread's ckptio calls outside it (a lazy save's optimizer hook), "bg" every other
thread (the save, hash and cleanup threads), over --saves steady saves. --per-save N lists the
functions with the most calls per steady save at the largest size, in the call and in the
background, ckptio's and the others'.

    python dev/call_counts.py [--tensors 200,1000] [--saves 10] [--adamw] [--top 25]
        [--per-save 30] [--where shm|disk|plain]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path
from collections.abc import Callable
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

Functions = Counter[tuple[str, str, str]]


def state_of(tensors: int, adamw: bool) -> tuple[dict[str, Any], Any]:
    import torch

    model = torch.nn.ModuleList(torch.nn.Linear(16, 16, bias=False) for _ in range(tensors // 2))
    opt: torch.optim.Optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-3) if adamw else
                                  torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    opt.step()
    return {"model": model, "optim": opt, "step": 3}, opt


def saver(where: str, tensors: int, lazy: bool, root: str) -> tuple[Any, Callable[..., Any]]:
    """What saves, and its save(step, state, **extra): a manager over one ``shm://`` tier
    ("shm"), a manager over one disk tier ("disk"), a plain Checkpointer's async_save into a
    directory per step ("plain")."""
    import ckptio

    name = f"counts-{tensors}-{int(lazy)}"
    if where == "plain":
        ck = ckptio.Checkpointer()
        return ck, lambda step, state, **extra: ck.async_save(
            state, os.path.join(root, name, f"step-{step}"), **extra)
    location = f"shm://{name}" if where == "shm" else os.path.join(root, name)
    mgr = ckptio.CheckpointManager(tiers=[ckptio.Tier(location, keep_last=2)])
    return mgr, lambda step, state, **extra: mgr.save(step, state, asynchronous=True, **extra)


def measure(tensors: int, lazy: bool, saves: int, adamw: bool, by_function: bool,
            where: str = "shm", root: str = "") -> tuple[dict[str, float], Functions]:
    """Calls per steady save: {"call", "call_ckptio", "hooks", "bg", "bg_ckptio"}, and the
    per-function counts over the measured saves (``by_function``): ("call" or the thread's
    name, "ckptio" or "other", function) -> calls."""
    from ckptio.testing.callcount import CallCounts, since

    state, opt = state_of(tensors, adamw)
    calls = CallCounts(by_function=by_function)
    calls.install()
    owner, save = saver(where, tensors, lazy, root)
    extra: dict[str, Any] = {"lazy": True, "optimizers": [opt]} if lazy else {}
    out = Counter[str]()
    functions: Functions = Counter()
    handle = None
    try:
        for step in range(1, 6):  # the first saves plan; the later ones reuse the plan
            handle = save(step, state, **extra)
            opt.step()
        handle.wait()
        start = calls.snapshot()
        bg_start = calls.functions()
        for step in range(6, 6 + saves):
            before, named = calls.snapshot(), calls.functions() if by_function else None
            handle = save(step, state, **extra)
            inside = calls.snapshot()
            if named is not None:  # the training thread's, inside the call only
                functions.update({("call", where_, name): n for (thread, where_, name), n in
                                  (calls.functions() - named).items() if thread == "MainThread"})
            opt.step()
            after = calls.snapshot()
            for (thread, where_), n in since(before, inside).items():
                if thread == "MainThread":
                    out["call"] += n
                    out["call_ckptio"] += n if where_ == "ckptio" else 0
            out["hooks"] += since(inside, after).get(("MainThread", "ckptio"), 0)
        handle.wait()
        for (thread, where_), n in since(start, calls.snapshot()).items():
            if thread != "MainThread":
                out["bg"] += n
                out["bg_ckptio"] += n if where_ == "ckptio" else 0
        if by_function:
            functions.update({(thread, where_, name): n for (thread, where_, name), n in
                              (calls.functions() - bg_start).items() if thread != "MainThread"})
    finally:
        calls.uninstall()
        owner.close()
    return {k: v / saves for k, v in out.items()}, functions


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tensors", default="200,1000")
    p.add_argument("--saves", type=int, default=10)
    p.add_argument("--modes", default="eager,lazy")
    p.add_argument("--adamw", action="store_true")
    p.add_argument("--where", choices=("shm", "disk", "plain"), default="shm",
                   help="a manager's shm:// tier, a manager's disk tier, or a plain "
                        "Checkpointer's async_save into a directory on disk")
    p.add_argument("--top", type=int, default=0, help="the functions with the steepest slope")
    p.add_argument("--per-save", type=int, default=0, metavar="N",
                   help="the N functions with the most calls per steady save at the largest "
                        "size: in the call and in the background, ckptio's and the others'")
    args = p.parse_args()
    sizes = [int(n) for n in args.tensors.split(",")]
    root = tempfile.mkdtemp(prefix="ckptio-counts-", dir="/dev/shm" if os.path.isdir(
        "/dev/shm") else None)
    disk = tempfile.mkdtemp(prefix="ckptio-counts-")
    os.environ["CKPTIO_SHM_DIR"] = root
    by_function = args.top > 0 or args.per_save > 0
    try:
        for mode in args.modes.split(","):
            rows = {n: measure(n, mode == "lazy", args.saves, args.adamw, by_function,
                               args.where, disk) for n in sizes}
            for n in sizes:
                print(f"{mode} {n} tensors: " + ", ".join(
                    f"{k} {v:.0f}" for k, v in sorted(rows[n][0].items())), flush=True)
            lo, hi = sizes[0], sizes[-1]
            if hi > lo:
                slope = {k: (rows[hi][0].get(k, 0) - rows[lo][0].get(k, 0)) / (hi - lo)
                         for k in rows[hi][0]}
                print(f"{mode} per tensor: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in sorted(slope.items())), flush=True)
                if args.top:
                    steep = Counter({key: (rows[hi][1][key] - rows[lo][1].get(key, 0))
                                     / args.saves / (hi - lo) for key in rows[hi][1]})
                    for (thread, where, name), v in steep.most_common(args.top):
                        print(f"  {v:6.2f}  {thread:12s} {where:6s} {name}")
            if args.per_save:
                _print_per_save(rows[hi][1], args.saves, args.per_save, f"{mode} {hi} tensors")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    return 0


def _print_per_save(functions: Functions, saves: int, top: int, title: str) -> None:
    """The ``top`` functions by calls per save, in four lists: the call's and the background's,
    each ckptio's and the others'."""
    for side in ("call", "bg"):
        for origin in ("ckptio", "other"):
            chosen = Counter({(thread, name): n / saves for (thread, where, name), n in
                              functions.items() if where == origin
                              and (thread == "call") == (side == "call")})
            print(f"{title}, {side}, {origin}'s: {sum(chosen.values()):.0f} calls per save")
            for (thread, name), v in chosen.most_common(top):
                print(f"  {v:7.1f}  {thread:14s} {name}")


if __name__ == "__main__":
    raise SystemExit(main())
