"""Two jobs on one S3 run prefix: the run lease (storage/s3/lock.py take_run).

Before it, a second job started on an S3 run another live job was saving into went on: each
job's retention dropped the other's steps. Now (real processes, a real SeaweedFS, the training
script's own code):
(1) the second job restores (a reader of a live run writes nothing) and its first save is
    refused, naming the holder's pid, within a bounded time, nothing written; with
    ``take_over=True`` it saves, and the first job's next save is refused (CheckpointLockedError)
    and its close() drops none of the second job's steps;
(2) a holder killed with SIGKILL on this host frees the run at once;
(3) a lease left by a job that died on another host is taken over once it was not renewed for
    its lease, and not before;
(4) one process's second manager, a closed manager's lease object, an empty prefix's restore.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch

from ckptio import CheckpointManager, Options
from ckptio.errors import CheckpointLockedError

DEADLINE_S = 60  # a guard against a hang, not a timing check
LEASE_S = 3.0
LEASE = ".ckptio-run.lease"

JOB = textwrap.dedent("""
    import sys, torch, ckptio
    run, lease_s, take_over, keep = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
    model = torch.nn.Linear(4, 4)
    state = {"model": model, "step": 0}
    mgr = ckptio.CheckpointManager(run, save_every=1, keep_last=keep, take_over=take_over,
                                   options=ckptio.Options(s3_lock_lease_s=lease_s))
    print("restored", mgr.restore(state), flush=True)
    for line in sys.stdin:  # "save N" / "close"
        word, _, arg = line.strip().partition(" ")
        try:
            if word == "save":
                mgr.save(int(arg), state)
                mgr.wait()
                print("saved", arg, flush=True)
            else:
                mgr.close()
                print("closed", flush=True)
        except ckptio.CkptError as exc:
            print("refused", type(exc).__name__, str(exc).replace(chr(10), " "), flush=True)
""")


class Job:
    """A training job in its own process, driven line by line."""

    def __init__(self, run: str, take_over: bool = False, keep: int = 2) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", JOB, run, str(LEASE_S), "1" if take_over else "0", str(keep)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.restored = self._answer()

    def _answer(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read() if self.proc.stderr else "no output"
        return line.strip()

    def ask(self, command: str) -> tuple[str, float]:
        assert self.proc.stdin is not None
        started = time.monotonic()
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._answer(), time.monotonic() - started

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(DEADLINE_S)
        return self.proc.stderr.read() if self.proc.stderr else ""


def _keys(s3_client: Any, run: str) -> dict[str, str]:
    bucket, _, prefix = run[len("s3://"):].partition("/")
    pages = s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return {o["Key"][len(prefix) + 1:]: o["ETag"] for page in pages
            for o in page.get("Contents", [])}


def _data(s3_client: Any, run: str) -> dict[str, str]:
    """Every object but the lease (which its holder rewrites as it renews it)."""
    return {k: v for k, v in _keys(s3_client, run).items() if k != LEASE}


def _steps(s3_client: Any, run: str) -> set[str]:
    return {k.split("/")[0] for k in _keys(s3_client, run) if k.endswith("manifest.json")}


def test_a_second_job_is_refused_at_its_first_save_and_take_over_stops_the_first(
        s3_env: str, s3_client: Any) -> None:
    run = s3_env
    first = Job(run, keep=1)  # its retention would drop all but its newest step
    second = taker = None
    try:
        assert first.ask("save 1")[0] == "saved 1"
        assert first.ask("save 2")[0] == "saved 2"
        second = Job(run)
        assert second.restored == "restored 2"  # a reader of a live run is not refused
        before = _data(s3_client, run)
        answer, took = second.ask("save 3")
        assert answer.startswith("refused CheckpointLockedError"), answer
        assert f"pid {first.proc.pid}" in answer and "in use by another job" in answer
        assert "take_over=True" in answer
        assert took < LEASE_S + 5, took  # a live holder shows itself within a renewal
        assert _data(s3_client, run) == before  # nothing written, nothing dropped
        taker = Job(run, take_over=True)
        assert taker.ask("save 3")[0] == "saved 3"
        assert taker.ask("save 4")[0] == "saved 4"
        time.sleep(LEASE_S / 3 + 1)  # the first job's renewal meets the taker's lease
        answer, _ = first.ask("save 5")
        assert answer.startswith("refused CheckpointLockedError"), answer
        assert "taken over by another job" in answer and f"pid {taker.proc.pid}" in answer
        assert first.ask("close")[0] == "closed"
        assert {"step-3", "step-4"} <= _steps(s3_client, run)  # the taker's, kept
    finally:
        errors = first.stop()
        for job in (second, taker):
            if job is not None:
                job.stop()
    assert "another job took over the run lease" in errors  # the first job was told


def test_a_killed_holder_frees_the_run_at_once(s3_env: str, s3_client: Any) -> None:
    run = s3_env
    first = Job(run)
    try:
        assert first.ask("save 1")[0] == "saved 1"
    finally:
        first.proc.send_signal(signal.SIGKILL)
        first.stop()
    assert LEASE in _keys(s3_client, run)  # left by the killed job
    second = Job(run)
    try:
        assert second.restored == "restored 1"
        answer, took = second.ask("save 2")
        assert answer == "saved 2" and took < LEASE_S, (answer, took)  # not waited out
        assert second.ask("close")[0] == "closed"
    finally:
        errors = second.stop()
    assert f"pid {first.proc.pid}" in errors and "has exited" in errors
    assert LEASE not in _keys(s3_client, run)  # close() let it go


def test_a_job_that_exits_without_close_lets_the_run_go(s3_env: str, s3_client: Any) -> None:
    """A script that ends without close() (the common case) leaves no lease for the next
    job, on another host, to wait out."""
    script = textwrap.dedent("""
        import sys, torch, ckptio
        mgr = ckptio.CheckpointManager(sys.argv[1], save_every=1)
        mgr.save(1, {"w": torch.ones(3)})
    """)
    done = subprocess.run([sys.executable, "-c", script, s3_env], capture_output=True,
                          text=True, timeout=DEADLINE_S)
    assert done.returncode == 0 and "was not closed before exit" in done.stderr, done.stderr
    assert LEASE not in _keys(s3_client, s3_env) and "step-1/manifest.json" in _keys(
        s3_client, s3_env)


def _foreign_lease(s3_client: Any, run: str, renewed: int = 0) -> None:
    bucket, _, prefix = run[len("s3://"):].partition("/")
    record = {"host": "another-host", "boot": "b", "pid": 4242, "start": 1, "since": "then",
              "lease_s": LEASE_S, "renewed": renewed}
    s3_client.put_object(Bucket=bucket, Key=f"{prefix}/{LEASE}", Body=json.dumps(record).encode())


def test_a_lease_a_job_left_on_another_host_is_taken_over_after_its_lease(
        s3_env: str, s3_client: Any, caplog: pytest.LogCaptureFixture) -> None:
    _foreign_lease(s3_client, s3_env)
    options = Options(s3_lock_lease_s=LEASE_S)
    with CheckpointManager(s3_env, save_every=1, options=options) as mgr:
        started = time.monotonic()
        mgr.save(1, {"w": torch.ones(3)})
        took = time.monotonic() - started
    assert LEASE_S - 1.5 <= took <= LEASE_S + 8, took  # waited for it to lapse, no longer
    assert "took over the run" in caplog.text and "another-host" in caplog.text
    assert "not renewed" in caplog.text


def test_a_renewed_lease_of_another_host_refuses_and_take_over_goes_on(
        s3_env: str, s3_client: Any) -> None:
    options = Options(s3_lock_lease_s=LEASE_S)
    written, stop = threading.Event(), threading.Event()

    def renewing() -> None:  # the other host's job, alive: its lease rewritten now and then
        renewed = 0
        while not stop.is_set():
            renewed += 1
            _foreign_lease(s3_client, s3_env, renewed)
            written.set()
            stop.wait(0.5)

    thread = threading.Thread(target=renewing)
    thread.start()
    try:
        assert written.wait(DEADLINE_S)
        with CheckpointManager(s3_env, save_every=1, options=options) as mgr:
            with pytest.raises(CheckpointLockedError, match="another-host, pid 4242"):
                mgr.save(1, {"w": torch.ones(3)})
            assert _steps(s3_client, s3_env) == set()
    finally:
        stop.set()
        thread.join()
    with CheckpointManager(s3_env, save_every=1, options=options, take_over=True) as mgr:
        mgr.save(1, {"w": torch.ones(3)})
    assert _steps(s3_client, s3_env) == {"step-1"}


def test_one_process_may_make_a_second_manager_and_an_empty_run_restores_nothing(
        s3_env: str, s3_client: Any) -> None:
    options = Options(s3_lock_lease_s=LEASE_S)
    with CheckpointManager(s3_env, save_every=1, options=options) as a, \
            CheckpointManager(s3_env, save_every=1, options=options) as b:
        assert a.restore({"w": torch.zeros(3)}) is None  # nothing saved there yet
        a.save(1, {"w": torch.ones(3)})
        assert LEASE in _keys(s3_client, s3_env)
        b.save(2, {"w": torch.full((3,), 2.0)})
        w = torch.zeros(3)
        assert b.restore({"w": w}) == 2 and torch.equal(w, torch.full((3,), 2.0))
    assert LEASE not in _keys(s3_client, s3_env)


def test_the_lease_object_alone_is_no_checkpoint(s3_env: str, s3_client: Any) -> None:
    """A prefix holding only a lease (its job killed before its first commit) restores
    nothing rather than pointing at the lease object."""
    _foreign_lease(s3_client, s3_env)
    with CheckpointManager(s3_env, save_every=1, options=Options(s3_lock_lease_s=LEASE_S)) as m:
        assert m.restore({"w": torch.zeros(3)}) is None
