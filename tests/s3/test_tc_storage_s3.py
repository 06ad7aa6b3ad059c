"""ckptio's storage under torch_checkpointing's API (ckptio/tc_storage.py) against the local
SeaweedFS server: tests/test_tc_storage.py's checks with the root on S3 (its own storage test,
its rename table: a directory's commit copies each object server-side then removes the source;
its CheckpointManager sync and async, whose background process reaches the server through the
same environment, bitwise), and a wrong endpoint failing within seconds, named."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("torch_checkpointing", reason="the [torch-checkpointing] extra")

from ckptio.errors import CkptError  # noqa: E402
from ckptio.tc_storage import CkptioStorage  # noqa: E402
from tests.test_tc_storage import (  # noqa: E402,F401  (collected here with the root on S3)
    test_the_rename_table,
    test_their_manager_saves_and_loads_through_it_bitwise,
    test_their_storage_test_passes,
)


@pytest.fixture
def root(s3_env: str) -> str:
    return s3_env


def test_a_wrong_endpoint_fails_fast_naming_it(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    started = time.monotonic()
    with pytest.raises(CkptError, match="127.0.0.1:9"):
        CkptioStorage(s3_env).write(Path("/run/x.bin"), b"x")
    assert time.monotonic() - started < 30
