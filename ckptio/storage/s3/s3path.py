"""``s3://`` locations: S3Path, a bucket and a key parsed from an ``s3://bucket/prefix`` URL.

Call order: every part of the S3 scheme (store.py, root.py, backend.py, lock.py) and the
drivers that tell an S3 location from others (is_s3) parse a URL here first, before any client
is made: a location that cannot name an S3 object (no bucket, a bucket name S3 refuses, an
empty, '.' or '..' part in the key) is refused at once, with the form to write.

Owns: the URL's form, its parsing, a location's child and listing prefix. Does not own: the
client and its requests (client.py), where a checkpoint's files go under the prefix (store.py,
root.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckptio.errors import CkptError

__all__ = ["SCHEME", "S3Path", "is_s3"]

SCHEME = "s3://"
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-_]{1,254}")


def is_s3(path: str) -> bool:
    return path.startswith(SCHEME)


@dataclass(frozen=True)
class S3Path:
    """``s3://bucket/key``: a location (key = its prefix, no trailing '/') or an object."""

    bucket: str
    key: str

    @classmethod
    def parse(cls, url: str) -> S3Path:
        if not is_s3(url):
            raise CkptError(f"{url!r} is not an s3:// URL")
        bucket, _, key = url[len(SCHEME):].partition("/")
        if not _BUCKET.fullmatch(bucket):
            raise CkptError(f"{url}: {bucket!r} is not an S3 bucket name; write "
                            "s3://BUCKET/PREFIX, e.g. s3://my-bucket/run-7/step-100")
        key = key.rstrip("/")
        if "//" in key or any(part in (".", "..") for part in key.split("/")):
            raise CkptError(f"{url}: the key prefix {key!r} has an empty, '.' or '..' part; "
                            "write s3://BUCKET/PREFIX with plain parts")
        return cls(bucket, key)

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}" if self.key else f"{SCHEME}{self.bucket}"

    def child(self, name: str) -> S3Path:
        return S3Path(self.bucket, f"{self.key}/{name}" if self.key else name)

    @property
    def dir_prefix(self) -> str:
        """The prefix that lists what is inside this location ("" for a whole bucket)."""
        return f"{self.key}/" if self.key else ""
