"""Talking to Azure Blob Storage: az:// URLs, the client, retries and what an error means.

``az://container/prefix`` locations are AzPath (storage/bucket_url.py's form and parsing, with
Azure's container names); the container clients of azure-storage-blob are made here, imported
lazily (without the package an az:// path raises CkptError naming ``pip install
'ckptio[azure]'``), one service client per process and settings, shared by threads.

Retries are ours, not the SDK's (``retry_total=0``), as in storage/s3/client.py and sharing its
deadline and outage record (storage/s3/timeouts.py): throttling, 5xx, timeouts and resets are
retried with full-jitter backoff until ``AzureSettings.retry_deadline_s``; each attempt waits for
an answer at most what is left of it (the SDK's per-request ``read_timeout``), so a silent
network fails at the deadline. An endpoint that never answered this process fails after
UNREACHED_S; a malformed account fails at once. Giving up raises StorageIOError naming the
blob, the endpoint and the fix; an error answer is raised as the SDK's HttpResponseError for
the caller to read (404, 409, 412) or map with failed().

Owns: AzPath (Azure's container names), container(), call(), status()/code()/failed(). Does
not own: the URL's form and parsing (bucket_url.py), the deadline and outage bookkeeping
(s3/timeouts.py), the settings (az_settings.py), what is written or read, the wording of an
endpoint never reached (object_common.py).
"""

from __future__ import annotations

import random
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ckptio.errors import CkptError, StorageIOError
from ckptio.options import MiB
from ckptio.storage.bucket_url import BucketUrl, UrlForm
from ckptio.storage.azure.az_settings import CONNECTION_ENV, AzureSettings
from ckptio.storage.object_common import unreached
from ckptio.storage.s3 import timeouts

__all__ = ["CONNECT_S", "SCHEME", "UNREACHED_S", "AzPath", "Timeouts", "call", "checked", "code",
           "container", "describe", "failed", "sdk_error", "status"]

SCHEME = "az://"
UNREACHED_S = 3.0  # an endpoint that never answered is retried this long (a server starting)
CONNECT_S = 5.0  # one attempt's wait for its TCP connection
SINGLE_BYTES = 256 * MiB  # one GET or PUT at most (no chunking by the SDK below this)
T = TypeVar("T")
Timeouts = dict[str, Any]  # the per-request keyword arguments of one attempt (seconds)
_RETRY_STATUS = {408, 429, 500, 502, 503, 504}
_clients: dict[tuple[AzureSettings, str | None], Any] = {}
_clients_lock = threading.Lock()
_reached: set[str] = set()  # endpoints that answered this process


@dataclass(frozen=True, repr=False)
class AzPath(BucketUrl):
    """``az://container/name``: a location (name = its prefix, no trailing '/') or a blob."""

    FORM = UrlForm(SCHEME, r"[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62}", a_url="an az:// URL",
                   bucket="an Azure container name (3-63 lower-case letters, digits and single "
                   "hyphens)", write="az://CONTAINER/PREFIX", example="az://checkpoints/run-7",
                   key="the prefix")

    @property
    def container(self) -> str:
        """The container (BucketUrl's bucket)."""
        return self.bucket

    @property
    def name(self) -> str:
        """The blob name (BucketUrl's key)."""
        return self.key

    def __repr__(self) -> str:
        return f"AzPath(container={self.container!r}, name={self.name!r})"


def container(settings: AzureSettings, name: str) -> Any:
    """The ContainerClient of ``name`` through this process's client for ``settings``."""
    key = (settings, settings.connection())  # the environment's account may change
    with _clients_lock:
        service = _clients.get(key)
        if service is None:
            service = _clients[key] = _make_service(settings)
    return service.get_container_client(name)


def _make_service(settings: AzureSettings) -> Any:
    try:
        from azure.storage.blob import BlobServiceClient
    except ImportError:
        raise CkptError("az:// locations need azure-storage-blob: pip install 'ckptio[azure]'"
                        ) from None
    config: dict[str, Any] = {
        "retry_total": 0, "connection_timeout": CONNECT_S, "max_single_get_size": SINGLE_BYTES,
        "max_chunk_get_size": SINGLE_BYTES, "max_single_put_size": SINGLE_BYTES,
        "max_block_size": SINGLE_BYTES}
    try:
        if settings.account_url:
            return BlobServiceClient(settings.account_url, credential=_credential(), **config)
        connection = settings.connection()
        if connection is None:
            raise CkptError(f"az:// locations need an Azure storage account: set {CONNECTION_ENV} "
                            "or give Options(storage={'az': AzureSettings(connection_string=...)}) "
                            "(or account_url=...)")
        return BlobServiceClient.from_connection_string(connection, **config)
    except ValueError as exc:  # a malformed connection string or URL
        raise CkptError(f"the Azure account in the settings is malformed ({exc}): fix the "
                        f"connection string ({CONNECTION_ENV}) or AzureSettings.account_url"
                        ) from None


def _credential() -> Any:
    """azure-identity's DefaultAzureCredential where installed; else None (a SAS in the URL)."""
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError:
        return None
    return DefaultAzureCredential()


def sdk_error() -> type[Exception]:
    """The base class of the SDK's exceptions (what the callers of call() catch)."""
    from azure.core.exceptions import AzureError

    return AzureError


def checked(settings: AzureSettings, what: str, request: Callable[[Timeouts], T], *,
            none_on: tuple[int, ...] = ()) -> T | None:
    """call(), with an error answer whose status is in ``none_on`` as None and every other
    failure as the CkptError failed() makes of it."""
    try:
        return call(settings, what, request)
    except sdk_error() as exc:
        if status(exc) in none_on:
            return None
        raise failed(what, exc) from exc


def status(exc: BaseException) -> int | None:
    """The HTTP status of an error answer; None for no answer (or not the SDK's)."""
    value = getattr(exc, "status_code", None)
    return value if isinstance(value, int) else None


def code(exc: BaseException) -> str:
    """The Azure error code of an error answer ("" for none)."""
    return str(getattr(exc, "error_code", "") or "")


def failed(what: str, exc: BaseException) -> CkptError:
    """``exc`` as the CkptError to raise for ``what`` (a CkptError stays as it is)."""
    if isinstance(exc, CkptError):
        return exc
    if code(exc) == "ContainerNotFound":
        return StorageIOError(f"{what} failed: the container does not exist: create it (az "
                              "storage container create), or fix the container name in the "
                              "az:// location or the account")
    if status(exc) == 403:
        return StorageIOError(f"{what} failed: access denied ({code(exc)}): check the account "
                              f"key or SAS in {CONNECTION_ENV} (or the settings) and its "
                              "permissions on this container")
    return StorageIOError(f"{what} failed: {describe(exc)}")


def describe(exc: BaseException) -> str:
    http = status(exc)
    if http is not None:
        return f"{http} {code(exc)}".rstrip()
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _retryable(exc: BaseException) -> bool:
    from azure.core.exceptions import HttpResponseError, ServiceRequestError, ServiceResponseError

    if isinstance(exc, (ServiceRequestError, ServiceResponseError)):
        return True
    return isinstance(exc, HttpResponseError) and (status(exc) is None
                                                   or status(exc) in _RETRY_STATUS)


def _never_answered(what: str, endpoint: str, tried: str) -> StorageIOError:
    """An endpoint that never answered: a host named in DNS (Azure's own, an account's) is a
    cloud endpoint (this machine's network, or a misspelt account: its host does not
    resolve); a loopback or IP one is a server of the user's (an emulator)."""
    host = urllib.parse.urlsplit(endpoint).hostname or ""
    local = host == "localhost" or host.replace(".", "").isdigit() or ":" in host
    if local:
        return unreached(what, endpoint, tried, cloud=None, fix=(
            f"check the blob endpoint in {CONNECTION_ENV} (or AzureSettings)"))
    return unreached(what, endpoint, tried, cloud=f"Azure Blob Storage at {endpoint}", fix=(
        "check the account name in the connection string or AzureSettings.account_url (a "
        f"misspelt account's host does not resolve), and the endpoint in {CONNECTION_ENV}"))


def call(settings: AzureSettings, what: str, request: Callable[[Timeouts], T],
         *, sleep: Callable[[float], None] = time.sleep) -> T:
    """``request(timeouts)`` retried while its failure is transient, until the deadline;
    ``timeouts`` are the SDK keyword arguments of the attempt (pass them to the SDK call).

    An error answer that retrying cannot fix is raised as the SDK's exception (the caller maps
    404, 409, 412); giving up, or an endpoint that never answered for UNREACHED_S, becomes
    StorageIOError naming ``what``, the endpoint and the fix. Once one request to the endpoint
    gave up, the others give up at their next transient failure (s3/timeouts.py)."""
    from azure.core.exceptions import AzureError, ServiceRequestError

    endpoint = settings.endpoint()
    spent = timeouts.Budget(endpoint, settings.retry_deadline_s)
    attempt = 0
    while True:
        try:
            answer = request({"connection_timeout": CONNECT_S,
                              "read_timeout": spent.read_timeout()})
        except AzureError as exc:
            if status(exc) is not None:
                _reached.add(endpoint)
            if not _retryable(exc):
                raise
            attempt += 1
            elapsed = spent.elapsed()
            if (isinstance(exc, ServiceRequestError) and endpoint not in _reached
                    and elapsed >= min(UNREACHED_S, settings.retry_deadline_s)):
                timeouts.ended(spent)
                raise _never_answered(what, endpoint, f"{describe(exc)}; {attempt} attempt(s) "
                                      f"in {elapsed:.1f} s") from exc
            if spent.over():
                timeouts.ended(spent)
                raise StorageIOError(
                    f"{what} failed after {attempt} attempt(s) in {elapsed:.0f} s: "
                    f"{describe(exc)}; the service at {endpoint} did not answer in time or kept "
                    f"refusing{timeouts.probed(spent)}: check that it is up and reachable (raise "
                    "AzureSettings.retry_deadline_s to wait longer)") from exc
            sleep(min(random.uniform(0, min(5.0, 0.1 * 2 ** attempt)), spent.left()))
        else:
            _reached.add(endpoint)
            timeouts.recovered(endpoint)
            return answer
