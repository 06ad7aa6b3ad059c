"""Fixtures for the tests against a real Azure Blob Storage server: Azurite's blob service
(npm ``azurite``) on loopback, in memory, started once per session, and a fault proxy in front
of it (ckptio/testing/s3proxy.py forwards any HTTP/1.1).

Every test here is skipped, saying why, when azure-storage-blob or ``azurite-blob`` is missing
(``pip install -e '.[test]'`` installs the first; ``npm install -g azurite``, which .ci/run
runs, the second); an Azurite that is present but does not start is an error, not a skip.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckptio.storage.azure import az_client
from ckptio.storage.azure.az_settings import CONNECTION_ENV
from ckptio.storage.s3 import timeouts
from ckptio.testing.s3proxy import FaultProxy

HERE = Path(__file__).resolve().parent
CONTAINER = "ckpt"
START_S = 60.0
# Azurite's well-known development account (public, documented; no real secret)
ACCOUNT = "devstoreaccount1"
KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
       "KBHBeksoGMGw==")


def connection_string(port: int) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint=http://127.0.0.1:{port}/{ACCOUNT};")


def through(proxy: FaultProxy) -> str:
    """The connection string of the server reached through ``proxy``."""
    return connection_string(int(proxy.endpoint.rsplit(":", 1)[1]))


def _missing() -> str | None:
    """Why the Azure tests cannot run here, or None."""
    try:
        import azure.storage.blob  # noqa: F401
    except ImportError:
        return "azure-storage-blob is not installed (pip install 'ckptio[azure]')"
    if shutil.which("azurite-blob") is None:
        return "azurite-blob is not on PATH (npm install -g azurite)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    why = _missing()
    if why is None:
        return
    skip = pytest.mark.skip(reason=f"Azure tests need a local Azurite server: {why}")
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(skip)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Azurite:
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def connection(self) -> str:
        return connection_string(self.port)


def _wait_listening(server: Azurite) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            break
        try:
            socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    server.process.kill()
    raise RuntimeError(f"azurite-blob did not start on port {server.port}: "
                       f"{server.log.read_text()[-2000:]}")


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    """One Azurite blob service for the session (in memory, no telemetry), container
    ``ckpt`` created."""
    why = _missing()
    if why is not None:
        pytest.skip(f"Azure tests need a local Azurite server: {why}")
    from azure.storage.blob import BlobServiceClient

    log = tmp_path_factory.mktemp("azurite") / "azurite.log"
    port = _free_port()
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(shutil.which("azurite-blob")), "--blobHost", "127.0.0.1", "--blobPort",
             str(port), "--inMemoryPersistence", "--extentMemoryLimit", "512",
             "--skipApiVersionCheck", "--disableTelemetry", "--loose"],
            cwd=log.parent, stdout=out, stderr=subprocess.STDOUT)
    server = Azurite(port, process, log)
    try:
        _wait_listening(server)
        BlobServiceClient.from_connection_string(server.connection).create_container(CONTAINER)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(autouse=True)
def _fresh_endpoints() -> Iterator[None]:
    """Endpoints answered or given up on by earlier tests do not carry over."""
    az_client._reached.clear()
    timeouts.reset()
    yield
    az_client._reached.clear()
    timeouts.reset()


@pytest.fixture
def az_env(azurite: Azurite, monkeypatch: pytest.MonkeyPatch) -> str:
    """Points AZURE_STORAGE_CONNECTION_STRING at the server and returns a fresh prefix
    ``az://ckpt/t-<hex>``."""
    monkeypatch.setenv(CONNECTION_ENV, azurite.connection)
    return f"az://{CONTAINER}/t-{uuid.uuid4().hex}"


@pytest.fixture
def az_proxy(azurite: Azurite) -> Iterator[FaultProxy]:
    """A FaultProxy in front of the server, no rules yet (connection_string(proxy port))."""
    with FaultProxy("127.0.0.1", azurite.port) as proxy:
        yield proxy
    assert not proxy.errors, f"the proxy's threads failed: {proxy.errors!r}"
