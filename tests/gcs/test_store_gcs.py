"""GcsStore against a real GCS server (the gcp-storage-emulator): the Store conformance suite,
ranged reads, the data path's write order, URLs, and a missing bucket named."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pytest

from ckptio.alignment import BLOCK
from ckptio.errors import CheckpointLockedError, CkptError, StorageIOError
from ckptio.io.stage import StagingPool
from ckptio.options import MiB
from ckptio.storage.gcs.gcs_backend import GcsBackend
from ckptio.storage.gcs.gcs_client import GcsPath
from ckptio.storage.gcs.gcs_store import GcsStore
from ckptio.storage.select import store_for
from ckptio.testing.store_conformance import StoreConformance, data_name

from gcs.conftest import settings_at


class TestGcsStore(StoreConformance):
    @pytest.fixture
    def store_factory(self, gcs_url, gcs_settings):
        return lambda key: GcsStore(f"{gcs_url}/{key}", gcs_settings)

    @pytest.fixture
    def refuse_removal(self, gcs_proxy):
        """Through the proxy, the server answers 403 to deleting ``name``."""

        @contextlib.contextmanager
        def refuse(store: GcsStore, name: str) -> Iterator[None]:
            proxied = GcsStore(store.location, settings_at(gcs_proxy.endpoint))
            gcs_proxy.fail(403, "AccessDenied", times=None, method="DELETE", key=re.escape(name))
            store.remove = proxied.remove  # type: ignore[method-assign]
            try:
                yield
            finally:
                gcs_proxy.clear()
                del store.remove

        return refuse


def test_the_registry_serves_gs_urls(gcs_url, gcs_options):
    store = store_for(f"{gcs_url}/ckpt", gcs_options)
    assert isinstance(store, GcsStore) and store.location == f"{gcs_url}/ckpt"
    assert store.capabilities.remote and store.capabilities.locking


def test_urls_parse_and_refuse_bad_ones():
    assert GcsPath.parse("gs://b-1/run/step-3/") == GcsPath("b-1", "run/step-3")
    assert GcsPath.parse("gs://bucket").url == "gs://bucket"
    for bad in ("gs://", "gs://B/x", "gs://b/a//c", "gs://b/../x", "gs:/b/x"):
        with pytest.raises(CkptError):
            GcsPath.parse(bad)


def test_writes_out_of_order_and_gaps_make_the_object_whole(gcs_url, gcs_settings):
    """Writes arrive out of order (later pieces first) and one piece never comes: the object is
    the bytes written, zeros in the gap, visible only once closed; ranged reads return them."""
    backend = GcsBackend(gcs_settings)
    data = bytes(range(256)) * (3 * MiB // 256)
    name = data_name(0)
    url = f"{gcs_url}/{name}"
    pool = StagingPool(1, 3 * MiB)
    buffer = pool.acquire()
    buffer.view[:len(data)] = data
    fh = backend.open_write(url, len(data))
    piece = MiB
    for off in (2 * piece, 0):  # the middle piece is never written
        backend.submit_write(fh, off, buffer.view[off:off + piece]).result(timeout=60)
    store = GcsStore(gcs_url, gcs_settings)
    assert store.sizes([name]) == {}, "an object appeared before its upload closed"
    backend.close(fh, sync=True)
    expected = data[:piece] + bytes(piece) + data[2 * piece:]
    assert store.read_file(name) == expected
    out = bytearray(10)
    fh = backend.open_read(url)
    assert backend.submit_read(fh, piece - 3, memoryview(out)).result(timeout=60) == 10
    assert bytes(out) == expected[piece - 3:piece + 7]
    tail = bytearray(100)
    assert backend.submit_read(fh, len(data) - 4, memoryview(tail)).result(timeout=60) == 4
    backend.close(fh, sync=False)
    with pytest.raises(StorageIOError, match="exists"):
        backend.open_write(url, BLOCK)
    pool.release(buffer)
    backend.shutdown()


def test_an_abandoned_upload_leaves_no_object(gcs_url, gcs_settings):
    backend = GcsBackend(gcs_settings)
    fh = backend.open_write(f"{gcs_url}/{data_name(0)}", 2 * BLOCK)
    backend.submit_write(fh, 0, memoryview(b"x" * BLOCK)).result(timeout=60)
    backend.close(fh, sync=False)
    assert GcsStore(gcs_url, gcs_settings).names() == []
    backend.shutdown()


def test_missing_bucket_and_object_location_are_named(gcs_url, gcs_settings):
    with pytest.raises(StorageIOError, match="no-such-bucket-ckptio.*does not exist"):
        GcsStore("gs://no-such-bucket-ckptio/x", gcs_settings).prepare()
    GcsStore(gcs_url, gcs_settings).write_file("a-file", b"not a checkpoint")
    with pytest.raises(StorageIOError, match="is an object"):
        GcsStore(f"{gcs_url}/a-file", gcs_settings).prepare()


def test_a_store_ignoring_preconditions_is_refused_unless_conditional_off(gcs_url, gcs_server):
    """The emulator ignores ifGenerationMatch: the default settings refuse it, naming the
    setting that allows it; conditional='off' takes it."""
    strict = GcsStore(gcs_url, settings_at(gcs_server.endpoint, conditional="require"))
    with pytest.raises(StorageIOError, match="conditional='off'"):
        strict.prepare()
    GcsStore(gcs_url, settings_at(gcs_server.endpoint)).prepare()


def test_a_commit_refused_by_its_precondition_raises_locked_and_keeps_theirs(gcs_url, gcs_server,
                                                                             gcs_proxy):
    """With conditional='require' against a store honouring generation preconditions (the
    emulator ignores them, so the proxy answers 412 where GCS would): the probe passes, and a
    commit whose ifGenerationMatch fails (another save committed since the claim) raises
    CheckpointLockedError naming the location; the other save's manifest is kept."""
    probe = {"ifGenerationMatch": "0"}
    gcs_proxy.on_request(lambda req: gcs_proxy.fail(412, "conditionNotMet", query=probe),
                         query=probe)  # the probe's second create is refused, as GCS would
    store = GcsStore(f"{gcs_url}/c", settings_at(gcs_proxy.endpoint, conditional="require"))
    assert store.capabilities.conditional_commit
    claim = store.exclusive("raise")
    try:
        theirs = b'{"theirs": 1}'
        GcsStore(store.location, settings_at(gcs_server.endpoint)).commit(theirs, "x")
        gcs_proxy.fail(412, "conditionNotMet", method="POST", query=probe)
        with pytest.raises(CheckpointLockedError, match=re.escape(store.location)):
            store.commit(b'{"mine": 1}', "y", claim)
        assert store.read_manifest() == theirs
    finally:
        claim.release()
