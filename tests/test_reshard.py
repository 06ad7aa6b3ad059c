"""reshard.py alone: plan the reads that fill a wanted region from stored regions (boxes and flat
ranges, uneven, replicated), apply them, and compare bitwise with a slice of the full tensor.

Files are simulated in memory: one bytes buffer per stored entry, with junk before the entry.
"""

from __future__ import annotations

from math import prod

import pytest
import torch

pytest.importorskip("hypothesis", reason="the property-based tests need hypothesis "
                    "(pip install -e '.[test]')")
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptio.planning.reshard import (FlatRange, Piece, Region, Stored, dest_view, execute,
                                     flat_boxes, flat_index, intersect, plan_reads,
                                     stored_from_entry, subtract)
from ckptio.format.types import Chunk, TensorEntry

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True)
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.int64,
          torch.uint8, torch.bool, torch.complex64]
MiB = 1 << 20


# ------------------------------------------------------------------------------------------------
# helpers: a reference tensor, its stored entries as in-memory files, applying a plan


def reference(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n = prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool().reshape(shape)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(n, generator=gen, dtype=torch.float64).to(dtype).reshape(shape)
    return torch.randint(0, 100, (n,), generator=gen).to(dtype).reshape(shape)


def region_of(full: torch.Tensor, region: Region) -> torch.Tensor:
    if isinstance(region, FlatRange):
        return full.reshape(-1)[region.start:region.start + region.length]
    return full[tuple(slice(o, o + s) for o, s in zip(region.offsets, region.sizes))]


def save(full: torch.Tensor, regions: list[Region], pads: list[int]) -> tuple[list[Stored],
                                                                              dict[str, bytes]]:
    """One simulated file per region: ``pad`` junk bytes, then the region's bytes row-major."""
    stored, files = [], {}
    for i, (region, pad) in enumerate(zip(regions, pads)):
        body = region_of(full, region).contiguous().reshape(-1).view(torch.uint8).numpy()
        files[f"f{i}"] = b"\xab" * pad + body.tobytes()
        stored.append(Stored(region, f"f{i}", pad))
    return stored, files


def read(files: dict[str, bytes], piece: Piece, dtype: torch.dtype) -> torch.Tensor:
    raw = bytearray(files[piece.file][piece.offset:piece.offset + piece.nbytes])
    assert len(raw) == piece.nbytes
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype)


def load(stored: list[Stored], files: dict[str, bytes], want: Region, shape: tuple[int, ...],
         dest: torch.Tensor, max_read: int) -> list[Piece]:
    """Plan, read each piece from the simulated files, apply it; the plan is returned."""
    pieces = plan_reads(stored, want, shape, dest.element_size(), max_read)
    for piece in pieces:
        execute(piece, read(files, piece, dest.dtype), dest)
    return pieces


def strided_dest(sizes: tuple[int, ...], dtype: torch.dtype, kind: int) -> torch.Tensor:
    """A destination of ``sizes``: contiguous (0), every other element of a larger tensor (1) or
    with its dims reversed in memory (2)."""
    if kind == 1:
        return torch.zeros((sizes[0] * 2,) + sizes[1:], dtype=dtype)[::2] if sizes else \
            torch.zeros((), dtype=dtype)
    if kind == 2 and len(sizes) > 1:
        return torch.zeros(sizes[::-1], dtype=dtype).permute(*reversed(range(len(sizes))))
    return torch.zeros(sizes, dtype=dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    def raw(t: torch.Tensor) -> torch.Tensor:  # a fresh dense copy: .contiguous() may keep strides
        return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)

    return a.shape == b.shape and torch.equal(raw(a), raw(b))


# ------------------------------------------------------------------------------------------------
# strategies: shapes, shardings (grids, flat ranges, replicas), wanted regions


shapes = st.lists(st.integers(1, 13), min_size=1, max_size=3).map(tuple)


@st.composite
def cuts(draw, size: int) -> list[int]:
    """Boundaries 0 = c0 < c1 < ... = size: an uneven split of one dim."""
    inner = draw(st.sets(st.integers(1, size - 1), max_size=4)) if size > 1 else set()
    return [0, *sorted(inner), size]


@st.composite
def grid(draw, shape: tuple[int, ...]) -> list[Region]:
    """A box grid: every dim split unevenly (1-D, 2-D, 3-D grids; a dim may stay whole)."""
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((), ())]
    for size in shape:
        c = draw(cuts(size))
        boxes = [(o + (a,), s + (b - a,)) for o, s in boxes for a, b in zip(c, c[1:])]
    return [Chunk(o, s) for o, s in boxes]


@st.composite
def flats(draw, shape: tuple[int, ...]) -> list[Region]:
    """Flat partitions of random lengths, not on row boundaries."""
    c = draw(cuts(prod(shape)))
    return [FlatRange(a, b - a) for a, b in zip(c, c[1:])]


@st.composite
def shardings(draw, shape: tuple[int, ...]) -> list[Region]:
    """One or two complete shardings (boxes or flat), maybe with replicas, in random order."""
    parts = draw(st.one_of(grid(shape), flats(shape)))
    if draw(st.booleans()):
        parts += draw(st.one_of(grid(shape), flats(shape)))
    extra = draw(st.lists(st.sampled_from(parts), max_size=3))  # duplicate replicas
    return draw(st.permutations(parts + extra))


@st.composite
def wanted(draw, shape: tuple[int, ...]) -> Region:
    kind = draw(st.sampled_from(["full", "box", "flat", "full-flat"]))
    if kind == "full":
        return Chunk.whole(shape)
    if kind == "full-flat":
        return FlatRange(0, prod(shape))
    if kind == "flat":
        start = draw(st.integers(0, prod(shape) - 1))
        return FlatRange(start, draw(st.integers(1, prod(shape) - start)))
    offsets = tuple(draw(st.integers(0, g - 1)) for g in shape)
    sizes = tuple(draw(st.integers(1, g - o)) for o, g in zip(offsets, shape))
    return Chunk(offsets, sizes)


@st.composite
def cases(draw):
    shape = draw(shapes)
    dtype = draw(st.sampled_from(DTYPES))
    regions = draw(shardings(shape))
    pads = draw(st.lists(st.integers(0, 7), min_size=len(regions), max_size=len(regions)))
    want = draw(wanted(shape))
    itemsize = dtype.itemsize
    max_read = draw(st.integers(3, 40)) * itemsize + draw(st.integers(0, itemsize - 1))
    dest_kind, seed = draw(st.integers(0, 2)), draw(st.integers(0, 2**31))
    return shape, dtype, regions, pads, want, max_read, dest_kind, seed


# ------------------------------------------------------------------------------------------------
# the property: any sharding -> any wanted region, bitwise


@SETTINGS
@given(cases())
def test_any_sharding_into_any_region(case):
    shape, dtype, regions, pads, want, max_read, dest_kind, seed = case
    full = reference(shape, dtype, seed)
    stored, files = save(full, regions, pads)
    if isinstance(want, FlatRange):
        dest = strided_dest((want.length,), dtype, min(dest_kind, 1))
    else:
        dest = strided_dest(want.sizes, dtype, dest_kind)
    pieces = load(stored, files, want, shape, dest, max_read)

    assert same_bits(dest, region_of(full, want))
    itemsize = dtype.itemsize
    for p in pieces:  # every read lies inside its entry's bytes and respects max_read
        entry = stored[p.source]
        assert p.file == entry.file
        assert entry.offset <= p.offset
        assert p.offset + p.nbytes <= entry.offset + entry.region.numel * itemsize
        assert p.nbytes == prod(p.src_shape) * itemsize
        assert p.nbytes <= max_read  # max_read >= 3 elements: every read fits
    counts = torch.zeros(dest.shape, dtype=torch.int32)  # each element written exactly once
    for p in pieces:
        dest_view(p, counts).add_(1)
    assert bool((counts == 1).all())


@SETTINGS
@given(shapes, st.data())
def test_flat_boxes_are_contiguous_and_in_order(shape, data):
    total = prod(shape)
    start = data.draw(st.integers(0, total - 1))
    flat = FlatRange(start, data.draw(st.integers(1, total - start)))
    boxes = flat_boxes(flat, shape)
    assert len(boxes) <= 2 * len(shape) - 1
    pos = flat.start
    index = torch.arange(total).reshape(shape)
    for first, box in boxes:
        assert first == pos
        got = region_of(index, box).reshape(-1)
        assert torch.equal(got, torch.arange(first, first + box.numel))
        pos += box.numel
    assert pos == flat.start + flat.length


@SETTINGS
@given(shapes, st.data())
def test_subtract_partitions_the_box(shape, data):
    def box() -> Chunk:
        o = tuple(data.draw(st.integers(0, g - 1)) for g in shape)
        return Chunk(o, tuple(data.draw(st.integers(1, g - x)) for x, g in zip(o, shape)))

    outer = box()
    hole = intersect(outer, box())
    if hole is None:
        return
    mark = torch.zeros(shape, dtype=torch.int32)
    for part in [hole, *subtract(outer, hole)]:
        region_of(mark, part).add_(1)
    assert bool((region_of(mark, outer) == 1).all()) and int(mark.sum()) == outer.numel


# ------------------------------------------------------------------------------------------------
# small exact cases


def test_intersect():
    a = Chunk((0, 2), (4, 4))
    assert intersect(a, Chunk((2, 0), (4, 3))) == Chunk((2, 2), (2, 1))
    assert intersect(a, Chunk((0, 6), (4, 1))) is None  # touching, not overlapping
    assert intersect(a, a) == a
    assert intersect(Chunk((), ()), Chunk((), ())) == Chunk((), ())
    with pytest.raises(ValueError, match="dims"):
        intersect(a, Chunk((0,), (1,)))


def test_missing_coverage_names_the_region():
    stored = [Stored(Chunk((0, 0), (2, 6)), "a", 0), Stored(FlatRange(12, 5), "b", 0)]
    with pytest.raises(ValueError, match=r"offsets=\(2, 5\) sizes=\(1, 1\).*flat index 17") as err:
        plan_reads(stored, Chunk.whole((4, 6)), (4, 6), 4, 1 << 20)
    assert "offsets=(3, 0) sizes=(1, 6)" in str(err.value) and "7 elements" in str(err.value)
    with pytest.raises(ValueError, match="flat index 17"):
        plan_reads(stored, FlatRange(10, 9), (4, 6), 4, 1 << 20)
    assert plan_reads(stored, FlatRange(3, 14), (4, 6), 4, 1 << 20)  # covered: fine


def test_malformed_regions_are_rejected():
    with pytest.raises(ValueError, match="outside global shape"):
        plan_reads([], Chunk((3,), (2,)), (4,), 4, 64)
    with pytest.raises(ValueError, match="stored entry 0.*outside a tensor of 4"):
        plan_reads([Stored(FlatRange(2, 3), "a", 0)], FlatRange(0, 1), (4,), 4, 64)
    with pytest.raises(ValueError, match="wrong number of dims"):
        plan_reads([], Chunk((0,), (1,)), (4, 4), 4, 64)
    with pytest.raises(ValueError, match="max_read"):
        plan_reads([], Chunk((0,), (1,)), (4,), 4, 0)


def test_first_replica_wins():
    stored = [Stored(Chunk((0, 0), (4, 4)), "first", 0), Stored(Chunk((0, 0), (4, 4)), "second", 0),
              Stored(FlatRange(0, 16), "third", 0)]
    pieces = plan_reads(stored, Chunk((1, 1), (2, 2)), (4, 4), 2, 1 << 20)
    assert [p.file for p in pieces] == ["first"]
    assert plan_reads(stored, Chunk((1, 1), (0, 2)), (4, 4), 2, 1 << 20) == []  # empty want


def test_rows_larger_than_max_read_are_split_inside_the_row():
    # 2 x 3 x 10 int32: a row of dim 0 is 120 bytes, of dim 1 40 bytes; max_read 24 = 6 elements
    pieces = plan_reads([Stored(Chunk.whole((2, 3, 10)), "a", 0)], Chunk((1, 1, 2), (1, 2, 7)),
                        (2, 3, 10), 4, 24)
    assert [(p.offset, p.nbytes) for p in pieces] == [
        (120 + 40 + 8, 24), (120 + 40 + 32, 4), (120 + 80 + 8, 24), (120 + 80 + 32, 4)]
    assert all(p.src_shape[:2] == (1, 1) for p in pieces)
    one_element = plan_reads([Stored(Chunk.whole((3,)), "a", 0)], Chunk.whole((3,)), (3,), 8, 5)
    assert [p.nbytes for p in one_element] == [8, 8, 8]  # an element larger than max_read


def test_scalar():
    full = torch.tensor(3.5, dtype=torch.bfloat16)
    stored, files = save(full, [Chunk((), ())], [3])
    dest = torch.zeros((), dtype=torch.bfloat16)
    load(stored, files, Chunk((), ()), (), dest, 64)
    assert same_bits(dest, full)
    flat = torch.zeros(1, dtype=torch.bfloat16)
    load(stored, files, FlatRange(0, 1), (), flat, 64)
    assert same_bits(flat, full.reshape(1))


def test_raw_bytes_and_stored_from_entry():
    full = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    entry = TensorEntry("w", "tensor", "float32", (3, 4), Chunk((1, 0), (2, 4)), "f", 16, 32, "")
    stored = stored_from_entry(entry)
    assert stored == Stored(Chunk((1, 0), (2, 4)), "f", 16)
    files = {"f": b"\0" * 16 + full[1:].numpy().tobytes()}
    dest = torch.zeros(2, 2)
    for p in plan_reads([stored], Chunk((1, 1), (2, 2)), (3, 4), 4, 1 << 20):  # raw uint8 bytes
        raw = bytearray(files["f"][p.offset:p.offset + p.nbytes])
        execute(p, torch.frombuffer(raw, dtype=torch.uint8), dest)
    assert torch.equal(dest, full[1:, 1:3])
    with pytest.raises(ValueError, match="'w'.*holds 30 bytes.*needs 32"):
        stored_from_entry(TensorEntry("w", "tensor", "float32", (3, 4), Chunk((1, 0), (2, 4)),
                                      "f", 16, 30, ""))


# ------------------------------------------------------------------------------------------------
# piece counts at scale: O(shards), not O(rows) or O(elements)


def test_scale_row_shards_to_any_layout():
    shape, itemsize, max_read = (4096, 4096), 4, 16 * MiB
    stored = [Stored(Chunk((64 * r, 0), (64, 4096)), f"r{r}", 4096) for r in range(64)]
    full = plan_reads(stored, Chunk.whole(shape), shape, itemsize, max_read)
    assert len(full) == 64 and sum(p.nbytes for p in full) == 4096 * 4096 * itemsize
    column = plan_reads(stored, Chunk((0, 1024), (4096, 1024)), shape, itemsize, max_read)
    assert len(column) == 64  # tensor parallel Shard(1) from Shard(0): one strided copy per shard
    rows = plan_reads(stored, Chunk((1000, 0), (1000, 4096)), shape, itemsize, max_read)
    assert len(rows) == 17 and sum(p.numel for p in rows) == 1000 * 4096
    flat = plan_reads(stored, FlatRange(12345, 4096 * 1000 + 7), shape, itemsize, max_read)
    assert len(flat) <= 16 + 2 * 2  # the shards it touches plus the partial rows at its ends
    small = plan_reads(stored, Chunk((0, 0), (2, 4096)), shape, itemsize, 4096)
    assert len(small) == 8  # a 16 KiB row read as 4 reads of 4 KiB


def test_scale_flat_partitions_into_flat_partitions():
    shape, itemsize = (4096, 4096), 2
    total = prod(shape)
    cut = [0, *(total * k // 7 + 13 * k for k in range(1, 7)), total]  # 7 ZeRO-style partitions
    stored = [Stored(FlatRange(a, b - a), f"p{i}", 0) for i, (a, b) in enumerate(zip(cut, cut[1:]))]
    want = FlatRange(total // 5 + 3, total // 5)  # one rank of 5, off row boundaries
    pieces = plan_reads(stored, want, shape, itemsize, 64 * MiB)
    assert sum(p.numel for p in pieces) == want.length
    assert len(pieces) <= 12  # a few per overlapping pair, independent of the 4096 rows
    assert flat_index((1, 2), shape) == 4098
