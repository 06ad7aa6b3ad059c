"""loading/read.py: one read path for every load. A same-layout load (whole entries) and a
resharded one (regions, parts of entries) are planned as spans by the same function and read by
the same read-ahead loop; whole entries come in full-buffer coalesced reads checked by their
whole checksum, parts in reads widened to checksum blocks; no byte is read twice. Also the
coalescing rule the loop relies on (layout.coalesce_reads with ``in_one_read``)."""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
from itertools import pairwise

import pytest
import torch

import ckptio
from ckptio.errors import CorruptCheckpointError
from ckptio.format import manifest
from ckptio.format.types import Chunk, Read, TensorEntry
from ckptio.io import posix
from ckptio.loading import read as read_module
from ckptio.loading.span_plan import plan_spans
from ckptio.alignment import BLOCK, align_up
from ckptio.planning.layout import coalesce_reads
from ckptio.storage.local.local_store import LocalStore
from ckptio.testing.faults import inject

MiB, KiB = 1 << 20, 1 << 10
IO_THREADS = ("ckptio-io", "ckptio-uring")  # the POSIX backend's pool, io_uring's reaper


@pytest.fixture
def ck(small_options):
    checkpointer = ckptio.Checkpointer(small_options)
    yield checkpointer
    checkpointer.close()


class Spy:
    """Records every call of read._run (the one read-ahead loop): the spans of its reads."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[list[object]] = []
        self.nbytes = 0
        real = read_module._run

        def run(ranges, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.calls.append(list(dict.fromkeys(s for r in ranges for s in r.entries)))
            self.nbytes += sum(r.nbytes for r in ranges)
            return real(ranges, *args, **kwargs)

        monkeypatch.setattr(read_module, "_run", run)

    def kinds(self) -> list[set[bool]]:
        """Per call: which kinds of spans it read (True: whole entries, False: block spans)."""
        return [{span.whole for span in call} for call in self.calls]  # type: ignore[attr-defined]


def _submits(ck: ckptio.Checkpointer) -> list[tuple[int, int]]:
    """(offset, nbytes) of every read submitted to ``ck``'s backend from now on."""
    backend = inject(ck)
    seen: list[tuple[int, int]] = []
    real = backend.submit_read

    def submit_read(fh, offset, into):  # type: ignore[no-untyped-def]
        seen.append((offset, len(into)))
        return real(fh, offset, into)

    backend.submit_read = submit_read  # type: ignore[method-assign]
    return seen


def _entries(path: str) -> list[TensorEntry]:
    with open(os.path.join(path, manifest.MANIFEST_NAME), "rb") as f:
        return list(manifest.decode(f.read(), path).tensors)


def test_whole_and_resharded_loads_go_through_the_same_loop(tmp_path, monkeypatch, ck):
    """A fresh load, an in-place same-layout load and a load of a shard each make exactly one
    call of the read-ahead loop, which reads every byte the load reports."""
    big = torch.arange(512 * 1024, dtype=torch.float32).reshape(512, 1024)  # 2 MiB
    path = str(tmp_path / "ck")
    state = {"big": big, "small": torch.arange(10), "x": 3}
    ck.save(state, path)
    spy = Spy(monkeypatch)
    fresh = ck.load(path)
    assert torch.equal(fresh["big"], big) and fresh["x"] == 3
    dest = {"big": torch.zeros_like(big), "small": torch.zeros(10, dtype=torch.int64), "x": 0}
    same = ck.load(path, dest)
    assert torch.equal(dest["big"], big) and torch.equal(dest["small"], torch.arange(10))
    shard = ckptio.TensorShard(torch.zeros(16, 1024), (512, 1024), (100, 0))
    part = ck.load(path, {"big": shard}, strict=False)
    assert torch.equal(shard.local, big[100:116])
    assert len(spy.calls) == 3, "a load read through something else than the one loop"
    assert spy.kinds() == [{True}, {True}, {False}]  # whole entries, whole entries, blocks
    # the fresh load reads what the same-layout in-place one does
    assert spy.nbytes == same.nbytes_read + part.nbytes_read + same.nbytes_read


def test_a_whole_entry_is_read_in_full_coalesced_buffers(tmp_path, ck, small_options):
    """Ten entries of 400 KiB, contiguous in one file, and a small one: read in reads of one
    whole pool buffer each (entries split across them), not one or two entries per read as
    block-widened spans would be, and every stored byte exactly once."""
    state = {f"t{i}": torch.full((100 * 1024,), float(i)) for i in range(10)}
    state["small"] = torch.arange(7)
    path = str(tmp_path / "ck")
    ck.save(state, path)
    seen = _submits(ck)
    loaded = ck.load(path)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    entries = _entries(path)
    end = align_up(max(e.offset + e.nbytes for e in entries), BLOCK)
    buffer = small_options.buffer_bytes
    assert len({e.file for e in entries}) == 1
    assert sorted(seen) == [(at, min(buffer, end - at)) for at in range(0, end, buffer)], seen


def test_an_entry_wanted_whole_and_in_part_is_read_once(tmp_path, monkeypatch, ck):
    """Tied keys share one entry: one key takes it whole, the other a shard of it. The entry is
    planned in part only (block spans), so its bytes are read once."""
    w = torch.randn(1024, 1024)  # 4 MiB
    path = str(tmp_path / "ck")
    ck.save({"w": w, "tied": w}, path)
    spy = Spy(monkeypatch)
    shard = ckptio.TensorShard(torch.zeros(512, 1024), (1024, 1024), (256, 0))
    dest = {"w": torch.zeros_like(w), "tied": shard}
    report = ck.load(path, dest)
    assert torch.equal(dest["w"], w) and torch.equal(shard.local, w[256:768])
    (entry,) = _entries(path)
    assert spy.kinds() == [{False}]
    assert report.nbytes_read <= align_up(entry.nbytes, BLOCK), report.nbytes_read


def test_plan_spans_whole_entry_is_one_span_and_a_region_block_spans():
    entry = TensorEntry("w", "tensor", "float32", (1024, 1024), Chunk.whole((1024, 1024)), "f",
                        BLOCK, 4 * MiB, "00", blocks=tuple("0" * 16 for _ in range(16)))
    a, b = torch.empty(1024, 1024), torch.empty(1024, 1024)
    (whole,) = plan_spans([Read.of(entry, a), Read.of(entry, b)], 256 * KiB, MiB)
    assert whole.whole and (whole.offset, whole.nbytes) == (entry.offset, entry.nbytes)
    assert whole.dests == [a, b]  # two destinations, one read of the entry
    rows = Read("w", (entry,), Chunk((100, 0), (10, 1024)), torch.empty(10, 1024))
    (span,) = plan_spans([rows], 256 * KiB, MiB)
    assert not span.whole and (span.offset, span.nbytes) == (entry.offset + 256 * KiB, 256 * KiB)
    both = plan_spans([Read.of(entry, a), rows], 256 * KiB, MiB)
    assert not any(s.whole for s in both)
    covered = sorted((s.offset, s.end) for s in both)
    assert covered[0][0] == entry.offset and covered[-1][1] == entry.offset + entry.nbytes
    assert all(x[1] <= y[0] for x, y in pairwise(covered)), "a byte planned twice"


# ------------------------------------------------------------------------------------------------
# layout.coalesce_reads with in_one_read


def _extent(offset: int, nbytes: int, file: str = "f") -> TensorEntry:
    return TensorEntry("k", "tensor", "uint8", (nbytes,), Chunk.whole((nbytes,)), file, offset,
                       nbytes, "00")


def test_an_unsplit_extent_is_never_spread_over_reads():
    a, b = _extent(0, 3 * BLOCK), _extent(3 * BLOCK, 3 * BLOCK)
    split = coalesce_reads([a, b], max_read=4 * BLOCK, max_gap=0)
    assert [(r.offset, r.nbytes) for r in split] == [(0, 4 * BLOCK), (4 * BLOCK, 2 * BLOCK)]
    kept = coalesce_reads([a, b], max_read=4 * BLOCK, max_gap=0, in_one_read=lambda e: True)
    assert [(r.offset, r.nbytes, r.entries) for r in kept] == [(0, 3 * BLOCK, (a,)),
                                                               (3 * BLOCK, 3 * BLOCK, (b,))]


def test_an_unsplit_extent_larger_than_max_read_gets_a_read_of_its_own():
    small, big, after = _extent(0, 100), _extent(BLOCK, 9 * BLOCK), _extent(10 * BLOCK, 100)
    ranges = coalesce_reads([small, big, after], max_read=4 * BLOCK, max_gap=MiB,
                            in_one_read=lambda e: e is big)
    assert [(r.offset, r.nbytes, r.entries) for r in ranges] == [
        (0, BLOCK, (small,)), (BLOCK, 9 * BLOCK, (big,)), (10 * BLOCK, BLOCK, (after,))]


def test_a_corrupt_byte_in_a_resharded_piece_checked_on_an_io_thread_never_lands(
        tmp_path, monkeypatch, small_options):
    """A resharded load (a shard of rows and columns: strided pieces) has its reads checked and
    copied out on the I/O threads that read them. Two flipped bytes, in blocks 5 and 10 of the
    entry, inside the shard: the read holding block 8 is made to finish first, yet the error is
    block 4's (the first in read order), raised once every read in flight is done, naming the
    key, the file and the byte range; neither corrupt element reaches the destination, and every
    element that did arrive is the stored one. Through the POSIX backend, whose reads this
    test times (``_pread_all``)."""
    ck = ckptio.Checkpointer(dataclasses.replace(small_options, io_backend="posix"))
    big = torch.arange(1024 * 1024, dtype=torch.float32).reshape(1024, 1024)  # 4 MiB, 4 KiB rows
    path = str(tmp_path / "ck")
    ck.save({"big": big}, path)
    (entry,) = _entries(path)
    with open(os.path.join(path, manifest.MANIFEST_NAME), "rb") as f:
        block = manifest.decode(f.read(), path).block_nbytes
    assert len(entry.blocks) == 4 * MiB // block >= 12
    rows, cols = slice(100, 900), slice(256, 768)

    def shard() -> ckptio.TensorShard:
        return ckptio.TensorShard(torch.full((800, 512), -1.0), (1024, 1024), (100, 256))

    threads: list[str] = []
    real_blocks = read_module.Checker.blocks

    def blocks(self, span, view):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        return real_blocks(self, span, view)

    monkeypatch.setattr(read_module.Checker, "blocks", blocks)
    hit = [(b * block // 4096 + 3, 300 + b) for b in (4, 8)]  # (row, col) in blocks 4 and 8
    at = [entry.offset + (r * 1024 + c) * 4 + 3 for r, c in hit]  # each float's exponent byte
    assert [(a - entry.offset) // block for a in at] == [4, 8]
    real_pread = posix._pread_all
    done: list[int] = []  # which corrupt bytes each read held, as the reads complete

    def slow_pread(fh, offset, into):  # type: ignore[no-untyped-def]
        holds = [i for i, a in enumerate(at) if offset <= a < offset + len(into)]
        time.sleep(0.3 if 0 in holds else 0.02)
        got = real_pread(fh, offset, into)
        done.extend(holds)
        return got

    monkeypatch.setattr(posix, "_pread_all", slow_pread)
    good = shard()  # intact: the pieces land, checked on I/O threads only
    ck.load(path, {"big": good}, strict=False)
    assert torch.equal(good.local, big[rows, cols])
    assert threads and all(t.startswith("ckptio-io") for t in threads), threads
    data = os.path.join(path, entry.file)
    with open(data, "r+b") as f:
        for a in at:
            f.seek(a)
            byte = f.read(1)[0]
            f.seek(a)
            f.write(bytes([byte ^ 0x40]))
    bad = shard()
    done.clear()
    first = entry.offset + 4 * block
    with pytest.raises(CorruptCheckpointError,
                       match=rf"key 'big' in {re.escape(data)} bytes \[{first}, "
                             rf"{first + block}\)") as caught:
        ck.load(path, {"big": bad}, strict=False)
    assert caught.value.__context__ is None  # the one failure, not one raised over another
    assert done.index(1) < done.index(0), done  # block 8's read failed first
    time.sleep(0.5)  # anything still copying would land now
    landed = bad.local != -1.0
    assert torch.equal(bad.local[landed], big[rows, cols][landed])  # no wrong element
    assert all(bad.local[r - 100, c - 256] == -1.0 for r, c in hit)
    assert ck.resources().files(LocalStore("."))[0].idle()
    ck.close()

# ------------------------------------------------------------------------------------------------
# copying into destinations without a torch kernel (buffers.move_in), and reads applied while the
# pool is still being faulted in


class _Sub(torch.Tensor):
    pass


def test_move_in_copies_into_plain_host_tensors_only():
    """One memmove into a plain contiguous host tensor of the buffer's dtype (its version
    bumped as copy_ bumps it); anything else is left untouched for copy_in."""
    from ckptio.io.buffers import move_in
    from ckptio.io.stage import StagingPool

    pool = StagingPool(1, MiB)
    buffer = pool.acquire()
    buffer.as_dtype(torch.float32)[:64] = torch.arange(64.0)
    try:
        dest = torch.zeros(8, 4)
        version = dest._version
        assert move_in(buffer, 16, 64, dest, torch.float32, 32)  # elements 4.. into 8..
        assert torch.equal(dest.reshape(-1)[8:24], torch.arange(4.0, 20.0))
        assert not dest.reshape(-1)[:8].any() and not dest.reshape(-1)[24:].any()
        assert dest._version > version
        with torch.inference_mode():
            inference = torch.zeros(4)
        refused = {
            "not contiguous": torch.zeros(4, 8).t(),
            "another dtype": torch.zeros(8, dtype=torch.float64),
            "conjugate view": torch.zeros(2, dtype=torch.complex64).conj(),
            "inference tensor": inference,
            "subclass": torch.zeros(8).as_subclass(_Sub),
            "past its end": torch.zeros(3),
        }
        for why, t in refused.items():
            dtype = torch.complex64 if t.is_complex() else torch.float32
            before = t.clone()
            assert not move_in(buffer, 0, 16, t, dtype, 0), why
            assert torch.equal(t.resolve_conj(), before.resolve_conj()), why
        assert not move_in(buffer, MiB - 8, 16, torch.zeros(4), torch.float32, 0)  # past the buffer
    finally:
        pool.release(buffer)
        pool.close()


def test_an_in_place_load_fills_every_destination_and_marks_it_modified(tmp_path, ck):
    """Contiguous, transposed, Parameter and tied destinations are filled bit for bit, and each
    is marked modified as copy_ marks it: a graph that saved one for backward refuses to run."""
    g = torch.Generator().manual_seed(0)
    saved = {"w": torch.randn(6, 5, generator=g), "t": torch.randn(5, 6, generator=g),
             "b": torch.randn(7, generator=g).to(torch.bfloat16), "i": torch.arange(9)}
    path = str(tmp_path / "ck")
    ck.save(saved, path)
    w = torch.nn.Parameter(torch.zeros(6, 5))
    dest = {"w": w, "t": torch.zeros(6, 5).t(), "b": torch.zeros(7, dtype=torch.bfloat16),
            "i": torch.zeros(9, dtype=torch.int64)}
    x = torch.ones(5, requires_grad=True)
    y = (w @ x).sum()  # saves w for backward
    ck.load(path, dest)
    for key, value in saved.items():
        assert torch.equal(dest[key], value), key
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_acquire_unless_returns_when_other_work_is_ready():
    from ckptio.io.stage import StagingPool

    pool = StagingPool(1, MiB)
    held = pool.acquire()
    assert pool.acquire_unless(lambda: True) is None
    ready = [False]
    got: list[object] = []

    waiter = threading.Thread(target=lambda: got.append(pool.acquire_unless(lambda: ready[0])))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # neither a buffer nor ready work: it waits
    ready[0] = True
    pool.wake()
    waiter.join(5)
    assert got == [None]
    pool.release(held)
    assert pool.acquire_unless(lambda: True) is held  # a free buffer comes first
    pool.release(held)
    pool.close()


def test_a_load_applies_finished_reads_while_the_pool_is_still_faulted_in(tmp_path, monkeypatch,
                                                                          small_options):
    """A pool made by the load hands out its buffers as its background pre-fault reaches them;
    the loop checks and copies a finished read instead of waiting for the next buffer."""
    from ckptio.io import stage

    state = {f"t{i}": torch.full((256 * 1024,), float(i)) for i in range(6)}  # 6 MiB
    path = str(tmp_path / "ck")
    ckptio.save(state, path, options=small_options)
    gate = threading.Event()
    real = stage._populate
    waited_out: list[bool] = []

    def slow_populate(address, nbytes):  # type: ignore[no-untyped-def]
        if not gate.wait(5):  # the load never applied a read before its second buffer
            waited_out.append(True)
        real(address, nbytes)

    order: list[str] = []
    real_apply = read_module._apply

    def apply(*args):  # type: ignore[no-untyped-def]
        order.append("apply")
        gate.set()  # the first apply lets the pre-fault go on
        return real_apply(*args)

    calls = [0]

    def populate(address, nbytes):  # type: ignore[no-untyped-def]
        calls[0] += 1
        (real if calls[0] == 1 else slow_populate)(address, nbytes)

    monkeypatch.setattr(stage, "_populate", populate)
    monkeypatch.setattr(read_module, "_apply", apply)
    options = dataclasses.replace(small_options, pool_bytes=8 * small_options.buffer_bytes)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    ck = ckptio.Checkpointer(options)
    try:
        ck.load(path, dest)
    finally:
        ck.close()
    assert all(torch.equal(dest[k], v) for k, v in state.items())
    assert order and not waited_out


@pytest.mark.parametrize("crc", ["isal", "zlib"])
def test_crc32_records_are_checked_on_the_io_threads_unless_the_crc32_is_zlibs(
        tmp_path, monkeypatch, crc) -> None:
    """Whole entries that fit one read: ckptio's own (xxh3) are checked on the I/O thread that
    read them; torch.save's records (CRC-32) too when ISA-L computes their CRC-32, on the
    loading thread when zlib does (several times slower, it held an I/O thread from its next
    read: a 2-rank DCP load measured slower that way, docs/BENCH_INTEROP.md rounds three and
    five). Both loads stay bitwise."""
    import zlib

    from ckptio.format import checksum
    fn = pytest.importorskip("isal.isal_zlib").crc32 if crc == "isal" else zlib.crc32
    monkeypatch.setattr(checksum, "_CRC32", (crc, fn))
    state = {f"w{i}": torch.randn(64, 64) for i in range(6)}
    seen: dict[str, set[str]] = {"xxh3": set(), "crc32": set()}
    real_whole = read_module.Checker.whole

    def whole(self, span, view, last):  # type: ignore[no-untyped-def]
        seen["crc32" if self.algorithm == "crc32" else "xxh3"].add(
            threading.current_thread().name)
        return real_whole(self, span, view, last)

    monkeypatch.setattr(read_module.Checker, "whole", whole)
    ckptio.save(state, tmp_path / "ck")
    torch.save(state, tmp_path / "state.pt")
    for path in (tmp_path / "ck", tmp_path / "state.pt"):
        back = ckptio.load(path)
        assert all(torch.equal(back[k], v) for k, v in state.items())
    # on the I/O threads; a read that completed before its check was attached is checked on
    # the caller at once (add_done_callback runs it there): a race these tiny reads can win
    assert any(t.startswith(IO_THREADS) for t in seen["xxh3"]), seen
    assert seen["xxh3"] <= {t for t in seen["xxh3"] if t.startswith(IO_THREADS)} | {"MainThread"}
    if crc == "isal":  # on an I/O thread, or on the caller when its read had completed before
        # the check was attached (a cached file: add_done_callback then runs it at once)
        assert seen["crc32"], seen
        assert read_module.Checker(None, "crc32", 4096, False).on_io_threads  # type: ignore[arg-type]
    else:
        assert not read_module.Checker(None, "crc32", 4096, False).on_io_threads  # type: ignore[arg-type]
        assert seen["crc32"] == {threading.current_thread().name}, seen


def test_partly_wanted_blocks_are_read_through_the_page_cache_and_the_rest_direct(tmp_path, ck):
    """A shard that starts and ends inside checksum blocks: those blocks (which the ranks
    holding the neighbouring shards read too) go through a cached handle, every other byte
    through the direct one, and no block through both; a whole load reads nothing cached."""
    w = torch.randn(1024, 1024)  # 4 MiB: 16 blocks of 256 KiB with small_options
    path = str(tmp_path / "ck")
    ck.save({"w": w}, path)
    (entry,) = _entries(path)
    backend = inject(ck)
    seen: list[tuple[bool, int, int]] = []
    real = backend.submit_read

    def submit_read(fh, offset, into):  # type: ignore[no-untyped-def]
        seen.append((fh.direct, offset, len(into)))
        return real(fh, offset, into)

    backend.submit_read = submit_read  # type: ignore[method-assign]
    shard = ckptio.TensorShard(torch.zeros(600, 1024), (1024, 1024), (100, 0))
    ck.load(path, {"w": shard})
    assert torch.equal(shard.local, w[100:700])
    if not any(direct for direct, _, _ in seen):
        pytest.skip("this filesystem refuses O_DIRECT: every read is cached already")
    block = 256 * KiB
    first, last = (entry.offset + 100 * 4096) // block, (entry.offset + 700 * 4096 - 1) // block

    def blocks(direct: bool) -> set[int]:
        return {b for d, at, n in seen if d == direct
                for b in range((at - entry.offset) // block, -(-(at + n - entry.offset) // block))}

    cached, direct = blocks(False), blocks(True)
    assert {first, last} <= cached, (first, last, sorted(cached))
    assert not cached & direct, sorted(cached & direct)
    assert all(n <= 2 * block for d, _, n in seen if not d), seen  # edge blocks, not the shard
    assert cached | direct == set(range(first, last + 1))
    seen.clear()
    assert torch.equal(ck.load(path)["w"], w)
    assert seen and all(direct for direct, _, _ in seen), seen


@pytest.mark.parametrize("raise_in_submit", [False, True])
def test_a_failed_part_of_a_read_fails_the_load_naming_the_file_and_leaks_nothing(
        tmp_path, ck, raise_in_submit):
    """A resharded read made of direct and cached parts: whichever part fails (through its
    future or in its submit), the load raises the StorageIOError naming the data file, closes
    every handle it opened (cached ones too), and the next load succeeds."""
    w = torch.randn(1024, 1024)
    path = str(tmp_path / "ck")
    ck.save({"w": w}, path)
    for nth in range(1, 7):
        backend = inject(ck, fail_read=nth, raise_in_submit=raise_in_submit)
        shard = ckptio.TensorShard(torch.zeros(600, 1024), (1024, 1024), (100, 0))
        names_the_file = r"reading .*/data-[^/]*\.bin at byte"
        with pytest.raises(ckptio.errors.StorageIOError, match=names_the_file):
            ck.load(path, {"w": shard})
        assert backend.injected, f"read #{nth} was never reached"
        assert backend.open_handles == {}, backend.open_handles
        ck.close()
    shard = ckptio.TensorShard(torch.zeros(600, 1024), (1024, 1024), (100, 0))
    ck.load(path, {"w": shard})
    assert torch.equal(shard.local, w[100:700])
