"""Fixtures for the tests against a real GCS server: the ``gcp-storage-emulator`` (PyPI) on
loopback, started once per session as a subprocess on a free port (in-memory, bucket ``ckpt``),
and the fault proxy (ckptio/testing/s3proxy.py, which forwards any HTTP/1.1) in front of it.

Every test here is skipped, saying why, when google-cloud-storage or the emulator is missing
(``pip install -e '.[test]'`` installs both); an emulator that is present but does not start is
an error, not a skip. The emulator ignores generation preconditions (``ifGenerationMatch``), so
the settings here say ``conditional="off"`` (the store's probe refuses it otherwise: a test
checks that).
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptio.options import Options
from ckptio.storage.gcs.gcs_settings import GcsSettings
from ckptio.testing.s3proxy import FaultProxy

HERE = Path(__file__).resolve().parent
BUCKET = "ckpt"


def _missing() -> str | None:
    for module, package in (("google.cloud.storage", "google-cloud-storage"),
                            ("gcp_storage_emulator", "gcp-storage-emulator")):
        try:
            found = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            found = None
        if found is None:
            return f"{package} is not installed (pip install 'ckptio[test]')"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    why = _missing()
    if why is None:
        return
    skip = pytest.mark.skip(reason=f"GCS tests need the local gcp-storage-emulator: {why}")
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(skip)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Emulator:
    """One gcp-storage-emulator process on 127.0.0.1 (in memory), bucket ``ckpt``."""

    def __init__(self, log: Path) -> None:
        self.host, self.port = "127.0.0.1", _free_port()
        self.endpoint = f"http://{self.host}:{self.port}"
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gcp_storage_emulator", "start", "--port",
                 str(self.port), "-H", self.host, "--default-bucket", BUCKET, "-M"],
                stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                socket.create_connection((self.host, self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        self.close()
        raise RuntimeError(f"gcp-storage-emulator did not start: {self.log.read_text()[-2000:]}")

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    why = _missing()
    if why is not None:
        pytest.skip(f"GCS tests need the local gcp-storage-emulator: {why}")
    server = Emulator(tmp_path_factory.mktemp("gcs") / "emulator.log")
    server.start()
    yield server
    server.close()


def settings_at(endpoint: str, **changes: object) -> GcsSettings:
    """The settings a user gives for the emulator at ``endpoint``."""
    given: dict[str, object] = {"endpoint_url": endpoint, "credentials": "anonymous",
                                "conditional": "off", **changes}
    return GcsSettings(**given)  # type: ignore[arg-type]


@pytest.fixture
def gcs_settings(gcs_server: Emulator) -> GcsSettings:
    return settings_at(gcs_server.endpoint)


@pytest.fixture
def gcs_options(gcs_settings: GcsSettings) -> Options:
    return Options(storage={"gs": gcs_settings})


@pytest.fixture
def gcs_url(gcs_server: Emulator) -> str:
    """A fresh prefix ``gs://ckpt/t-<hex>``."""
    return f"gs://{BUCKET}/t-{uuid.uuid4().hex}"


@pytest.fixture
def gcs_proxy(gcs_server: Emulator) -> Iterator[FaultProxy]:
    """A FaultProxy in front of the emulator, no rules yet; clients use ``gcs_proxy.endpoint``."""
    with FaultProxy(gcs_server.host, gcs_server.port) as proxy:
        yield proxy
    assert not proxy.errors, f"the proxy's threads failed: {proxy.errors!r}"
