"""``s3://`` locations: S3Path, a bucket and a key parsed from an ``s3://bucket/prefix`` URL.

Call order: every part of the S3 scheme (store.py, root.py, backend.py, lock.py) and the
drivers that tell an S3 location from others (is_s3) parse a URL here first, before any client
is made: a location that cannot name an S3 object (no bucket, a bucket name S3 refuses, an
empty, '.' or '..' part in the key) is refused at once, with the form to write.

Owns: the bucket names S3 accepts and the words naming them. Does not own: the URL's form, its
parsing, child and listing prefix (storage/bucket_url.py, shared with gs:// and az://), the
client and its requests (client.py), where a checkpoint's files go under the prefix (store.py,
root.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptio.storage.bucket_url import BucketUrl, UrlForm

__all__ = ["SCHEME", "S3Path", "is_s3"]

SCHEME = "s3://"


def is_s3(path: str) -> bool:
    return path.startswith(SCHEME)


@dataclass(frozen=True)
class S3Path(BucketUrl):
    """``s3://bucket/key``: a location (key = its prefix, no trailing '/') or an object."""

    FORM = UrlForm(SCHEME, r"[a-z0-9][a-z0-9.\-_]{1,254}", a_url="an s3:// URL",
                   bucket="an S3 bucket name", write="s3://BUCKET/PREFIX",
                   example="s3://my-bucket/run-7/step-100", key="the key prefix")
