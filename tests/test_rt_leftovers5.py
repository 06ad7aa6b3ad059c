"""Leftovers, round five: a save's lock held elsewhere, named where a load or a restore meets it.

- GCS and Azure: ``ckptio.load`` of a prefix holding a save's files and no manifest, its lock
  object written by a process on another host, said "interrupted ... or still running" (the
  stores knew only holders on this host). Now the load names that host and pid and reads the
  lock's lease: renewed recently (GCS: rewritten within its lease; Azure: the service's lease
  held), a save still running there, to wait for; not renewed past its lease (or lapsed, or
  broken), a save that died there, to load an earlier checkpoint from (s3/lock.py's wording,
  object_lease.lease_state, one function for the three).
- CheckpointManager.restore passing over a newer incomplete step said "(an interrupted save or
  copy, or one running)". Now, where the step's store can tell (store_contract.TellsInFlight:
  the same lock reading as the load's), it names the lock's holder and whether its save still
  runs, ended (its holder gone), or runs on another host.
"""

from __future__ import annotations

import importlib.util
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio.options import Options

OTHER_HOST = "another-node-7"


def _record(lease_s: float) -> dict[str, Any]:
    """The lock record a save on another host writes (holder.me() there)."""
    since = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(time.time() - 60))
    return {"host": OTHER_HOST, "boot": "boot-elsewhere", "pid": 4242, "start": 77,
            "since": since, "save": "0123abcd", "lease_s": lease_s}


def _assert_running(said: str, where: str) -> None:
    for part in (where, f"host {OTHER_HOST}, pid 4242", "is still running", "started 6",
                 "wait for that save to finish"):
        assert part in said, (part, said)
    assert "interrupted before its commit, or is still running" not in said, said
    assert not any(w in said.lower() for w in ("delete", "rm -", "remove it")), said


def _assert_died(said: str, where: str, how: str) -> None:
    for part in (where, f"its holder, host {OTHER_HOST}, pid 4242, stopped renewing its lock",
                 how, "interrupted before its commit (", "Load an earlier checkpoint"):
        assert part in said, (part, said)
    assert "or is still running" not in said, said


def _load_error(url: str, options: Options | None = None) -> str:
    with pytest.raises(ckptio.IncompleteCheckpointError) as caught:
        ckptio.load(url, options=options)
    return str(caught.value)


# ------------------------------------------------------------------ GCS (gcp-storage-emulator)


@pytest.fixture(scope="module")
def gcs() -> Iterator[Options]:
    from gcs.conftest import Emulator, settings_at

    for module in ("google.cloud.storage", "gcp_storage_emulator"):
        try:
            found = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            found = None
        if found is None:
            pytest.skip(f"needs the local gcp-storage-emulator: {module} is not installed")
    log = Path(f"/tmp/ckptio-left5-gcs-{uuid.uuid4().hex}.log")
    server = Emulator(log)
    server.start()
    yield Options(storage={"gs": settings_at(server.endpoint)})
    server.close()
    log.unlink(missing_ok=True)


def _gcs_leftovers(options: Options, lease_s: float) -> str:
    """A save's objects at a fresh prefix, its manifest gone, its lock another host's."""
    from google.cloud import storage

    url = f"gs://ckpt/t-{uuid.uuid4().hex}"
    ckptio.save({"w": torch.ones(64), "step": 2}, url, options=options)
    settings = options.storage["gs"]
    client = storage.Client(project="test", client_options={"api_endpoint":
                                                            settings.endpoint_url},
                            credentials=__import__("google.auth.credentials", fromlist=["x"])
                            .AnonymousCredentials())
    bucket, prefix = client.bucket("ckpt"), url.split("/", 3)[3]
    bucket.blob(f"{prefix}/manifest.json").delete()
    bucket.blob(f"{prefix}/.ckptio.lock").upload_from_string(json.dumps(_record(lease_s)))
    return url


def test_gcs_load_beside_another_hosts_running_save_names_it(gcs: Options) -> None:
    """The lock rewritten just now by pid 4242 on another host (lease 30 s): the load says a
    save there is still running, names host and pid, and says to wait for it."""
    url = _gcs_leftovers(gcs, 30.0)
    said = _load_error(url, gcs)
    _assert_running(said, url)
    assert "its lock renewed 0 s ago" in said or "its lock renewed 1 s ago" in said, said


def test_gcs_load_beside_another_hosts_dead_save_says_it_died(gcs: Options) -> None:
    """The lock of a save that died on another host, not rewritten past its lease: the load
    says its holder stopped renewing it, that the save was interrupted, and to load an earlier
    checkpoint; a new save there then commits and loads."""
    url = _gcs_leftovers(gcs, 1.0)
    time.sleep(2.2)
    said = _load_error(url, gcs)
    _assert_died(said, url, "past its lease of 1 s")
    ckptio.save({"w": torch.zeros(64), "step": 3}, url, options=gcs)
    assert ckptio.load(url, options=gcs)["step"] == 3


# ------------------------------------------------------------------ Azure (Azurite)


@pytest.fixture(scope="module")
def azure() -> Iterator[str]:
    from ckptio.testing.azurite import AzuriteServer, missing

    why = missing()
    if why is not None:
        pytest.skip(f"needs a local Azurite server: {why}")
    with AzuriteServer() as server:
        yield server.connection


@pytest.fixture
def az_url(azure: str, monkeypatch: pytest.MonkeyPatch) -> str:
    from ckptio.storage.azure.az_settings import CONNECTION_ENV

    monkeypatch.setenv(CONNECTION_ENV, azure)
    return f"az://ckpt/t-{uuid.uuid4().hex}"


def _az_leftovers(connection: str, url: str) -> Any:
    """A save's blobs at ``url``, its manifest gone, its lock blob another host's record ->
    that lock blob's client."""
    from azure.storage.blob import BlobServiceClient

    ckptio.save({"w": torch.ones(64), "step": 2}, url)
    prefix = url.split("/", 3)[3]
    container = BlobServiceClient.from_connection_string(connection).get_container_client("ckpt")
    container.get_blob_client(f"{prefix}/manifest.json").delete_blob()
    lock = container.get_blob_client(f"{prefix}/.ckptio.lock")
    lock.upload_blob(json.dumps(_record(30)).encode())
    return lock


def test_azure_load_beside_another_hosts_leased_lock_names_a_running_save(
        azure: str, az_url: str) -> None:
    """The lock blob leased by pid 4242 on another host (the service holds its lease): the
    load says that save is still running there and to wait for it."""
    lock = _az_leftovers(azure, az_url)
    lease = lock.acquire_lease(lease_duration=15)
    try:
        said = _load_error(az_url)
        _assert_running(said, az_url)
        assert "its lock's lease of 30 s still held" in said, said
    finally:
        lease.break_lease(lease_break_period=0)


@pytest.mark.parametrize("broken", [False, True], ids=["never-leased", "broken"])
def test_azure_load_beside_another_hosts_lapsed_lock_says_it_died(
        azure: str, az_url: str, broken: bool) -> None:
    """The lock blob of a save that died on another host, its lease lapsed (or broken, or
    never taken): the load says its holder stopped renewing it, that the save was
    interrupted, and to load an earlier checkpoint; a new save there then commits."""
    lock = _az_leftovers(azure, az_url)
    if broken:
        lock.acquire_lease(lease_duration=15).break_lease(lease_break_period=0)
    said = _load_error(az_url)
    _assert_died(said, az_url, "its lease lapsed")
    ckptio.save({"w": torch.zeros(64), "step": 3}, az_url)
    assert ckptio.load(az_url)["step"] == 3


# ------------------------------------------------------------------ restore passing a step over

_HOLD = """
import sys
from ckptio.storage.local import dirlock
held = dirlock.lock(sys.argv[1], "raise")
open(sys.argv[1] + "/data-0123456789abcdef0123-r00000-0000.bin", "wb").write(b"x" * 64)
print("held", flush=True)
sys.stdin.read()
dirlock.unlock(held, failed=True)
"""


def _step_20_held(tmp_path: Path) -> tuple[Path, Any]:
    """A run with step 10 committed and step 20's save lock held by a second process (its
    files begun, no manifest) -> the run and that process (it has printed "held")."""
    import subprocess
    import sys

    run = tmp_path / "run"
    with ckptio.CheckpointManager(run) as manager:
        manager.save(10, {"w": torch.full((8,), 10.0), "step": 10})
    (run / "step-20").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(run / "step-20")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return run, holder


def test_restore_names_the_live_holder_of_a_step_passed_over(tmp_path: Path) -> None:
    """A run's step 20 being saved by another process of this host (it holds the step's save
    lock, its files written, no manifest yet): restore() warns naming that process's pid and
    that its save is still running (not "an interrupted save ... or one running"), and
    restores step 10, the newest committed."""
    run, holder = _step_20_held(tmp_path)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        state = {"w": torch.zeros(8), "step": 0}
        with ckptio.CheckpointManager(run) as manager:
            with pytest.warns(UserWarning) as caught:
                assert manager.restore(state) == 10
        said = " ".join(str(w.message) for w in caught)
        for part in ("step 20: incomplete", f"pid {holder.pid}", "is still running",
                     "restored step 10"):
            assert part in said, (part, said)
        assert "an interrupted save or copy, or one running" not in said, said
        assert state["step"] == 10 and torch.equal(state["w"], torch.full((8,), 10.0))
    finally:
        holder.communicate("", timeout=30)
    assert not (run / "step-20" / ".ckptio.lock").exists()


def test_restore_says_a_killed_holders_step_was_interrupted(tmp_path: Path) -> None:
    """The process saving step 20 killed (SIGKILL) while holding its lock: restore() warns
    that step 20's save was interrupted, naming that pid as exited, and restores step 10."""
    run, holder = _step_20_held(tmp_path)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    holder.kill()
    holder.communicate(timeout=30)
    state = {"w": torch.zeros(8), "step": 0}
    with ckptio.CheckpointManager(run) as manager:
        with pytest.warns(UserWarning) as caught:
            assert manager.restore(state) == 10
    said = " ".join(str(w.message) for w in caught)
    for part in ("step 20: incomplete", "a save interrupted before its commit",
                 f"pid {holder.pid} on host", "has exited", "restored step 10"):
        assert part in said, (part, said)
    assert "is still running" not in said, said
    assert state["step"] == 10
