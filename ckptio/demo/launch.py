"""Starting the demo's training processes and reading what they wrote.

    record = run_training(["--out", out, "--steps", "40", ...])[0]         # one process
    records = run_training([...], world=2)                                   # 2 gloo ranks
    run_training([... "--kill-at", "24"], killed=True)                       # must die by SIGKILL
    running = start_training([...]); ...; records = running.finish()         # in the background

Owns: the command line of a training process, its environment (ranks as torchrun would set
them), waiting for it, telling an expected SIGKILL from a failure (any other exit raises
DemoError with the process's own error), and decoding losses (float.hex) and kill notes.
Does not own: what a process does (train.py) or what the runs mean (main.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = ["DemoError", "Training", "bits", "run_training", "same_bits", "start_training"]


class DemoError(Exception):
    """A training process failed, or did not do what the demo needs (the message says which)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(rank: int, world: int, port: int) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # torch without numpy warns so at import, in every process: once (the caller's) is enough
    quiet = "ignore:Failed to initialize NumPy:UserWarning"
    env["PYTHONWARNINGS"] = ",".join(w for w in (env.get("PYTHONWARNINGS"), quiet) if w)
    if world > 1:
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


class Training:
    """Training processes started by start_training and not yet waited for."""

    def __init__(self, args: Sequence[str], world: int, killed: bool, capture: bool) -> None:
        self.out, self.world, self.killed = _value(args, "--out"), world, killed
        self.command = [sys.executable, "-m", "ckptio.demo.train", *args]
        self.logs = [_log(capture or rank > 0) for rank in range(world)]
        port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(world):
                self.procs.append(subprocess.Popen(
                    self.command, env=_env(rank, world, port), stdout=self.logs[rank],
                    stderr=subprocess.STDOUT if self.logs[rank] else None))
        except BaseException:
            self.stop()
            raise

    def finish(self, timeout_s: float = 600) -> list[dict[str, Any]]:
        """Wait for every rank; -> each rank's JSON record (with its kill note if killed)."""
        try:
            codes = [p.wait(timeout=timeout_s) for p in self.procs]
        except subprocess.TimeoutExpired:
            raise DemoError(f"{_what(self.command)} still running after {timeout_s:.0f} s, "
                            "stopped" + _tails(self.logs)) from None
        finally:
            self.stop()
        _check(codes, self.killed, self.command, self.logs)
        paths = [self.out if r == 0 else f"{self.out}.rank{r}" for r in range(self.world)]
        records = [read_record(path) for path in paths]
        if self.killed:
            for path, record in zip(paths, records):
                record["kill"] = read_kill_note(f"{path}.kill")
        return records

    def stop(self) -> None:
        """Kill the processes still running (ours; a failed rank leaves its peers waiting)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def start_training(args: Sequence[str], *, world: int = 1, killed: bool = False,
                   capture: bool = False) -> Training:
    """Start ``python -m ckptio.demo.train ARGS`` on ``world`` ranks (torchrun's variables);
    ``finish()`` waits. ``killed``: every rank must end by SIGKILL (it kills itself at
    --kill-at); else every rank must exit 0. ``capture``: keep the output (shown in the
    DemoError if it fails) instead of letting rank 0's through to this terminal."""
    return Training(args, world, killed, capture)


def run_training(args: Sequence[str], *, world: int = 1, killed: bool = False,
                 capture: bool = False, timeout_s: float = 600) -> list[dict[str, Any]]:
    """start_training(...).finish(): run the processes to the end; -> each rank's record."""
    return start_training(args, world=world, killed=killed, capture=capture).finish(timeout_s)


def _value(args: Sequence[str], flag: str) -> str:
    if flag not in args or args.index(flag) + 1 >= len(args):
        raise DemoError(f"internal: training arguments lack {flag}")
    return args[args.index(flag) + 1]


def _log(keep: bool) -> TextIO | None:
    return tempfile.TemporaryFile("w+") if keep else None


def _what(command: Sequence[str]) -> str:
    return "the training process `" + " ".join(["python", *command[1:]]) + "`"


def _check(codes: Sequence[int | None], killed: bool, command: Sequence[str],
           logs: list[TextIO | None]) -> None:
    want = -signal.SIGKILL if killed else 0
    bad = [(r, c) for r, c in enumerate(codes) if c != want]
    if not bad:
        for log in logs:
            if log is not None:
                log.close()
        return
    how = ", ".join(f"rank {r} {_exit(c)}" for r, c in bad)
    expected = "to be killed by SIGKILL" if killed else "to exit 0"
    raise DemoError(f"{_what(command)} failed: {how} (expected {expected})" + _tails(logs))


def _exit(code: int | None) -> str:
    if code is None:
        return "did not finish"
    if code < 0:
        return f"died of signal {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _tails(logs: list[TextIO | None], lines: int = 40) -> str:
    """The end of each captured output (rank 0's own went to the terminal when not captured)."""
    text = ""
    for rank, log in enumerate(logs):
        if log is None:
            continue
        log.seek(0)
        tail = log.read().splitlines()[-lines:]
        log.close()
        text += f"\n--- rank {rank} output (last {len(tail)} lines) ---\n" + "\n".join(tail)
    return text or "; its error is printed above"


def read_record(path: str) -> dict[str, Any]:
    """A training process's JSON, losses decoded: {"losses": {step: float}, ...}."""
    try:
        with open(path) as f:
            record: dict[str, Any] = json.load(f)
    except (OSError, ValueError) as exc:
        raise DemoError(f"cannot read the training record {path}: {exc}") from None
    record["losses"] = {int(k): float.fromhex(v) for k, v in record["losses"].items()}
    return record


def read_kill_note(path: str) -> dict[str, Any]:
    """What a process wrote just before it SIGKILLed itself (see train.kill_now)."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode().strip()
        note: dict[str, Any] = json.loads(text)
    except (OSError, ValueError) as exc:
        raise DemoError(f"the killed process left no readable note at {path}: {exc}") from None
    return note


def bits(value: float) -> str:
    """The float32 bit pattern of a loss (losses are float32 values), as 8 hex digits."""
    return struct.pack(">f", value).hex()


def same_bits(a: float, b: float) -> bool:
    """Bitwise equality of two Python floats (NaN equals NaN of the same bits; -0.0 != 0.0)."""
    return float.hex(a) == float.hex(b)
