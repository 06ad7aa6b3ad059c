"""Two jobs on one gs:// run: the run lease (storage/gcs/gcs_lock.py take_run).

Before it, a second job on a GCS run another live job was saving into went on, and each job's
retention dropped the other's steps. Against the gcp-storage-emulator (which ignores generation
preconditions: ``conditional="off"``, the lease is looked up, then written), another job's lease
is its record written into ``<run>/.ckptio-run.lease``:
(1) rewritten while this job's first save watches it (a live job): refused, naming the
    holder, nothing written; ``take_over=True`` goes on;
(2) left unrewritten (a job that died on another host): taken over after its lease;
(3) written over this job's own lease (a job that took the run over): this job's next save is
    refused and its close() drops nothing; a manager's close() removes its lease.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any

import pytest
import torch

from ckptio import CheckpointManager, Options
from ckptio.errors import CheckpointLockedError
from ckptio.storage.gcs.gcs_client import GcsPath, client
from ckptio.storage.gcs.gcs_settings import GcsSettings

LEASE_S = 2.0
LEASE = ".ckptio-run.lease"


def _blob(settings: GcsSettings, run: str, name: str = LEASE) -> Any:
    where = GcsPath.parse(run).child(name)
    return client(settings).bucket(where.bucket).blob(where.key)


def _write_foreign(settings: GcsSettings, run: str, renewed: int = 0) -> None:
    record = {"host": "another-host", "boot": "b", "pid": 4242, "start": 1, "since": "then",
              "lease_s": LEASE_S, "renewed": renewed}
    _blob(settings, run).upload_from_string(json.dumps(record))


def _names(settings: GcsSettings, run: str) -> set[str]:
    where = GcsPath.parse(run)
    prefix = where.key.rstrip("/") + "/"
    return {b.name[len(prefix):] for b in client(settings).list_blobs(where.bucket, prefix=prefix)}


@pytest.fixture
def options(gcs_settings: GcsSettings) -> Options:
    return Options(storage={"gs": dataclasses.replace(gcs_settings, lock_lease_s=LEASE_S)})


def test_a_live_jobs_lease_refuses_the_first_save_and_take_over_goes_on(
        gcs_url: str, gcs_settings: GcsSettings, options: Options) -> None:
    written, stop = threading.Event(), threading.Event()

    def renewing() -> None:
        renewed = 0
        while not stop.is_set():
            renewed += 1
            _write_foreign(gcs_settings, gcs_url, renewed)
            written.set()
            stop.wait(0.3)

    thread = threading.Thread(target=renewing)
    thread.start()
    try:
        assert written.wait(30)
        with CheckpointManager(gcs_url, save_every=1, options=options) as mgr:
            started = time.monotonic()
            with pytest.raises(CheckpointLockedError, match="another-host, pid 4242"):
                mgr.save(1, {"w": torch.ones(3)})
            assert time.monotonic() - started < LEASE_S + 5
        assert _names(gcs_settings, gcs_url) == {LEASE}  # nothing written
    finally:
        stop.set()
        thread.join()
    with CheckpointManager(gcs_url, save_every=1, options=options, take_over=True) as mgr:
        mgr.save(1, {"w": torch.ones(3)})
    assert _names(gcs_settings, gcs_url) >= {"step-1/manifest.json"}
    assert LEASE not in _names(gcs_settings, gcs_url)  # close() let it go


def test_a_lease_left_by_a_dead_job_elsewhere_is_taken_after_its_lease(
        gcs_url: str, gcs_settings: GcsSettings, options: Options,
        caplog: pytest.LogCaptureFixture) -> None:
    _write_foreign(gcs_settings, gcs_url)
    with CheckpointManager(gcs_url, save_every=1, options=options) as mgr:
        started = time.monotonic()
        mgr.save(1, {"w": torch.ones(3)})
        took = time.monotonic() - started
    assert LEASE_S - 1.5 <= took <= LEASE_S + 8, took
    assert "took over the run" in caplog.text and "not renewed" in caplog.text


def test_a_job_whose_lease_was_taken_over_saves_and_drops_nothing(
        gcs_url: str, gcs_settings: GcsSettings, options: Options) -> None:
    mgr = CheckpointManager(gcs_url, save_every=1, keep_last=1, options=options)
    try:
        mgr.save(1, {"w": torch.ones(3)})
        mgr.wait()
        _write_foreign(gcs_settings, gcs_url)  # another job took the run over with take_over
        time.sleep(LEASE_S / 3 + 1.5)  # a renewal meets the other job's record
        with pytest.raises(CheckpointLockedError, match="taken over by another job"):
            mgr.save(2, {"w": torch.full((3,), 2.0)})
    finally:
        mgr.close()
    names = _names(gcs_settings, gcs_url)
    assert "step-1/manifest.json" in names and not any(n.startswith("step-2/") for n in names)
    assert LEASE in names  # the other job's, left to it
