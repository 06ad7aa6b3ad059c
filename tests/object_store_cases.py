"""What the object stores' red-team tests share (tests/s3/test_rt_s3.py, tests/gcs/test_rt_gcs.py,
tests/azure_blob/test_rt_azure.py): a seeded state of a given size, and a failure that must come
within a bound."""

from __future__ import annotations

import os
import select
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import ckptio

MiB = 1 << 20


def random_state(seed: int, mib: int = 2) -> dict[str, Any]:
    """A state of ``mib`` MiB of float32 drawn from ``seed``, and the seed as its step."""
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=g), "step": seed}


def raises_within(seconds: float, work: Any) -> str:
    """``work()`` raises StorageIOError within ``seconds``; -> its message."""
    began = time.monotonic()
    with pytest.raises(ckptio.StorageIOError) as info:
        work()
    took = time.monotonic() - began
    assert took < seconds, f"failed after {took:.1f} s (bound {seconds} s): {info.value}"
    return str(info.value)


def until(done: Callable[[], bool], within_s: float) -> None:
    """Poll ``done`` until true; AssertionError after ``within_s``."""
    deadline = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < deadline, f"not within {within_s} s"
        time.sleep(0.05)


def stderr_until(child: subprocess.Popen[str], words: tuple[str, ...], within_s: float) -> str:
    """The child's stderr up to where one of ``words`` shows (or its end), read from its file
    descriptor unbuffered (communicate() reads the rest)."""
    assert child.stderr is not None
    fd, said, deadline = child.stderr.fileno(), b"", time.monotonic() + within_s
    while time.monotonic() < deadline and not any(w.encode() in said for w in words):
        if select.select([fd], [], [], 0.2)[0]:
            got = os.read(fd, 65536)
            if not got:
                break
            said += got
    return said.decode(errors="replace")

