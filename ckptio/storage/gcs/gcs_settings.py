"""The gs:// scheme's settings: GcsSettings, the one object every GCS module is made with.

Given as ``Options(storage={"gs": GcsSettings(...)})`` (a mapping of its fields works too); the
registry entry in storage/select.py resolves it (settings_for), defaults where none is given.

Owns: GcsSettings and the rules of its values. Does not own: the client, retries or requests
they configure (gcs_client.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ckptio.errors import CkptError
from ckptio.options import MiB, Options

__all__ = ["CREDENTIALS", "GOOGLE_DEFAULT", "GcsSettings"]

GOOGLE_DEFAULT = "Google Cloud Storage (default endpoint)"
CREDENTIALS = ("default", "anonymous")
_CHUNK_UNIT = 256 * 1024  # GCS: a resumable upload's chunks are multiples of this


@dataclass(frozen=True)
class GcsSettings:
    """The gs:// scheme's settings (hashable, picklable).

    ``endpoint_url``: the JSON API's address, e.g. an emulator's ``http://127.0.0.1:9023``;
    None: ``$STORAGE_EMULATOR_HOST`` if set, else Google's. ``project``: the project the client
    bills and lists in (None: the credentials'). ``credentials``: "default" (Application
    Default Credentials: GOOGLE_APPLICATION_CREDENTIALS, gcloud's login, a VM's service
    account) or "anonymous" (none: an emulator, a public bucket). ``concurrency``: uploads and
    ranged reads in flight per backend. ``retry_deadline_s``: how long one request is retried
    (429, 5xx, resets, timeouts) before it fails; ``connect_timeout_s`` and
    ``read_timeout_s``: one attempt's waits (never past the deadline). ``lock_lease_s``: a
    save's lock object is taken over once its holder stopped renewing it this long.
    ``conditional``: "require" (commits and the lock use generation preconditions, and a store
    ignoring them is refused) or "off" (last writer wins: one save per location at a time).
    ``chunk_bytes``: a resumable upload's chunk (a multiple of 256 KiB)."""

    endpoint_url: str | None = None
    project: str | None = None
    credentials: str = "default"
    concurrency: int = 16
    retry_deadline_s: float = 120.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    lock_lease_s: float = 30.0
    conditional: str = "require"
    chunk_bytes: int = 16 * MiB

    def __post_init__(self) -> None:
        if self.credentials not in CREDENTIALS:
            raise CkptError(f"GcsSettings.credentials={self.credentials!r}: use 'default' "
                            "(Application Default Credentials) or 'anonymous' (an emulator)")
        if self.conditional not in ("require", "off"):
            raise CkptError(f"GcsSettings.conditional={self.conditional!r}: use 'require' or "
                            "'off'")
        if self.endpoint_url is not None and "://" not in self.endpoint_url:
            raise CkptError(f"GcsSettings.endpoint_url={self.endpoint_url!r} has no scheme: "
                            f"write http://{self.endpoint_url} (or https://)")
        if self.concurrency < 1:
            raise CkptError(f"GcsSettings.concurrency={self.concurrency}: must be >= 1")
        for name in ("retry_deadline_s", "connect_timeout_s", "read_timeout_s", "lock_lease_s"):
            if not getattr(self, name) > 0:
                raise CkptError(f"GcsSettings.{name}={getattr(self, name)!r}: must be > 0")
        if self.chunk_bytes < _CHUNK_UNIT or self.chunk_bytes % _CHUNK_UNIT:
            raise CkptError(f"GcsSettings.chunk_bytes={self.chunk_bytes}: must be a positive "
                            "multiple of 256 KiB (262144)")

    @classmethod
    def of(cls, options: Options) -> GcsSettings:
        """The gs:// settings of ``options`` (its ``storage["gs"]``), else the defaults."""
        given = options.settings("gs", cls)
        return cls() if given is None else given

    def configured(self) -> str | None:
        """The endpoint set here or by $STORAGE_EMULATOR_HOST; None: Google's."""
        return self.endpoint_url or os.environ.get("STORAGE_EMULATOR_HOST") or None

    def endpoint(self) -> str:
        """For messages and as a key: the endpoint as configured (or Google's)."""
        return self.configured() or GOOGLE_DEFAULT
