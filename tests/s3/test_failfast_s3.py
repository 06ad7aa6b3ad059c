"""S3 fails fast on what retrying cannot fix (issue 30, section 5), against a real SeaweedFS
server: missing credentials, an https:// endpoint on the plain-HTTP server, a self-signed TLS
certificate, a closed port. Each raises StorageIOError (a CkptError) naming the cause within
seconds, under the default 120 s retry deadline; retries of a transient failure (503 SlowDown
from the fault proxy) log a warning once they last a few seconds, and the save then succeeds.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ckptio
from ckptio.storage.s3 import client as s3client

ROOT = Path(__file__).resolve().parents[2]
FAST_S = 10.0  # "within seconds": every refusal here comes well inside this


@pytest.fixture(autouse=True)
def _fresh_endpoints() -> Iterator[None]:
    """Endpoints answered or given up on by earlier tests do not carry over."""
    s3client._reached.clear()
    s3client.timeouts.reset()
    yield
    s3client._reached.clear()
    s3client.timeouts.reset()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on return: nothing listens there


def _refused(url: str, *phrases: str) -> ckptio.CkptError:
    """Save to ``url`` with the default options (120 s retry deadline): the error it raises,
    checked to come within FAST_S and to name ``phrases``."""
    assert ckptio.Options().s3_retry_deadline_s >= 60  # the deadline is not what makes it fast
    began = time.monotonic()
    with pytest.raises(ckptio.StorageIOError) as info:
        ckptio.save({"w": torch.ones(4)}, url)
    elapsed = time.monotonic() - began
    assert elapsed < FAST_S, f"{elapsed:.1f} s: {info.value}"
    for phrase in phrases:
        assert phrase in str(info.value), str(info.value)
    return info.value


def test_missing_credentials_fail_at_once(s3_env: str, monkeypatch, tmp_path: Path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role lookup off-box
    _refused(f"{s3_env}/c", "no S3 credentials", "AWS_ACCESS_KEY_ID")


def test_https_against_the_plain_http_server_fails_at_once(s3_env: str, s3_live, monkeypatch):
    endpoint = s3_live.endpoint.replace("http://", "https://")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    _refused(f"{s3_env}/c", f"TLS handshake with {endpoint}", "plain HTTP", "http://")


@pytest.fixture
def self_signed(tmp_path: Path) -> Iterator[str]:
    """An https:// endpoint on 127.0.0.1 whose certificate is self-signed (openssl makes it):
    it completes TLS handshakes the client accepts, and nothing else."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                with context.wrap_socket(conn, server_side=True):
                    pass  # the client refuses the certificate during the handshake
            except (ssl.SSLError, OSError):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"https://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    listener.close()


def test_a_self_signed_certificate_fails_at_once(s3_env: str, self_signed: str, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", self_signed)
    _refused(f"{s3_env}/c", f"TLS certificate of {self_signed} is not trusted", "AWS_CA_BUNDLE")


def test_a_closed_port_fails_within_seconds(s3_env: str, monkeypatch):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    error = _refused(f"{s3_env}/c", f"nothing answers at {endpoint}", "AWS_ENDPOINT_URL")
    assert "attempt(s) in" in str(error)  # retried briefly (a server starting), then refused


def test_the_command_names_a_closed_port_in_one_line_within_seconds(s3_env: str, monkeypatch):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AWS_ENDPOINT_URL": endpoint}
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ckptio", "ls", f"{s3_env}/c"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert time.monotonic() - began < FAST_S + 5  # + the interpreter's start on a loaded box
    line, = done.stderr.strip().splitlines()
    assert done.returncode == 2 and line.startswith("ckptio: error: ") and \
        f"nothing answers at {endpoint}" in line, done.stderr


def test_a_wrong_secret_names_the_credentials_in_the_command_too(s3_env: str):
    """ls and verify (no bucket check first) name the credentials as a save does."""
    ckptio.save({"w": torch.ones(4)}, f"{s3_env}/c")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AWS_SECRET_ACCESS_KEY": "wrong"}
    for command in ("ls", "verify"):
        done = subprocess.run([sys.executable, "-m", "ckptio", command, f"{s3_env}/c"], env=env,
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 2 and "check the credentials" in done.stderr, done.stderr


def test_retries_of_a_transient_failure_are_visible_then_the_save_succeeds(
        s3_env: str, s3_proxy, caplog):
    """503 SlowDown on every request for RETRY_WARN_S + 5.5 s (a retry lands in those last
    5.5 s: backoff pauses are at most 5 s): a warning names the request and the retries once
    they last RETRY_WARN_S, and the save goes through once the store answers."""
    rule = s3_proxy.fail(503, "SlowDown", times=None)
    healed = threading.Timer(s3client.RETRY_WARN_S + 5.5, s3_proxy.clear)
    healed.start()
    url = f"{s3_env}/slow"
    options = ckptio.Options(s3_endpoint_url=s3_proxy.endpoint)
    state = {"w": torch.arange(16.0)}
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        ckptio.save(state, url, options=options)
    healed.join()
    warned = [r.getMessage() for r in caplog.records if "still retrying after" in r.getMessage()]
    assert warned and "looking up bucket" in warned[0] and "503" in warned[0], warned
    assert "s3_retry_deadline_s" in warned[0] and len(warned) == 1  # once, not per attempt
    assert rule.fired > 1
    assert torch.equal(ckptio.load(url, options=options)["w"], state["w"])


def test_a_missing_bucket_is_named_with_the_fix_on_save_load_and_restore(s3_env: str) -> None:
    """A bucket name with a typo: save, load and a manager's restore each raise within seconds
    naming the bucket, that it does not exist, and the fix."""
    url = "s3://no-such-bucket-ckptio-typo/run"
    _refused(f"{url}/step-1", "no-such-bucket-ckptio-typo", "does not exist", "create it")
    for attempt in (lambda: ckptio.load(f"{url}/step-1"),
                    lambda: ckptio.CheckpointManager(url).restore({"w": torch.zeros(4)})):
        began = time.monotonic()
        with pytest.raises(ckptio.CkptError) as info:
            attempt()
        assert time.monotonic() - began < FAST_S
        for phrase in ("no-such-bucket-ckptio-typo", "does not exist", "create it"):
            assert phrase in str(info.value), str(info.value)


def test_an_endpoint_without_its_scheme_or_half_the_credentials_is_named(s3_env: str, s3_live,
                                                                         monkeypatch):
    bare = s3_live.endpoint.removeprefix("http://")
    monkeypatch.setenv("AWS_ENDPOINT_URL", bare)  # botocore says only "Invalid endpoint"
    _refused(f"{s3_env}/c", f"{bare!r} has no scheme", f"write {s3_live.endpoint}")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_live.endpoint)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    _refused(f"{s3_env}/c", "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")


def test_an_http_server_that_is_not_s3_is_named_as_such(s3_env: str, monkeypatch):
    """A live port that is not S3 (a filer's or master's port): 404s with no S3 error code."""
    import http.server

    class NotS3(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_port}")
        _refused(f"{s3_env}/c", "answers HTTP but not as S3", "no S3 error code",
                 "AWS_ENDPOINT_URL")
    finally:
        server.shutdown()
        server.server_close()
