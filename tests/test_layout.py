"""layout.py alone: placement of items in files, and coalescing of the reads a load needs."""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis", reason="the property-based tests need hypothesis "
                    "(pip install -e '.[test]')")
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptio.planning import layout
from ckptio.format import validate
from ckptio.planning.layout import coalesce_reads, data_file_name, plan_files
from ckptio.alignment import BLOCK, SMALL_ALIGN, align_down, align_up, is_aligned, item_alignment, padding
from ckptio.format.types import Chunk, TensorEntry, WriteItem

KiB, MiB = 1 << 10, 1 << 20
SAVE_ID = "0123456789abcdef0123"

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True)


def item(key: str, nbytes: int) -> WriteItem:
    return WriteItem(key, "tensor", "uint8", (nbytes,), Chunk.whole((nbytes,)), nbytes)


item_sizes = st.one_of(
    st.just(0),
    st.integers(1, BLOCK - 1),
    st.sampled_from([1, 63, 64, 65, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK]),
    st.integers(BLOCK, 3 * MiB),
)


def entries_of(files) -> list[TensorEntry]:
    return [
        TensorEntry(p.item.key, p.item.kind, p.item.dtype, p.item.shape, p.item.chunk, f.name,
                    p.offset, p.item.nbytes, "0" * 16)
        for f in files for p in f.placements
    ]


# --------------------------------------------------------------------------------------------
# small pure helpers


def test_align_helpers():
    assert [align_up(v, 64) for v in (0, 1, 63, 64, 65)] == [0, 64, 64, 64, 128]
    assert [align_down(v, BLOCK) for v in (0, 1, 4095, 4096, 8191)] == [0, 0, 0, 4096, 4096]
    assert align_up(10**15 + 1, BLOCK) % BLOCK == 0
    # the block is the default alignment; padding and is_aligned agree with align_up
    assert [align_up(v) for v in (0, 1, BLOCK, BLOCK + 1)] == [0, BLOCK, BLOCK, 2 * BLOCK]
    assert [align_down(v) for v in (BLOCK - 1, 2 * BLOCK + 5)] == [0, 2 * BLOCK]
    for v in (0, 1, 63, 64, BLOCK - 1, BLOCK, 3 * BLOCK + 17):
        assert v + padding(v) == align_up(v) and v + padding(v, 64) == align_up(v, 64)
        assert is_aligned(v) == (padding(v) == 0) and is_aligned(v, 64) == (v % 64 == 0)


def test_item_alignment_boundary():
    assert BLOCK == 4096 and SMALL_ALIGN == 64
    assert item_alignment(0) == SMALL_ALIGN
    assert item_alignment(BLOCK - 1) == SMALL_ALIGN
    assert item_alignment(BLOCK) == BLOCK
    assert item_alignment(10 * MiB) == BLOCK


def test_data_file_names_are_unique_and_pass_manifest_validation():
    names = {data_file_name(SAVE_ID, rank, index) for rank in (0, 7, 99999) for index in range(20)}
    assert len(names) == 60
    for name in names:
        assert validate.FILE_NAME.fullmatch(name), name
        assert "/" not in name and name not in (".", "..")


def test_empty_plan_has_no_files():
    assert plan_files([], save_id=SAVE_ID, rank=0, max_file_bytes=MiB) == ()


def test_small_items_pack_on_64_and_large_on_4096():
    files = plan_files([item("a", 10), item("b", 100), item("c", BLOCK), item("d", 1)],
                       save_id=SAVE_ID, rank=0, max_file_bytes=MiB)
    assert len(files) == 1
    offsets = [p.offset for p in files[0].placements]
    assert offsets == [0, 64, BLOCK, 2 * BLOCK]
    assert files[0].nbytes == 3 * BLOCK


def test_item_larger_than_max_file_gets_its_own_file():
    files = plan_files([item("a", 100), item("big", 3 * MiB), item("c", 100)],
                       save_id=SAVE_ID, rank=3, max_file_bytes=MiB)
    assert [[p.item.key for p in f.placements] for f in files] == [["a"], ["big"], ["c"]]
    assert [p.offset for f in files for p in f.placements] == [0, 0, 0]
    assert files[1].nbytes == 3 * MiB
    assert [f.name for f in files] == [data_file_name(SAVE_ID, 3, i) for i in range(3)]


# --------------------------------------------------------------------------------------------
# plan_files: property


@SETTINGS
@given(sizes=st.lists(item_sizes, max_size=40),
       max_file_bytes=st.one_of(st.integers(BLOCK, 8 * MiB), st.sampled_from([MiB, 4 * MiB])))
def test_plan_files_properties(sizes, max_file_bytes):
    items = [item(f"k{i}", n) for i, n in enumerate(sizes)]
    files = plan_files(items, save_id=SAVE_ID, rank=1, max_file_bytes=max_file_bytes)

    # every item placed exactly once, in the given order
    placed = [p.item for f in files for p in f.placements]
    assert placed == items
    assert all(f.placements for f in files), "no empty data files"
    assert [f.name for f in files] == [data_file_name(SAVE_ID, 1, i) for i in range(len(files))]

    previous_end = None
    for f in files:
        end = 0
        for p in f.placements:
            assert p.offset % item_alignment(p.item.nbytes) == 0, (p.offset, p.item.nbytes)
            if p.item.nbytes >= BLOCK:
                assert p.offset % BLOCK == 0
            else:
                assert p.offset % SMALL_ALIGN == 0
            assert p.offset >= end, "placements overlap or go backwards"
            assert p.offset - end < item_alignment(p.item.nbytes), "more padding than needed"
            end = p.offset + p.item.nbytes
        assert f.nbytes % BLOCK == 0
        assert end <= f.nbytes < end + BLOCK
        if len(f.placements) > 1:
            assert end <= max_file_bytes, "a file with several items passes max_file_bytes"
        if previous_end is not None:
            first = f.placements[0].item
            fits = align_up(previous_end, item_alignment(first.nbytes)) + first.nbytes
            assert fits > max_file_bytes, "a new file was begun though the item fit the last one"
        previous_end = end


# --------------------------------------------------------------------------------------------
# coalesce_reads


def check_coverage(entries, ranges, max_read):
    """Each non-empty entry's bytes are covered exactly once, in order, by the reads naming it."""
    sizes = {}
    for e in entries:
        sizes[e.file] = max(sizes.get(e.file, 0), align_up(e.offset + e.nbytes, BLOCK))
    assert ranges == sorted(ranges, key=lambda r: (r.file, r.offset))
    pieces: dict[int, list[tuple[int, int]]] = {}
    for r in ranges:
        assert r.offset % BLOCK == 0 and r.nbytes % BLOCK == 0, (r.offset, r.nbytes)
        assert 0 < r.nbytes <= max_read
        assert r.offset + r.nbytes <= sizes[r.file], "a read runs past the (padded) data"
        assert r.entries, "a read that no entry needs"
        for e in r.entries:
            assert e.file == r.file
            lo, hi = max(e.offset, r.offset), min(e.offset + e.nbytes, r.offset + r.nbytes)
            assert lo < hi, "a read names an entry it does not overlap"
            pieces.setdefault(id(e), []).append((lo, hi))
    for e in entries:
        got = pieces.get(id(e), [])
        if e.nbytes == 0:
            assert got == [], "an empty entry needs no read"
            continue
        pos = e.offset
        for lo, hi in got:  # in read order: consecutive, no gap and no byte twice
            assert lo == pos, (e.key, got)
            pos = hi
        assert pos == e.offset + e.nbytes, (e.key, got)


@SETTINGS
@given(sizes=st.lists(item_sizes, max_size=30),
       max_file_bytes=st.sampled_from([MiB, 2 * MiB, 16 * MiB]),
       max_read=st.integers(1, 1024).map(lambda n: n * BLOCK),
       max_gap=st.sampled_from([0, 1, 64, BLOCK, 512 * KiB]),
       data=st.data())
def test_coalesce_reads_covers_every_entry_exactly(sizes, max_file_bytes, max_read, max_gap, data):
    files = plan_files([item(f"k{i}", n) for i, n in enumerate(sizes)], save_id=SAVE_ID, rank=0,
                       max_file_bytes=max_file_bytes)
    entries = entries_of(files)
    # a load may want any subset, in any order
    wanted = data.draw(st.lists(st.sampled_from(entries), unique_by=id) if entries else st.just([]))
    ranges = coalesce_reads(wanted, max_read=max_read, max_gap=max_gap)
    check_coverage(wanted, ranges, max_read)


def test_neighbours_share_a_read_within_max_gap():
    files = plan_files([item("a", 100), item("b", 100), item("c", 5 * BLOCK), item("d", 100)],
                       save_id=SAVE_ID, rank=0, max_file_bytes=MiB)
    a, b, c, d = entries_of(files)
    ranges = coalesce_reads([a, b, c, d], max_read=MiB, max_gap=0)
    assert len(ranges) == 1 and [e.key for e in ranges[0].entries] == ["a", "b", "c", "d"]
    assert ranges[0].offset == 0 and ranges[0].nbytes == 7 * BLOCK

    # without c, the gap between b and d is 6 blocks: read through it only when max_gap allows
    assert len(coalesce_reads([a, d], max_read=MiB, max_gap=0)) == 2
    assert len(coalesce_reads([a, d], max_read=MiB, max_gap=6 * BLOCK)) == 1
    check_coverage([a, d], coalesce_reads([a, d], max_read=MiB, max_gap=6 * BLOCK), MiB)


def test_large_entry_spans_consecutive_reads_of_at_most_max_read():
    files = plan_files([item("x", 100), item("big", 10 * BLOCK + 7)], save_id=SAVE_ID, rank=0,
                       max_file_bytes=MiB)
    entries = entries_of(files)
    ranges = coalesce_reads(entries, max_read=4 * BLOCK, max_gap=0)
    assert [r.nbytes for r in ranges] == [4 * BLOCK, 4 * BLOCK, 4 * BLOCK]  # ends in block 12
    assert [r.offset for r in ranges] == [0, 4 * BLOCK, 8 * BLOCK]
    assert [[e.key for e in r.entries] for r in ranges] == [["x", "big"], ["big"], ["big"]]
    check_coverage(entries, ranges, 4 * BLOCK)


def test_reads_never_mix_files():
    files = plan_files([item("a", 600 * KiB), item("b", 600 * KiB)], save_id=SAVE_ID, rank=0,
                       max_file_bytes=MiB)
    assert len(files) == 2
    entries = entries_of(files)
    ranges = coalesce_reads(entries, max_read=4 * MiB, max_gap=4 * MiB)
    assert [r.file for r in ranges] == [files[0].name, files[1].name]
    check_coverage(entries, ranges, 4 * MiB)


def test_module_is_pure():
    source = open(layout.__file__).read()
    assert "import torch" not in source and "open(" not in source
