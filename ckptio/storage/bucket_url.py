"""Object-store locations: BucketUrl, a bucket and a key parsed from a ``scheme://bucket/prefix``
URL, the one form that s3:// (s3/s3path.py), gs:// (gcs/gcs_client.py) and az://
(azure/az_client.py) share.

Call order: each scheme's URL class subclasses BucketUrl, naming in a UrlForm its scheme, the
bucket names its service accepts and the words of its messages; its store, root, backend and
lock parse a URL with ``parse`` before any client is made: a location that cannot name an object (no bucket,
a bucket name the service refuses, an empty, '.' or '..' part or a control character in the
key) is refused at once, with the form to write.

Owns: the URL's form, its parsing, a location's child and listing prefix (object_tree.Place).
Does not own: which bucket names a service accepts and the words naming them (each scheme's
subclass), the client and its requests (each scheme's client).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from ckptio.errors import CkptError

__all__ = ["BucketUrl", "UrlForm"]

U = TypeVar("U", bound="BucketUrl")
# No key holds one as meant (a run name read from a file unstripped: "run-7\n"); GCS refuses CR
# and LF, S3 answers a NUL with a bare 400, Azurite others with server errors retried as an
# outage.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _lower_case(url: str, scheme: str) -> str:
    """The fix for a URL whose scheme is spelled in capitals ("S3://"), or ""."""
    if not url.lower().startswith(scheme):
        return ""
    return f"; write the scheme in lower case: {scheme}{url[len(scheme):]}"


@dataclass(frozen=True)
class UrlForm:
    """One scheme's URL rules and the words of its messages."""

    scheme: str  # "s3://"
    bucket_pattern: str  # what a bucket name must match, whole
    a_url: str  # "an s3:// URL"
    bucket: str  # "an S3 bucket name"
    write: str  # the form to write: "s3://BUCKET/PREFIX"
    example: str  # a URL of that form
    key: str  # what the key is called: "the key prefix"


@dataclass(frozen=True)
class BucketUrl:
    """``scheme://bucket/key``: a location (key = its prefix, no trailing '/') or an object.
    A subclass names its scheme's rules and words in FORM."""

    FORM: ClassVar[UrlForm]

    bucket: str
    key: str

    @classmethod
    def parse(cls: type[U], url: str) -> U:
        form = cls.FORM
        if not url.startswith(form.scheme):
            raise CkptError(f"{url!r} is not {form.a_url}{_lower_case(url, form.scheme)}")
        bucket, _, key = url[len(form.scheme):].partition("/")
        if not re.fullmatch(form.bucket_pattern, bucket):
            raise CkptError(f"{url}: {bucket!r} is not {form.bucket}; write {form.write}, "
                            f"e.g. {form.example}")
        key = key.rstrip("/")
        if _CONTROL.search(key):
            raise CkptError(f"{url!r}: {form.key} {key!r} has a control character; write "
                            f"{form.write} with printable parts")
        if "//" in key or any(part in (".", "..") for part in key.split("/")):
            raise CkptError(f"{url}: {form.key} {key!r} has an empty, '.' or '..' part; "
                            f"write {form.write} with plain parts")
        return cls(bucket, key)

    @property
    def url(self) -> str:
        scheme = self.FORM.scheme
        return f"{scheme}{self.bucket}/{self.key}" if self.key else scheme + self.bucket

    def child(self: U, name: str) -> U:
        return dataclasses.replace(self, key=f"{self.key}/{name}" if self.key else name)

    @property
    def dir_prefix(self) -> str:
        """The prefix that lists what is inside this location ("" for a whole bucket)."""
        return f"{self.key}/" if self.key else ""
