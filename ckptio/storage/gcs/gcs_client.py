"""Talking to Google Cloud Storage: URLs, the client, retries and what an error means.

``gs://bucket/prefix`` locations are GcsPath (storage/bucket_url.py's form and parsing, with
GCS's bucket names); the google-cloud-storage client is made here, imported lazily (without
it a gs:// path raises CkptError naming the ``[gcs]`` extra), one per process and settings,
shared by threads.

Retries are ours, not the library's (every request is sent with ``retry=None``): 408, 429,
5xx, resets and timeouts are retried with full-jitter backoff until
``GcsSettings.retry_deadline_s``; each attempt waits at most what is left of it, so a silent
network fails the request at its deadline; the outage record (a save's cleanup after a
give-up, short probes while the endpoint stays silent) is S3's, shared (s3/timeouts.py). What
retrying cannot fix fails at once, naming the cause and the fix: missing credentials, an
endpoint (or the proxy to it, or Google's token service) that never answered this process
(retried for UNREACHED_S only). Only the library's own exception types are caught (``errors()``), each
mapped to StorageIOError naming the object and the fix.

Owns: GcsPath (GCS's bucket names), client(), call() (the retry loop), status() of a failure,
failed(), no_bucket().
Does not own: the URL's form and parsing (bucket_url.py), the settings (gcs_settings.py), what
is written or read, the deadline and outage bookkeeping (s3/timeouts.py), the wording of an
endpoint never reached (object_common.py).
"""

from __future__ import annotations

import http.client
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ckptio.errors import CkptError, StorageIOError
from ckptio.storage.bucket_url import BucketUrl, UrlForm
from ckptio.storage.gcs.gcs_settings import GcsSettings
from ckptio.storage.object_common import unreached
from ckptio.storage.s3 import timeouts

__all__ = ["SCHEME", "UNREACHED_S", "GcsPath", "Timeout", "call", "client", "errors", "failed",
           "mapped", "missing", "no_bucket", "status"]

log = logging.getLogger("ckptio")
SCHEME = "gs://"
UNREACHED_S = 3.0  # an endpoint that never answered is retried this long (a server starting)
T = TypeVar("T")
Timeout = tuple[float, float]  # (connect, read) seconds of one attempt
_RETRIED = (408, 429, 500, 502, 503, 504)


@dataclass(frozen=True)
class GcsPath(BucketUrl):
    """``gs://bucket/key``: a location (key = its prefix, no trailing '/') or an object."""

    FORM = UrlForm(SCHEME, r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]", a_url="a gs:// URL",
                   bucket="a GCS bucket name", write="gs://BUCKET/PREFIX",
                   example="gs://my-bucket/run-7/step-100", key="the object prefix")


_clients: dict[tuple[Any, ...], Any] = {}
_clients_lock = threading.Lock()


def client(settings: GcsSettings) -> Any:
    """The process's google-cloud-storage client for ``settings``' endpoint, project and
    credentials (never shared across a fork)."""
    key = (settings.configured(), settings.project, settings.credentials,
           settings.concurrency, os.getpid(), os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"))
    with _clients_lock:
        made = _clients.get(key)
        if made is None:
            made = _clients[key] = _make_client(settings)
        return made


def _make_client(settings: GcsSettings) -> Any:
    try:
        import requests.adapters
        from google.auth.credentials import AnonymousCredentials
        from google.auth.exceptions import GoogleAuthError
        from google.cloud import storage
    except ImportError as exc:
        raise CkptError("gs:// paths need google-cloud-storage: pip install 'ckptio[gcs]' "
                        f"(importing it failed: {exc})") from None
    endpoint = settings.configured()
    options = {"api_endpoint": endpoint} if endpoint else None
    anonymous = settings.credentials == "anonymous"
    try:
        made = storage.Client(project=settings.project or ("ckptio" if anonymous else None),
                              credentials=AnonymousCredentials() if anonymous else None,
                              client_options=options)
    except GoogleAuthError as exc:
        raise StorageIOError(
            f"cannot make a GCS client for {settings.endpoint()}: {exc}. Set up Application "
            "Default Credentials (GOOGLE_APPLICATION_CREDENTIALS, or gcloud auth "
            "application-default login), or use GcsSettings(credentials='anonymous') for an "
            "emulator") from None
    pool = requests.adapters.HTTPAdapter(pool_connections=4,
                                         pool_maxsize=max(settings.concurrency * 2, 16))
    for prefix in ("http://", "https://"):
        made._http.mount(prefix, pool)
    return made


def errors() -> tuple[type[BaseException], ...]:
    """The exception types a request through the library raises (caught, then mapped)."""
    import requests
    from google.api_core.exceptions import GoogleAPIError
    from google.auth.exceptions import GoogleAuthError
    from google.resumable_media.common import DataCorruption, InvalidResponse

    return (GoogleAPIError, GoogleAuthError, InvalidResponse, DataCorruption,
            requests.RequestException, http.client.HTTPException, ConnectionError,
            TimeoutError)


def status(exc: BaseException) -> int | None:
    """The HTTP status of a failure, else None."""
    code = getattr(exc, "code", None)
    if isinstance(code, int):
        return code
    response = getattr(exc, "response", None)
    code = getattr(response, "status_code", None)
    return code if isinstance(code, int) else None


def _describe(exc: BaseException) -> str:
    http = status(exc)
    text = str(getattr(exc, "message", "") or exc).splitlines()[0][:300] if str(exc) else ""
    return f"{http} {text}" if http is not None else f"{type(exc).__name__}: {text}"


def failed(what: str, exc: BaseException, settings: GcsSettings) -> CkptError:
    """``exc`` as the CkptError to raise for ``what`` (a CkptError stays as it is)."""
    if isinstance(exc, CkptError):
        return exc
    http = status(exc)
    if http in (401, 403):
        return StorageIOError(f"{what} failed: {_describe(exc)}: access denied: check the "
                              "credentials (GOOGLE_APPLICATION_CREDENTIALS, gcloud auth) and "
                              "their permissions on this bucket")
    from google.api_core.exceptions import RetryError

    if _retryable(exc) or isinstance(exc, RetryError):
        return StorageIOError(
            f"{what} failed: {_describe(exc)}; the store at {settings.endpoint()} did not answer "
            f"within GcsSettings.retry_deadline_s ({settings.retry_deadline_s:g} s) or kept "
            "refusing: check that it is up and reachable (raise GcsSettings.retry_deadline_s "
            "to wait longer)")
    return StorageIOError(f"{what} failed at {settings.endpoint()}: {_describe(exc)}")


def no_bucket(settings: GcsSettings, bucket: str, location: str) -> StorageIOError:
    """``bucket`` (of ``location``) is not there: a 404 of a bucket's request (a listing, a
    bucket look-up, a write into it)."""
    return StorageIOError(f"bucket {bucket!r} does not exist at {settings.endpoint()} (for "
                          f"{location}): create it, or fix the bucket name or the endpoint "
                          "(GcsSettings.endpoint_url)")


def _retryable(exc: BaseException) -> bool:
    import requests
    from google.auth.exceptions import TransportError

    if status(exc) in _RETRIED:
        return True
    return isinstance(exc, (requests.ConnectionError, requests.Timeout, TransportError,
                            requests.exceptions.ChunkedEncodingError, ConnectionError,
                            TimeoutError, http.client.HTTPException))


def _unreached(exc: BaseException) -> bool:
    """A connection that could not be made (refused, no such host, connect timeout; to the
    endpoint, to the proxy in between, or to Google's token service for the credentials)."""
    import requests
    from google.auth.exceptions import TransportError

    if isinstance(exc, TransportError):  # the credentials' refresh: its cause says which
        cause = exc.__cause__ or exc.__context__
        return cause is not None and _unreached(cause)
    return (isinstance(exc, (requests.ConnectionError, ConnectionRefusedError))
            and not isinstance(exc, requests.ReadTimeout) and status(exc) is None)


_reached: set[str] = set()  # endpoints that answered this process (a response, even an error)


def call(settings: GcsSettings, what: str, request: Callable[[Timeout], T],
         *, sleep: Callable[[float], None] = time.sleep) -> T:
    """``request(timeout)`` retried while its failure is transient, until the deadline.

    ``what`` names the operation and object. A failure that is not transient is raised as it
    is (the caller maps 404/412: ``status``); an endpoint that never answered becomes
    StorageIOError after UNREACHED_S; one that outlasts the deadline becomes StorageIOError
    naming ``what``, the endpoint, the attempts and the cause. The outage record is S3's
    (s3/timeouts.py): once one request to an endpoint gave up, the others give up at their next
    transient failure, and a request after that outage, the endpoint silent since, is a short
    probe until one succeeds."""
    endpoint, deadline = settings.endpoint(), settings.retry_deadline_s
    spent, attempt, caught = timeouts.Budget(endpoint, deadline), 0, errors()
    while True:
        wait = min(settings.read_timeout_s, spent.read_timeout())
        try:
            answer = request((min(settings.connect_timeout_s, wait), wait))
        except caught as exc:
            if status(exc) is not None:
                _reached.add(endpoint)
            if not _retryable(exc):
                raise
            attempt += 1
            elapsed = spent.elapsed()
            if _unreached(exc) and endpoint not in _reached and elapsed >= min(UNREACHED_S,
                                                                               deadline):
                timeouts.ended(spent)
                raise _never_answered(what, settings, f"{_describe(exc)}; {attempt} "
                                      f"attempt(s) in {elapsed:.1f} s") from exc
            if spent.over():
                timeouts.ended(spent)
                raise StorageIOError(
                    f"{what} failed after {attempt} attempt(s) in {elapsed:.0f} s: "
                    f"{_describe(exc)}; the store at {endpoint} did not answer in time or kept "
                    f"refusing{timeouts.probed(spent)}: check that it is up and reachable "
                    "(raise GcsSettings.retry_deadline_s to wait longer)") from exc
            pause = min(random.uniform(0, min(5.0, 0.1 * 2 ** attempt)), spent.left())
            log.info("ckptio: %s: %s; retrying in %.2f s (attempt %d)", what, _describe(exc),
                     pause, attempt + 1)
            sleep(pause)
        else:
            _reached.add(endpoint)
            timeouts.recovered(endpoint)
            return answer


def _never_answered(what: str, settings: GcsSettings, tried: str) -> StorageIOError:
    endpoint = settings.configured() or "https://storage.googleapis.com"
    if settings.configured() is None:
        return unreached(what, endpoint, tried, cloud="Google Cloud Storage", fix=(
            "for an emulator or another server, set STORAGE_EMULATOR_HOST or "
            "GcsSettings.endpoint_url"))
    return unreached(what, endpoint, tried, cloud=None, fix=(
        "check the endpoint (GcsSettings.endpoint_url or STORAGE_EMULATOR_HOST)"))


def mapped(settings: GcsSettings, what: str, request: Callable[[Timeout], T]) -> T:
    """call() with every failure as a CkptError naming ``what``."""
    try:
        return call(settings, what, request)
    except errors() as exc:
        raise failed(what, exc, settings) from exc


def missing(settings: GcsSettings, what: str, request: Callable[[Timeout], T]) -> T | None:
    """call(), None where the answer is 404; every other failure as a CkptError."""
    try:
        return call(settings, what, request)
    except errors() as exc:
        if status(exc) == 404:
            return None
        raise failed(what, exc, settings) from exc
