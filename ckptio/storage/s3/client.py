"""Talking to an S3-compatible store: the client, retries and what an error means.

The boto3 client is made here (its ``s3://bucket/prefix`` locations are parsed in s3path.py),
imported lazily (without it an s3:// path raises CkptError naming ``pip install
boto3``), one per process and settings, shared by threads. Endpoint, region and
credentials come the way every AWS tool takes them (AWS_ENDPOINT_URL, AWS_REGION, AWS_PROFILE,
~/.aws, instance roles) unless Options name them; with no endpoint, botocore resolves AWS's.

Retries are ours, not botocore's (turned off): throttling, 5xx, 409 ConditionalRequestConflict,
timeouts and resets are retried with full-jitter backoff until ``s3_retry_deadline_s``; anything
else is not. Ours because a body cut short while read into the caller's buffer (backend.py)
must be asked for again, the budget is a time (each attempt waits for answers at most what is
left of it: timeouts.py), and once one request to an endpoint gave up the others give up at
once. A request still retrying after RETRY_WARN_S logs a warning. What
retrying cannot fix fails at once, naming the cause and the fix: no credentials, a TLS
handshake that cannot succeed, an endpoint (or the proxy to it) that never answered this
process (retried for UNREACHED_S only). Giving up raises StorageIOError naming the object, attempts and last cause.

Owns: client(), call() (the retry loop), status()/code() of a failure, the markers
that page a listing of open uploads on (next_uploads_page).
Does not own: each attempt's timeout, outages (timeouts.py), the settings (settings.py), the
URLs (s3path.py), what is written or read.
"""

from __future__ import annotations

import http.client
import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ckptio.errors import CkptError, StorageIOError
from ckptio.storage.s3 import timeouts
from ckptio.storage.s3.settings import AWS_DEFAULT, S3Settings

__all__ = ["RETRY_WARN_S", "UNREACHED_S", "call", "client", "code", "connections", "describe",
           "failed", "next_uploads_page", "not_s3", "status"]

log = logging.getLogger("ckptio")
UNREACHED_S = 3.0  # an endpoint that never answered is retried this long (a server starting)
RETRY_WARN_S = 3.0  # a request retrying this long logs a warning
CONNECT_TIMEOUT_S = 5.0  # one attempt's wait for its TCP connection (its answer: timeouts.py)
T = TypeVar("T")
_RETRY_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable",
                "ConditionalRequestConflict", "OperationAborted", "RequestLimitExceeded"}


# (endpoint, region, profile, pid, environment) -> (its connection pool's size, the client)
_clients: dict[tuple[Any, ...], tuple[int, Any]] = {}
_clients_lock = threading.Lock()
_ENVIRONMENT = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_REGION",
                "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")


POOL_FLOOR = 64  # the smallest connection pool a client is made with (see connections())


def connections(settings: S3Settings) -> int:
    """The connection pool a client for ``settings`` needs: every request in flight, and some;
    never under POOL_FLOOR. A pool keeps only the connections it has opened, so a larger cap
    costs nothing, and one client serves a store's requests and its tuned backend's (fewer or
    more in flight) whichever is made first: ``Checkpointer.prepare`` makes the backend first."""
    return max(POOL_FLOOR, max(settings.concurrency, settings.readers) + 8)


def client(settings: S3Settings) -> Any:
    """The process's boto3 S3 client for ``settings``' endpoint, region and profile and the AWS
    environment variables it reads (never shared across a fork). One client serves every
    setting of requests in flight its connection pool holds: a load with an endpoint's tuned
    profile (its backend: other requests in flight than the store's) makes no second client
    (what a second one costs a fresh process's load: docs/BENCH_S3.md)."""
    key = (settings.endpoint_url, settings.region, settings.profile, os.getpid(),
           *(os.environ.get(name) for name in _ENVIRONMENT))
    wanted = connections(settings)
    with _clients_lock:
        made = _clients.get(key)
        if made is None or made[0] < wanted:
            made = _clients[key] = (wanted, _make_client(settings))
        return made[1]


def _make_client(settings: S3Settings) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:
        raise CkptError("s3:// paths need boto3: pip install boto3 (the s3 extra: pip install -e "
                        "'.[s3]' in a checkout) "
                        f"(importing it failed: {exc})") from None
    config = Config(
        request_checksum_calculation="when_required",  # our xxh3 covers every byte at load
        response_checksum_validation="when_required",
        s3={"payload_signing_enabled": False, "addressing_style": "path"
            if settings.configured() else "auto"},
        retries={"mode": "standard", "total_max_attempts": 1},  # call() retries
        max_pool_connections=connections(settings),
        connect_timeout=CONNECT_TIMEOUT_S, read_timeout=timeouts.READ_TIMEOUT_S,
        tcp_keepalive=True,
        parameter_validation=False,  # lets a Body be a staging buffer's memoryview
    )
    configured = settings.configured()
    if configured is not None:  # else botocore resolves AWS's regional endpoint itself
        _check_scheme(configured)
    try:
        session = boto3.session.Session(profile_name=settings.profile,
                                        region_name=_region(settings))
        made = session.client("s3", endpoint_url=settings.endpoint_url, config=config)
    except Exception as exc:  # noqa: BLE001 - botocore's config errors have no common base
        region = _region(settings) or os.environ.get("AWS_DEFAULT_REGION")
        raise StorageIOError(f"cannot make an S3 client for {settings.endpoint()} (profile "
                             f"{settings.profile!r}, region {region!r}): {exc}. Check the "
                             "endpoint, the profile and the AWS_* credential variables (both "
                             "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or neither)") from exc
    timeouts.install(made)
    return made


def _region(settings: S3Settings) -> str | None:
    """The region set in Options or AWS_REGION (what AWS's other SDKs and its compute services
    set; botocore reads only AWS_DEFAULT_REGION and the profile, which None leaves to it)."""
    return settings.region or os.environ.get("AWS_REGION") or None


def _check_scheme(endpoint: str) -> None:
    """An endpoint without http:// or https:// is refused by botocore as merely "invalid"."""
    if "://" not in endpoint:
        raise StorageIOError(f"the S3 endpoint {endpoint!r} has no scheme: write "
                             f"http://{endpoint} (or https://) in AWS_ENDPOINT_URL or the "
                             "endpoint setting")


def status(exc: BaseException) -> int | None:
    """The HTTP status of a botocore ClientError, else None."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return value if isinstance(value, int) else None


def next_uploads_page(page: dict[str, Any], asked: dict[str, str],
                      url: str) -> dict[str, str] | None:
    """The markers that ask for the page after ``page`` of ListMultipartUploads (``asked``: the
    markers it was asked with), None after the last; StorageIOError where a truncated page
    names no next marker or the ones just asked for (asking again would loop for ever)."""
    if not page.get("IsTruncated"):
        return None
    marker = {"KeyMarker": page.get("NextKeyMarker") or "",
              "UploadIdMarker": page.get("NextUploadIdMarker") or ""}
    if not any(marker.values()) or marker == asked:
        raise StorageIOError(f"listing the open uploads under {url}: the store answers a page "
                             "\"truncated\" whose next marker does not advance; an S3 server "
                             "that lists uploads this way cannot hold checkpoints: use another")
    return marker


def code(exc: BaseException) -> str:
    """The S3 error code of a ClientError ("NoSuchKey", "PreconditionFailed", ...), or ""."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    return str(response.get("Error", {}).get("Code", ""))


def _retryable(exc: BaseException) -> bool:
    from botocore.exceptions import BotoCoreError, ClientError

    if isinstance(exc, ClientError):
        answer = status(exc) or 0
        return answer >= 500 or answer == 429 or code(exc) in _RETRY_CODES
    if isinstance(exc, BotoCoreError):  # connection refused/reset, timeouts, short bodies
        return True
    # http.client's own (IncompleteRead, RemoteDisconnected): bodies read from the socket, backend.py
    return isinstance(exc, (ConnectionError, TimeoutError, http.client.HTTPException))


def describe(exc: BaseException) -> str:
    http = status(exc)
    if http is not None:
        message = getattr(exc, "response", {}).get("Error", {}).get("Message", "")
        return f"{http} {code(exc)}" + (f" ({message})" if message else "")
    return f"{type(exc).__name__}: {exc}"


def failed(what: str, exc: BaseException) -> CkptError:
    """``exc`` as the CkptError to raise for ``what`` (a CkptError stays as it is)."""
    if isinstance(exc, CkptError):
        return exc
    if code(exc) == "NoSuchBucket":  # a typo in the bucket's name, or another endpoint's
        return StorageIOError(f"{what} failed: {describe(exc)}: the bucket does not exist: "
                              "create it, or fix the bucket name in the s3:// location or the "
                              "endpoint (AWS_ENDPOINT_URL)")
    if code(exc) == "InvalidBucketName":  # '_' or upper case: only old buckets had them
        return StorageIOError(f"{what} failed: {describe(exc)}: the service refuses the bucket's "
                              "name: fix the bucket name in the s3:// location (lower-case "
                              "letters, digits, '-' and '.')")
    if code(exc) == "KeyTooLongError":  # the prefix leaves no room for a checkpoint's names
        return StorageIOError(f"{what} failed: {describe(exc)}: a key under this location is "
                              "longer than S3 allows (1024 bytes): write a shorter s3:// prefix")
    if status(exc) == 403:  # a wrong secret (SignatureDoesNotMatch) or a missing permission
        return StorageIOError(f"{what} failed: {describe(exc)}: access denied: check the "
                              "credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                              "AWS_PROFILE) and their permissions on this bucket")
    if not_s3(exc):
        return StorageIOError(f"{what} failed: {describe(exc)}, with no S3 error code: the "
                              "endpoint answers HTTP but not as S3; is AWS_ENDPOINT_URL (or the "
                              "endpoint setting) the S3 service's address and port?")
    return StorageIOError(f"{what} failed: {describe(exc)}")


def not_s3(exc: BaseException) -> bool:
    """An error answer with no S3 error code in its body (HEAD answers have no body)."""
    http = status(exc)
    return (http is not None and code(exc) == str(http)
            and not str(getattr(exc, "operation_name", "")).startswith("Head"))


_warned_lock = threading.Lock()
_reached: set[str] = set()  # endpoints that answered this process (a response, even an error)
_warned: dict[str, float] = {}  # endpoint -> when retries to it were last reported


def _unfixable(exc: BaseException, endpoint: str) -> str | None:
    """Why retrying ``exc`` cannot help (the cause and the fix), or None."""
    from botocore.exceptions import (
        CredentialRetrievalError,
        NoCredentialsError,
        PartialCredentialsError,
        SSLError,
    )

    if isinstance(exc, (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError)):
        return (f"no S3 credentials ({describe(exc)}): set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE (~/.aws/credentials), or run where an "
                "instance role provides them")
    if isinstance(exc, SSLError):
        text = str(exc)
        if "WRONG_VERSION_NUMBER" in text or "wrong version number" in text:
            return (f"the TLS handshake with {endpoint} failed ({describe(exc)}): the server "
                    "speaks plain HTTP; write the endpoint as http://, not https://")
        if "CERTIFICATE_VERIFY_FAILED" in text:
            return (f"the TLS certificate of {endpoint} is not trusted ({describe(exc)}): "
                    "point AWS_CA_BUNDLE at the CA file that signed it (a self-signed "
                    "server's own certificate), or use the endpoint's http:// address")
    return None


def _unreached(exc: BaseException) -> bool:
    """A connection that could not be made (refused, no such host, connect timeout; to the
    endpoint, or to the proxy that HTTPS_PROXY / HTTP_PROXY name)."""
    from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError, ProxyConnectionError

    return isinstance(exc, (EndpointConnectionError, ConnectTimeoutError, ProxyConnectionError))


def _answered(endpoint: str, exc: BaseException | None = None) -> None:
    """Record that ``endpoint`` answered (a success, or an error response)."""
    if endpoint not in _reached and (exc is None or status(exc) is not None):
        _reached.add(endpoint)


def _never_reached(endpoint: str, what: str, attempt: int, elapsed: float,
                   exc: BaseException) -> StorageIOError:
    from botocore.exceptions import ProxyConnectionError

    if isinstance(exc, ProxyConnectionError):
        return StorageIOError(
            f"{what} failed: the proxy to {endpoint} does not answer ({describe(exc)}; "
            f"{attempt} attempt(s) in {elapsed:.1f} s): check HTTPS_PROXY / HTTP_PROXY (or "
            "unset them, or list the endpoint's host in NO_PROXY) and that the proxy is running")
    if endpoint == AWS_DEFAULT:  # no endpoint set: AWS's own for the region
        return StorageIOError(
            f"{what} failed: AWS S3 cannot be reached from here ({describe(exc)}; {attempt} "
            f"attempt(s) in {elapsed:.1f} s): check this machine's network, DNS and proxy "
            "(HTTPS_PROXY) and the region (AWS_REGION; the endpoint is AWS's for it); for "
            "another S3-compatible store set its URL in AWS_ENDPOINT_URL (or "
            "S3Settings.endpoint_url / Options.s3_endpoint_url)")
    return StorageIOError(
        f"{what} failed: nothing answers at {endpoint} ({describe(exc)}; {attempt} attempt(s) in "
        f"{elapsed:.1f} s): check the endpoint URL (AWS_ENDPOINT_URL, or "
        "S3Settings.endpoint_url / Options.s3_endpoint_url), its port, and that the server is running")


def _report_retrying(endpoint: str, what: str, exc: BaseException, attempt: int,
                     elapsed: float, deadline: float) -> None:
    """A warning for a request retrying RETRY_WARN_S or more (one per endpoint at a time)."""
    now = time.monotonic()
    with _warned_lock:
        if now - _warned.get(endpoint, -math.inf) < RETRY_WARN_S * 10:
            return
        _warned[endpoint] = now
    log.warning("ckptio: %s: %s; still retrying after %.0f s (attempt %d; gives up after "
                "S3Settings.retry_deadline_s, Options.s3_retry_deadline_s = %.0f s)", what,
                describe(exc), elapsed, attempt, deadline)


def call(settings: S3Settings, what: str, request: Callable[[], T],
         *, sleep: Callable[[float], None] = time.sleep) -> T:
    """``request()`` retried while its failure is transient, until the deadline.

    ``what`` names the operation and object ("uploading part 3 of s3://b/k"). A failure that
    is not transient is raised as it is (the caller maps 404/412); one that retrying cannot
    fix (no credentials, a TLS mismatch, an endpoint that never answered for UNREACHED_S)
    becomes StorageIOError naming the cause at once; one that outlasts the retries becomes
    StorageIOError naming ``what``, the endpoint, the attempts and the cause. Each attempt
    waits for answers at most what is left of the deadline (timeouts.py), so a silent network
    fails the request at its deadline. Once one request to an endpoint has given up, the
    others (in flight, or started during the outage: a failed save's cleanup) give up at their
    next transient failure, and those started in the outage share a short grace; those started
    later, with no success since, are short probes (timeouts.py); a success to the endpoint
    ends the outage."""
    endpoint = settings.endpoint()
    spent = timeouts.Budget(endpoint, settings.retry_deadline_s)
    attempt = 0
    while True:
        try:
            with timeouts.attempt(spent):
                answer = request()
        except Exception as exc:  # noqa: BLE001 - classified below; the rest re-raised
            _answered(endpoint, exc)
            cause = _unfixable(exc, endpoint) if not isinstance(exc, CkptError) else None
            if cause is not None:
                raise StorageIOError(f"{what} failed: {cause}") from exc
            if not _retryable(exc):
                raise
            attempt += 1
            elapsed = spent.elapsed()
            if (_unreached(exc) and endpoint not in _reached
                    and elapsed >= min(UNREACHED_S, settings.retry_deadline_s)):
                raise _never_reached(endpoint, what, attempt, elapsed, exc) from exc
            if spent.over():
                timeouts.ended(spent)
                raise _giving_up(endpoint, what, attempt, elapsed, exc, spent.probe) from exc
            if elapsed >= RETRY_WARN_S:
                _report_retrying(endpoint, what, exc, attempt, elapsed,
                                 settings.retry_deadline_s)
            base = 0.5 if code(exc) == "SlowDown" else 0.1
            pause = random.uniform(0, min(5.0, base * 2 ** attempt))
            pause = min(pause, spent.left())
            if _unreached(exc) and endpoint not in _reached:  # refused once UNREACHED_S is up
                pause = min(pause, max(0.0, UNREACHED_S - elapsed))
            log.info("ckptio: %s: %s; retrying in %.2f s (attempt %d)", what, describe(exc),
                     pause, attempt + 1)
            sleep(pause)
        else:
            _answered(endpoint)
            timeouts.recovered(endpoint)
            return answer


def _giving_up(endpoint: str, what: str, attempt: int, elapsed: float,
               exc: BaseException, probe: bool = False) -> StorageIOError:
    silent = _timed_out(exc)
    why = ("the store at {0} did not answer in time (the network or the store is silent: "
           "a partition, a stuck proxy or load balancer, an overloaded store)" if silent else
           "the store at {0} kept refusing or dropping requests").format(endpoint)
    if probe:
        why += (f", as no request to it has succeeded since an earlier one gave up (so this "
                f"one had {timeouts.PROBE_SHARE:.0%} of the deadline)")
    return StorageIOError(
        f"{what} failed after {attempt} attempt(s) in {elapsed:.0f} s: {describe(exc)}; "
        f"{why}: check that it is up and reachable (raise S3Settings.retry_deadline_s, "
        "or Options.s3_retry_deadline_s, to wait longer)")


def _timed_out(exc: BaseException) -> bool:
    """A connect or read timeout (nothing came back in time)."""
    from botocore.exceptions import ConnectTimeoutError, ReadTimeoutError

    return isinstance(exc, (ConnectTimeoutError, ReadTimeoutError, TimeoutError))
