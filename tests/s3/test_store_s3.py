"""S3Store and S3Backend against a real SeaweedFS server: the Store conformance suite, the part
geometry, the zero-copy write path, ranged reads pinned to an ETag, and open uploads."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator

import pytest

from ckptio.errors import CkptError, StorageIOError
from ckptio.storage.s3.backend import MAX_PARTS, MIN_PART, S3Backend, part_nbytes_for
from ckptio.storage.s3.s3path import S3Path
from ckptio.storage.s3.settings import S3Settings
from ckptio.io.stage import StagingPool
from ckptio.alignment import BLOCK
from ckptio.options import MiB, Options
from ckptio.storage.s3.store import S3Store
from ckptio.testing.store_conformance import StoreConformance, data_name


def _settings(**changes: object) -> S3Settings:
    return dataclasses.replace(S3Settings.of(Options()), **changes)


class TestS3Store(StoreConformance):
    @pytest.fixture
    def store_factory(self, s3_env):
        return lambda key: S3Store(f"{s3_env}/{key}", _settings())

    @pytest.fixture
    def refuse_removal(self, s3_proxy):
        """Through the proxy, the store answers 403 to deleting ``name`` (and to the batch
        request, which the store then replaces by one DELETE per object)."""

        @contextlib.contextmanager
        def refuse(store: S3Store, name: str) -> Iterator[None]:
            proxied = S3Store(store.location, _settings(endpoint_url=s3_proxy.endpoint))
            s3_proxy.fail(403, "AccessDenied", times=None, method="POST", query={"delete": None})
            s3_proxy.fail(403, "AccessDenied", times=None, method="DELETE", key=re.escape(name))
            store.remove = proxied.remove  # type: ignore[method-assign]
            try:
                yield
            finally:
                s3_proxy.clear()
                del store.remove

        return refuse


def test_part_size_is_the_buffer_while_s3_limits_allow():
    assert part_nbytes_for(100 * MiB, 16 * MiB) == 16 * MiB
    assert part_nbytes_for(3 * MiB, MiB) == 5 * MiB  # parts below 5 MiB are refused by S3
    huge = 16 * MiB * MAX_PARTS + 1
    part = part_nbytes_for(huge, 16 * MiB)
    assert part % (16 * MiB) == 0 and -(-huge // part) <= MAX_PARTS and part >= MIN_PART


def test_urls_parse_and_refuse_bad_ones():
    assert S3Path.parse("s3://b-1/run/step-3/") == S3Path("b-1", "run/step-3")
    assert S3Path.parse("s3://bucket").url == "s3://bucket"
    for bad in ("s3://", "s3://B/x", "s3://b/a//c", "s3://b/../x", "s3:/b/x"):
        with pytest.raises(CkptError):
            S3Path.parse(bad)


def _write(backend: S3Backend, url: str, data: bytes, piece: int) -> None:
    pool = StagingPool(1, max(len(data), BLOCK))
    buffer = pool.acquire()
    buffer.view[:len(data)] = data
    fh = backend.open_write(url, len(data))
    futures = [backend.submit_write(fh, off, buffer.view[off:off + min(piece, len(data) - off)])
               for off in range(0, len(data), piece)]
    for future in futures:
        future.result(timeout=60)
    backend.close(fh, sync=True)
    pool.release(buffer)


def _read(backend: S3Backend, url: str, offset: int, nbytes: int) -> bytes:
    out = bytearray(nbytes)
    fh = backend.open_read(url)
    got = backend.submit_read(fh, offset, memoryview(out)).result(timeout=60)
    backend.close(fh, sync=False)
    return bytes(out[:got])


def test_whole_parts_go_straight_from_the_buffer_and_odd_writes_are_assembled(s3_env, s3_client):
    backend = S3Backend(_settings(), buffer_nbytes=5 * MiB)
    data = bytes(range(256)) * (12 * MiB // 256)
    url = f"{s3_env}/{data_name(0)}"
    _write(backend, url, data, 5 * MiB)  # parts 5 + 5 + 2 MiB: every write a whole part
    assert backend.parts_uploaded_whole == 3
    odd = f"{s3_env}/{data_name(1)}"
    _write(backend, odd, data, 3 * MiB)  # crosses part boundaries: the copy path
    where = S3Path.parse(odd)
    for url_ in (url, odd):
        p = S3Path.parse(url_)
        assert s3_client.get_object(Bucket=p.bucket, Key=p.key)["Body"].read() == data
    assert s3_client.head_object(Bucket=where.bucket, Key=where.key)["ContentLength"] == len(data)
    assert _read(backend, odd, 5 * MiB - 3, 10) == data[5 * MiB - 3:5 * MiB + 7]
    assert _read(backend, odd, len(data) - 4, 100) == data[-4:]  # short at the end
    backend.shutdown()


def test_a_replaced_object_fails_a_read_instead_of_mixing(s3_env, s3_client):
    backend = S3Backend(_settings(), buffer_nbytes=MiB)
    url = f"{s3_env}/{data_name(0)}"
    _write(backend, url, b"a" * BLOCK, BLOCK)
    fh = backend.open_read(url)
    where = S3Path.parse(url)
    s3_client.put_object(Bucket=where.bucket, Key=where.key, Body=b"b" * BLOCK)
    with pytest.raises(StorageIOError, match="412"):
        backend.submit_read(fh, 0, memoryview(bytearray(BLOCK))).result(timeout=60)
    backend.close(fh, sync=False)
    backend.shutdown()


def test_an_abandoned_upload_is_aborted_and_an_existing_object_is_never_overwritten(
        s3_env, s3_client):
    backend = S3Backend(_settings(), buffer_nbytes=5 * MiB)
    url = f"{s3_env}/{data_name(0)}"
    fh = backend.open_write(url, 12 * MiB)
    pool = StagingPool(1, 5 * MiB)
    buffer = pool.acquire()
    backend.submit_write(fh, 0, buffer.view).result(timeout=60)
    where = S3Path.parse(url)
    open_uploads = s3_client.list_multipart_uploads(Bucket=where.bucket, Prefix=where.key)
    assert len(open_uploads.get("Uploads", [])) == 1
    backend.close(fh, sync=False)
    assert not s3_client.list_multipart_uploads(Bucket=where.bucket,
                                                Prefix=where.key).get("Uploads")
    _write(backend, url, b"x" * BLOCK, BLOCK)
    with pytest.raises(StorageIOError, match="exists"):
        backend.open_write(url, BLOCK)
    pool.release(buffer)
    backend.shutdown()


def test_open_uploads_of_a_killed_save_are_listed_and_removed(s3_env, s3_client):
    store = S3Store(f"{s3_env}/ckpt", _settings())
    store.prepare()
    name = data_name(0)
    where = S3Path.parse(store.path_of(name))
    s3_client.create_multipart_upload(Bucket=where.bucket, Key=where.key)
    assert store.names() == [name]
    assert store.remove([name]) == []
    assert store.names() == []
    assert not s3_client.list_multipart_uploads(Bucket=where.bucket,
                                                Prefix=where.key).get("Uploads")


def test_missing_bucket_and_object_location_are_named(s3_env, s3_client):
    missing = S3Store("s3://no-such-bucket-ckptio/x", _settings())
    with pytest.raises(StorageIOError, match="no-such-bucket-ckptio.*does not exist"):
        missing.prepare()
    where = S3Path.parse(f"{s3_env}/a-file")
    s3_client.put_object(Bucket=where.bucket, Key=where.key, Body=b"not a checkpoint")
    with pytest.raises(StorageIOError, match="is an object"):
        S3Store(where.url, _settings()).prepare()


def test_a_tree_is_removed_manifests_first(s3_env):
    """remove_tree deletes every manifest in a batch before any data object (a kill part way
    leaves no committed checkpoint missing its data); before, one batch held both, the
    manifests last."""
    root = S3Store(f"{s3_env}/tree", _settings())
    for step in ("step-1", "step-2"):
        store = root.child(step)
        store.write_file(data_name(), b"data")
        store.commit(b"{}", "save")
    batches: list[list[str]] = []
    delete_many = root.bucket.delete_many
    root.bucket.delete_many = lambda keys: (batches.append(keys), delete_many(keys))[1]  # type: ignore[method-assign]
    assert root.remove_tree() == []
    kinds = [{"manifest" if k.endswith("/manifest.json") else "data" for k in b} for b in batches]
    assert kinds == [{"manifest"}, {"data"}], batches
    assert root.entries() == []
