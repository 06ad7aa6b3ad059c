"""Whether a ``weed mini`` in a network namespace is ready, asked from inside that namespace.

A server in a namespace (multihost.py's hosts) is reachable only from inside it, so
s3server.py runs this file as a script there (``ip netns exec``), one process per look, with
the S3 endpoint, the bucket, the master's URL and the volume server's address. Ready is what
s3server.py waits for outside a namespace too: a signed HeadBucket of the bucket answers (a
first start's missing bucket is created, and the look says not yet) and the master lists the
volume server.

Call order: SeaweedServer's wait in a namespace -> this script, until it succeeds or the wait
ends.

Owns: that look. Does not own: the server, its ports and keys, and how long to wait
(s3server.py). Test support: boto3 is imported only inside ``probe``.
"""

from __future__ import annotations

import json
import sys
import urllib.request

__all__ = ["probe"]


def probe(endpoint: str, bucket: str, master: str, volume: str) -> bool:
    """Whether the bucket answers and the master lists ``volume`` (the bucket is created,
    and False returned, where it does not exist yet). Credentials come from the environment."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ClientError

    c = boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, connect_timeout=1, read_timeout=5,
                      retries={"total_max_attempts": 1}))
    try:
        c.head_bucket(Bucket=bucket)
    except ClientError:
        c.create_bucket(Bucket=bucket)
        return False
    status = json.load(urllib.request.urlopen(master + "/dir/status", timeout=2))
    return any(n.get("Url") == volume for dc in status["Topology"].get("DataCenters") or []
               for r in dc.get("Racks") or [] for n in r.get("DataNodes") or [])


if __name__ == "__main__":
    sys.exit(0 if probe(*sys.argv[1:5]) else 1)
