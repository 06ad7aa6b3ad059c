"""The s3:// scheme's settings: S3Settings, the one object every S3 module is made with.

Given as ``Options(storage={"s3": S3Settings(...)})`` (the primary spelling; the registry entry
in storage/select.py resolves it, settings_for), or built by S3Settings.of from Options' older
``s3_*`` fields and their CKPTIO_S3_* variables. The rules of its values are options.check_s3's,
shared with those fields.

Owns: S3Settings (endpoint, region, profile, requests in flight, ranged-GET size, retry
deadline, lock lease, conditional writes), gets_in_flight (the GETs a load keeps in flight).
Does not own: the client, retries or requests they configure (client.py, timeouts.py).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from ckptio.options import Options, check_s3

__all__ = ["AWS_DEFAULT", "S3Settings", "gets_in_flight"]

AWS_DEFAULT = "AWS S3 (default endpoint)"  # the endpoint's name where none is configured


def gets_in_flight(io_depth: int) -> int:
    """Ranged GETs a load keeps in flight at ``io_depth``: its read-ahead of 2 x io_depth reads
    (loading/read.py), each one GET."""
    return 2 * io_depth


@dataclass(frozen=True)
class S3Settings:
    """The s3:// scheme's settings: what makes a client and its retry policy (hashable,
    picklable). Given as ``Options(storage={"s3": S3Settings(...)})``, or built from Options'
    ``s3_*`` fields (their docs say what each does); ``read_concurrency`` is set from
    Options.io_depth (gets_in_flight)."""

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    concurrency: int = 16
    retry_deadline_s: float = 120.0
    lock_lease_s: float = 30.0
    conditional: str = "require"
    read_concurrency: int = 0  # ranged GETs in flight at most; 0: concurrency
    read_bytes: int = 0  # bytes of one ranged GET at most (a larger read is several); 0: any

    def __post_init__(self) -> None:
        check_s3("S3Settings.", dataclasses.asdict(self))

    @classmethod
    def of(cls, options: Options) -> S3Settings:
        """The s3:// settings of ``options``: its ``storage["s3"]``, else its ``s3_<field>``
        for each field (the older spelling); with as many GETs as a load keeps reads in flight
        (gets_in_flight of Options.io_depth)."""
        given = options.settings("s3", cls)
        if given is None:
            given = cls(**{f.name: getattr(options, f"s3_{f.name}")
                           for f in dataclasses.fields(cls) if f.name != "read_concurrency"})
        return dataclasses.replace(given, read_concurrency=gets_in_flight(options.io_depth))

    @property
    def readers(self) -> int:
        """Ranged GETs in flight at most."""
        return self.read_concurrency or self.concurrency

    def configured(self) -> str | None:
        """The endpoint URL set in Options or the environment; None: AWS's own for the region."""
        return (self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL"))

    def endpoint(self) -> str:
        """For messages and as a key: the endpoint as configured (or AWS's default)."""
        return self.configured() or AWS_DEFAULT
