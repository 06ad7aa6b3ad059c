"""kill -9 while a first async save grows the staging pool (issue 65): in each phase the
checkpoint already at the path stays intact, bitwise, and the next process saves there again.

A real child process saves checkpoint A at a path synchronously (the pool stays at
Options.pool_bytes), then starts an async save of B to the same path, whose state is larger
than the pool: the pool grows before the capture, its pages faulted in on its own thread. The
child announces the phase it is held in and is SIGKILLed there:

- ``prefault``: the grown pool's first buffer is being faulted in (no byte of B copied yet);
- ``capture``: B's capture is copying (the pre-fault is on its second buffer);
- ``write``: the capture is done (async_save returned), B's writes are in flight.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptio

CHILD = r"""
import sys, threading, time, torch, ckptio
from ckptio.io import stage
from ckptio.testing.faults import inject

path, phase = sys.argv[1], sys.argv[2]
MiB = 1 << 20

def state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": {f"t{i}": torch.randn(MiB // 2, generator=g) for i in range(4)}, "step": seed}

ck = ckptio.Checkpointer(ckptio.Options(buffer_bytes=MiB, pool_bytes=2 * MiB, io_depth=2,
                                        use_profile=False, host_budget_bytes=64 * MiB))
ck.save(state(1), path)
calls = []
populate = stage._populate

def held(address, nbytes):
    calls.append(nbytes)
    if (phase == "prefault" and len(calls) == 1) or (phase == "capture" and len(calls) == 2):
        print(phase, flush=True)
        time.sleep(600)
    populate(address, nbytes)

stage._populate = held
if phase == "write":
    inject(ck, delay_s=600)
handle = ck.async_save(state(2), path)
if phase == "write":
    print(phase, flush=True)
handle.wait()
print("done", flush=True)
"""

PHASES = ("prefault", "capture", "write")


def _state(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {"w": {f"t{i}": torch.randn((1 << 20) // 2, generator=g) for i in range(4)},
            "step": seed}


def _same(got: object, want: object) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys()
        for key in want:
            _same(got[key], want[key])
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    else:
        assert type(got) is type(want) and got == want


@pytest.mark.parametrize("phase", PHASES)
def test_kill_9_while_the_first_async_save_grows_the_pool(tmp_path: Path, phase: str) -> None:
    path = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), phase],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        assert line.strip() == phase, f"child never reached {phase}: {line!r} {proc.stderr.read()}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    _same(ckptio.load(path), _state(1))  # A, whole: B never committed
    ck = ckptio.Checkpointer()
    ck.async_save(_state(3), path).wait()  # the next process saves there again
    _same(ckptio.load(path), _state(3))
    ck.close()
