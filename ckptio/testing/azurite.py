"""A real Azure Blob Storage server on loopback for tests: Azurite's blob service (npm
``azurite``, ``npm install -g azurite``), in memory, with telemetry off.

    with AzuriteServer() as server:          # a free port on 127.0.0.1, container "ckpt"
        os.environ["AZURE_STORAGE_CONNECTION_STRING"] = server.connection
        ckptio.save(state, "az://ckpt/run/step-1")

Its account is Azurite's documented development account (devstoreaccount1 and its public key:
no secret). ckptio/testing/s3proxy.py's FaultProxy forwards its HTTP too
(connection_string(proxy port) reaches it through one).

Owns: AzuriteServer, missing() (why none can run here). Test support only.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

__all__ = ["ACCOUNT", "AzuriteServer", "connection_string", "missing"]

ACCOUNT = "devstoreaccount1"
_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/"
        "K1SZFPTOtr/KBHBeksoGMGw==")  # Azurite's published development key
START_S = 60.0


def connection_string(port: int) -> str:
    """The connection string of the Azurite blob service on 127.0.0.1:``port``."""
    return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={_KEY};"
            f"BlobEndpoint=http://127.0.0.1:{port}/{ACCOUNT};")


def missing() -> str | None:
    """Why no Azurite can run here (azure-storage-blob or azurite-blob absent), or None."""
    try:
        import azure.storage.blob  # noqa: F401
    except ImportError:
        return "azure-storage-blob is not installed (pip install 'ckptio[azure]')"
    if shutil.which("azurite-blob") is None:
        return "azurite-blob is not on PATH (npm install -g azurite)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class AzuriteServer:
    """``azurite-blob`` on a free loopback port, in memory; its log in ``workdir``; the
    container ``container`` made at start()."""

    def __init__(self, workdir: str | Path | None = None, container: str = "ckpt") -> None:
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="azurite-"))
        self.container = container
        self.port = _free_port()
        self.log = self.workdir / "azurite.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def connection(self) -> str:
        return connection_string(self.port)

    def start(self) -> AzuriteServer:
        """Start it and make the container; RuntimeError with its log if it does not start."""
        from azure.storage.blob import BlobServiceClient

        binary = shutil.which("azurite-blob")
        if binary is None:
            raise RuntimeError(str(missing()))
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
                 "--inMemoryPersistence", "--extentMemoryLimit", "512", "--skipApiVersionCheck",
                 "--disableTelemetry", "--loose"],
                cwd=self.workdir, stdout=out, stderr=subprocess.STDOUT)
        self._wait_listening()
        BlobServiceClient.from_connection_string(self.connection).create_container(
            self.container)
        return self

    def _wait_listening(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        self.close()
        raise RuntimeError(f"azurite-blob did not start on port {self.port}: "
                           f"{self.log.read_text()[-2000:]}")

    def close(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def __enter__(self) -> AzuriteServer:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
