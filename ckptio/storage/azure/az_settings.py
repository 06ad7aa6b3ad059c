"""The az:// scheme's settings: AzureSettings, the one object every Azure module is made with.

Given as ``Options(storage={"az": AzureSettings(...)})``; without it the defaults, whose
account comes from ``$AZURE_STORAGE_CONNECTION_STRING`` (the variable the Azure CLI and SDKs
read). A connection string names the account, its key or SAS and its blob endpoint (Azurite's
too); ``account_url`` (``https://<account>.blob.core.windows.net``, a SAS token in its query if
any) is the other way, with azure-identity's DefaultAzureCredential where that is installed.

Owns: AzureSettings and the rules of its values. Does not own: the client they make
(az_client.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ckptio.errors import CkptError

__all__ = ["CONNECTION_ENV", "AzureSettings"]

CONNECTION_ENV = "AZURE_STORAGE_CONNECTION_STRING"
LEASE_RANGE = (15, 60)  # what Azure allows a finite blob lease, in seconds


@dataclass(frozen=True)
class AzureSettings:
    """The az:// scheme's settings (hashable: one client per distinct settings).

    ``connection_string``: the account (else ``$AZURE_STORAGE_CONNECTION_STRING``);
    ``account_url``: the blob endpoint instead, with a SAS token or azure-identity;
    ``retry_deadline_s``: how long one request is retried (each attempt waits at most what is
    left of it); ``concurrency``: blocks staged or ranges read at once; ``lock_lease_s``: the
    lease of a save's lock blob (renewed while the save runs; a dead save's lapses)."""

    connection_string: str | None = None
    account_url: str | None = None
    retry_deadline_s: float = 120.0
    concurrency: int = 8
    lock_lease_s: int = 30

    def __post_init__(self) -> None:
        if not isinstance(self.retry_deadline_s, (int, float)) or self.retry_deadline_s <= 0:
            raise CkptError(f"AzureSettings.retry_deadline_s={self.retry_deadline_s!r}: give "
                            "a positive number of seconds")
        if not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise CkptError(f"AzureSettings.concurrency={self.concurrency!r}: give an int >= 1")
        low, high = LEASE_RANGE
        if not isinstance(self.lock_lease_s, int) or not low <= self.lock_lease_s <= high:
            raise CkptError(f"AzureSettings.lock_lease_s={self.lock_lease_s!r}: Azure leases "
                            f"last {low} to {high} s; give an int in that range")

    def connection(self) -> str | None:
        """The connection string in use: the settings', else the environment's."""
        return self.connection_string or os.environ.get(CONNECTION_ENV) or None

    def endpoint(self) -> str:
        """The blob endpoint, for messages and as a key (no secret in it)."""
        if self.account_url:
            return self.account_url.split("?", 1)[0].rstrip("/")
        parts = _fields(self.connection() or "")
        if "BlobEndpoint" in parts:
            return parts["BlobEndpoint"].rstrip("/")
        if "AccountName" in parts:
            protocol = parts.get("DefaultEndpointsProtocol", "https")
            suffix = parts.get("EndpointSuffix", "core.windows.net")
            return f"{protocol}://{parts['AccountName']}.blob.{suffix}"
        return "(no Azure account configured)"


def _fields(connection: str) -> dict[str, str]:
    """The ``Key=Value`` fields of a connection string."""
    pairs = (part.split("=", 1) for part in connection.split(";") if "=" in part)
    return {key.strip(): value.strip() for key, value in pairs}
