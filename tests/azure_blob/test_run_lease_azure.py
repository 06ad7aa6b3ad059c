"""Two jobs on one az:// run: the run lease (storage/azure/az_lock.py take_run).

Before it, a second job on an Azure run another live job was saving into went on, and each
job's retention dropped the other's steps. Against Azurite, another job is a blob lease on
``<run>/.ckptio-run.lease`` with that job's record, taken with the SDK:
(1) held and its record rewritten (a live job): this job's first save is refused naming it,
    nothing written; ``take_over=True`` breaks it and saves;
(2) a lease blob a job left long ago (its lease lapsed): taken at once, warned;
(3) this job's lease broken and taken by another job: this job's next save is refused and its
    close() leaves the other's lease and steps alone.
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
from ckptio.storage.azure.az_client import AzPath, container
from ckptio.storage.azure.az_settings import AzureSettings

LEASE_S = 15  # Azure's shortest lease
LEASE = ".ckptio-run.lease"


@pytest.fixture
def settings(az_env: str) -> AzureSettings:
    return AzureSettings(lock_lease_s=LEASE_S)


def _blob(settings: AzureSettings, run: str) -> Any:
    where = AzPath.parse(run).child(LEASE)
    return container(settings, where.container).get_blob_client(where.name)


def _record(renewed: int = 0) -> bytes:
    return json.dumps({"host": "another-host", "boot": "b", "pid": 4242, "start": 1,
                       "since": "then", "lease_s": LEASE_S, "renewed": renewed}).encode()


def _names(settings: AzureSettings, run: str) -> set[str]:
    where = AzPath.parse(run)
    prefix = where.name.rstrip("/") + "/"
    listed = container(settings, where.container).list_blobs(name_starts_with=prefix)
    return {b.name[len(prefix):] for b in listed}


def _options(settings: AzureSettings) -> Options:
    return Options(storage={"az": dataclasses.replace(settings)})


def test_a_live_jobs_lease_refuses_the_first_save_and_take_over_breaks_it(
        az_env: str, settings: AzureSettings) -> None:
    blob = _blob(settings, az_env)
    blob.upload_blob(_record(), overwrite=True)
    lease = blob.acquire_lease(lease_duration=LEASE_S)
    stop = threading.Event()

    def renewing() -> None:  # the other job, alive
        renewed = 0
        while not stop.wait(0.3):
            renewed += 1
            blob.upload_blob(_record(renewed), overwrite=True, lease=lease)

    thread = threading.Thread(target=renewing)
    thread.start()
    try:
        with CheckpointManager(az_env, save_every=1, options=_options(settings)) as mgr:
            started = time.monotonic()
            with pytest.raises(CheckpointLockedError, match="another-host, pid 4242"):
                mgr.save(1, {"w": torch.ones(3)})
            assert time.monotonic() - started < 10
        assert _names(settings, az_env) == {LEASE}  # nothing written
    finally:
        stop.set()
        thread.join()
    with CheckpointManager(az_env, save_every=1, options=_options(settings),
                           take_over=True) as mgr:
        mgr.save(1, {"w": torch.ones(3)})
    names = _names(settings, az_env)
    assert "step-1/manifest.json" in names and LEASE not in names  # close() let it go


def test_a_lease_blob_left_long_ago_is_taken_at_once(
        az_env: str, settings: AzureSettings, caplog: pytest.LogCaptureFixture) -> None:
    _blob(settings, az_env).upload_blob(_record(), overwrite=True)
    with CheckpointManager(az_env, save_every=1, options=_options(settings)) as mgr:
        started = time.monotonic()
        mgr.save(1, {"w": torch.ones(3)})
        assert time.monotonic() - started < 5
    assert "took over the run" in caplog.text and "another-host" in caplog.text


def test_a_job_whose_lease_was_taken_saves_and_drops_nothing(
        az_env: str, settings: AzureSettings) -> None:
    from azure.storage.blob import BlobLeaseClient

    mgr = CheckpointManager(az_env, save_every=1, keep_last=1, options=_options(settings))
    try:
        mgr.save(1, {"w": torch.ones(3)})
        mgr.wait()
        blob = _blob(settings, az_env)
        BlobLeaseClient(blob).break_lease(lease_break_period=0)  # another job's take_over
        theirs = blob.acquire_lease(lease_duration=LEASE_S)
        blob.upload_blob(_record(), overwrite=True, lease=theirs)
        time.sleep(LEASE_S / 3 + 1.5)  # this job's renewal meets their lease
        with pytest.raises(CheckpointLockedError, match="taken over by another job"):
            mgr.save(2, {"w": torch.full((3,), 2.0)})
    finally:
        mgr.close()
    names = _names(settings, az_env)
    assert "step-1/manifest.json" in names and not any(n.startswith("step-2/") for n in names)
    assert LEASE in names  # theirs, left to them
