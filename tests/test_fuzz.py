"""The manifest is hostile input (issue 11): fuzzing the decoder and the load path.

A load of any manifest, however damaged or forged (the CRC-32 recomputed, so only the body's
own checks can refuse it), either returns the saved state bit for bit or raises a CkptError:
never another exception, a hang or a huge allocation; it never opens a file outside the
checkpoint and never unpickles without allow_pickle=True. verify agrees with load: a checkpoint
that verifies loads, and one whose load fails for its content fails verify.

Covers: structured mutations of a real checkpoint's manifest (types, ranges, nesting, offsets,
dtypes, kinds, shapes, chunks, devices, floats, file names), optionally with the data
checksums recomputed so the structure alone is under test; raw byte mutations of the manifest
and of the data files; arbitrary JSON into the decoder and into values.decode; one
deterministic regression test per hostile class of the issue; verify as strict as load
(coverage, block checksums, inline values). Example counts are bounded for the suite; set
CKPTIO_FUZZ_EXAMPLES for a longer run.
"""

from __future__ import annotations

import builtins
import copy
import dataclasses
import gc
import itertools
import json
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

pytest.importorskip("hypothesis", reason="the property-based tests need hypothesis "
                    "(pip install -e '.[test]')")
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ckptio import Checkpointer, Options
from ckptio.format import manifest, tiling
from ckptio.format import values
from ckptio.errors import (CkptError, CorruptCheckpointError, ManifestError, PickleRefusedError, StateMismatchError)
from ckptio.format.geometry import FlatRange, flat_boxes
from ckptio.format.types import DTYPE_ITEMSIZE, KINDS, Chunk
from conftest import assert_same

MiB = 1 << 20
OPTIONS = Options(buffer_bytes=MiB, pool_bytes=4 * MiB)  # checksum blocks of 256 KiB
EXAMPLES = int(os.environ.get("CKPTIO_FUZZ_EXAMPLES", "0"))
# A refusal that is the caller's choice, not damage: verify passes what only these refuse.
POLICY_ERRORS = (PickleRefusedError, StateMismatchError)
MAX_ALLOC = 64 * MiB  # no tensor a load of this ~1 MiB checkpoint makes may be larger
MAX_SECONDS = 20.0  # per load or verify of it (milliseconds normally; generous for a busy host)


def fuzz_settings(n: int) -> settings:
    return settings(max_examples=EXAMPLES or n, deadline=None, derandomize=not EXAMPLES,
                    database=None, suppress_health_check=list(HealthCheck))


# --------------------------------------------------------------------------------------------
# the checkpoint under attack


def make_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    w = torch.randn(8, 16, generator=g)
    return {
        "w": w,
        "tied": w,
        "big": torch.randn(70_000, generator=g),  # 280 KB: two 256 KiB checksum blocks
        "h": torch.randn(5, generator=g).bfloat16(),
        "f8": torch.randn(3, 2, generator=g).to(torch.float8_e4m3fn),
        "i": torch.tensor(-3, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "z": torch.randn(2, 3, dtype=torch.complex64, generator=g),
        "empty": torch.empty(0, 3, dtype=torch.float64),
        "arr": np.arange(6, dtype=np.int16).reshape(2, 3),
        "npf": np.float32(1.5),
        "blob": bytes(range(200)),
        "py": {"n": 7, "huge": 3 ** 200, "x": 0.1, "nan": float("nan"), "inf": float("-inf"),
               "c": complex(1.0, -0.0), "s": "ü[{\"", "none": None, "flag": True,
               "size": torch.Size([2, 3]), "dt": torch.bfloat16, "dev": torch.device("cpu")},
        "nest": [1, (2, "x"), {"0": 0, 1: "int key"}],
    }


STATE = make_state()


@pytest.fixture(scope="module")
def ck() -> Iterator[Checkpointer]:
    c = Checkpointer(OPTIONS)
    yield c
    gc.collect()  # errors kept by pytest.raises hold staging-buffer views (see test_corruption)
    c.close()


@pytest.fixture(scope="module")
def victim(tmp_path_factory: pytest.TempPathFactory, ck: Checkpointer) -> Victim:
    path = tmp_path_factory.mktemp("fuzz") / "ckpt"
    ck.save(STATE, path)
    return Victim(path)


class Victim:
    """A saved checkpoint, its pristine manifest and data, and variants of its manifest that
    mean the same state through other layouts (chunks the loader assembles)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.manifest_bytes = (path / manifest.MANIFEST_NAME).read_bytes()
        self.body = split(self.manifest_bytes)
        self.data = {f["name"]: (path / f["name"]).read_bytes() for f in self.body["files"]}
        self.variants = {"plain": self.body, "rows": self._rows(), "flat": self._flat()}

    def restore(self) -> None:
        write_manifest(self.path, self.manifest_bytes)
        for name, data in self.data.items():
            if (self.path / name).read_bytes() != data:
                (self.path / name).write_bytes(data)

    @staticmethod
    def decoded(body: dict[str, Any]) -> manifest.Manifest:
        return manifest.decode(wrap(body), "variant")

    def _rows(self) -> dict[str, Any]:
        """"w" (8 x 16 float32) as two chunks of four rows: the same bytes, the assemble path."""
        body = copy.deepcopy(self.body)
        w = entry(body, "w")
        top = dict(w, chunk={"offsets": [0, 0], "sizes": [4, 16]}, nbytes=256)
        bottom = dict(w, chunk={"offsets": [4, 0], "sizes": [4, 16]}, nbytes=256,
                      offset=w["offset"] + 256)
        body["tensors"] = [t for t in body["tensors"] if t is not w] + [bottom, top]
        return rechecksum(body, self.data)

    def _flat(self) -> dict[str, Any]:
        """"big" as three flat ranges, the last larger than a checksum block (block checks)."""
        body = copy.deepcopy(self.body)
        big = entry(body, "big")
        parts = []
        for start, stop in ((0, 1000), (1000, 2500), (2500, 70_000)):
            part = dict(big, chunk={"offsets": [start], "sizes": [stop - start], "flat": True},
                        offset=big["offset"] + 4 * start, nbytes=4 * (stop - start))
            part.pop("blocks", None)
            parts.append(part)
        body["tensors"] = [t for t in body["tensors"] if t is not big] + parts
        return rechecksum(body, self.data)


def split(data: bytes) -> dict[str, Any]:
    return json.loads(data.split(b"\n", 1)[1])


_DEEP = re.compile(r'"\\u0000deep:(\d+)\\u0000"')


def deep(depth: int) -> str:
    """A stand-in for arrays nested ``depth`` deep, which encode() writes out (json.dumps would
    itself recurse too deeply)."""
    return f"\0deep:{depth}\0"


def encode(body: Any) -> bytes:
    text = json.dumps(body)
    return _DEEP.sub(lambda m: "[" * int(m[1]) + "]" * int(m[1]), text).encode()


def wrap(body: dict[str, Any] | bytes) -> bytes:
    """A manifest whose header matches its body (length, CRC-32): only the body's own checks
    can refuse it."""
    raw = body if isinstance(body, bytes) else encode(body)
    header = {"magic": manifest.MAGIC, "version": manifest.VERSION, "body_nbytes": len(raw),
              "body_crc32": zlib.crc32(raw)}
    return json.dumps(header).encode() + b"\n" + raw + b"\n"


def write_manifest(path: Path, data: bytes) -> None:
    (path / manifest.MANIFEST_NAME).write_bytes(data)


def entry(body: dict[str, Any], key: str) -> dict[str, Any]:
    return next(t for t in body["tensors"] if t.get("key") == key)


def obj(body: dict[str, Any], key: str) -> dict[str, Any]:
    return next(o for o in body["objects"] if o.get("key") == key)


def _digest(data: bytes) -> str:
    return xxhash.xxh3_64(data).hexdigest()


def rechecksum(body: dict[str, Any], data: dict[str, bytes]) -> dict[str, Any]:
    """Recompute each well-formed entry's checksum and block checksums from the bytes it names
    (a forger who controls the data too): only the manifest's structure can then refuse it."""
    block = body.get("block_nbytes")
    for t in body.get("tensors", []) if isinstance(body.get("tensors"), list) else []:
        try:
            raw = data[t["file"]][t["offset"]:t["offset"] + t["nbytes"]]
        except (KeyError, TypeError, ValueError):
            continue  # a malformed entry: the decoder refuses it anyway
        t["checksum"] = _digest(raw)
        if type(block) is int and block > 0 and len(raw) > block:
            t["blocks"] = [_digest(raw[i:i + block]) for i in range(0, len(raw), block)]
            if body.get("checksum_algorithm") == "xxh3_64_tree":  # the whole from the blocks
                t["checksum"] = _digest("".join(t["blocks"]).encode("ascii"))
    return body


# --------------------------------------------------------------------------------------------
# the invariant


def _normal(m: manifest.Manifest) -> manifest.Manifest:
    """A manifest with what does not change the loaded state (meta, save id) blanked."""
    return dataclasses.replace(m, meta={}, save_id="")


@contextmanager
def guarded(root: Path) -> Iterator[list[str]]:
    """Fail on any unpickling, any tensor above MAX_ALLOC, any file opened outside ``root``."""
    opened: list[str] = []
    real_os_open, real_open, real_empty = os.open, builtins.open, torch.empty

    def os_open(path: Any, *args: Any, **kwargs: Any) -> int:
        opened.append(os.fspath(path))
        return real_os_open(path, *args, **kwargs)

    def open_(file: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, (str, bytes, os.PathLike)):
            opened.append(os.fsdecode(file))
        return real_open(file, *args, **kwargs)

    def empty(*size: Any, **kwargs: Any) -> torch.Tensor:
        one = len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size))
        dims = size[0] if one else size
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        nbytes = real_empty((), dtype=dtype).element_size()
        for d in dims:
            nbytes *= int(d)
        if nbytes > MAX_ALLOC:
            raise AssertionError(f"a load allocated a tensor of {nbytes} bytes ({tuple(dims)})")
        return real_empty(*size, **kwargs)

    def no_pickle(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a load unpickled without allow_pickle=True")

    patches = [(os, "open", os_open), (builtins, "open", open_), (torch, "empty", empty),
               (pickle, "loads", no_pickle), (pickle, "load", no_pickle),
               (pickle, "Unpickler", no_pickle)]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    for mod, name, new in patches:
        setattr(mod, name, new)
    try:
        yield opened
    finally:
        for mod, name, old in saved:
            setattr(mod, name, old)
    inside = os.path.realpath(root)
    # the tuned-profile file (conftest points it at a temporary one): not named by a manifest
    allowed = {os.path.realpath(os.environ.get("CKPTIO_PROFILE_PATH", inside))}
    outside = [p for p in opened if os.path.realpath(p) not in allowed
               and os.path.commonpath([os.path.realpath(p), inside]) != inside]
    assert not outside, f"files opened outside the checkpoint: {outside}"


def outcome(call: Callable[[], Any]) -> tuple[Any, CkptError | None]:
    """(result, None) or (None, the CkptError); any other exception fails the test."""
    started = time.perf_counter()
    try:
        return call(), None
    except CkptError as exc:
        return None, exc
    finally:
        assert time.perf_counter() - started < MAX_SECONDS, "a load or verify took too long"


def check(ck: Checkpointer, path: Path, exact: bool) -> tuple[CkptError | None, CkptError | None]:
    """Load ``path`` (fresh, and in place into a new copy of the state) and verify it, under
    guard; ``exact``: the manifest means the saved state, so a load that succeeds must give it
    bit for bit. -> (the fresh load's error, verify's error)."""
    dest = make_state()
    with guarded(path):
        loaded, load_error = outcome(lambda: ck.load(path))
        _, in_place_error = outcome(lambda: ck.load(path, dest, strict=False))
        _, verify_error = outcome(lambda: ck.verify(path))
    for error in (load_error, in_place_error):
        if verify_error is None:  # "verify OK" means "loads"
            assert error is None or isinstance(error, POLICY_ERRORS), (
                f"verify passed but a load raised {error!r}")
        if error is not None and not isinstance(error, POLICY_ERRORS):
            assert verify_error is not None, f"a load raised {error!r} but verify passed"
    if verify_error is not None and load_error is None:  # stricter only about what a whole load
        assert "block checksum" in str(verify_error), f"load passed, verify: {verify_error!r}"
    if exact and load_error is None:
        assert_same(loaded, STATE)
        assert in_place_error is None
        assert_same(dest, STATE)
    return load_error, verify_error


# --------------------------------------------------------------------------------------------
# structured mutations (valid CRC)

TENSOR_FIELDS = ["key", "kind", "dtype", "shape", "chunk", "file", "offset", "nbytes",
                 "checksum", "rank", "blocks"]
HOSTILE_SCALARS = [
    None, True, False, 0, 1, 2, 3, 4, 7, 63, 64, 4095, 4096, -1, -4096, 2 ** 31, 2 ** 62 - 1,
    2 ** 62, 2 ** 63, 2 ** 64, -2 ** 63, 1.5, float("inf"), float("nan"), "", ".", "..", "../x",
    "/etc/passwd", "a/b", "x" * 300, "manifest.json", "nan:00", "nan:zz", "nan:3ff0000000000000",
    "0x1p99999", "-0x1p-99999", "0x1.8p+1", "inf", "1_0", "0x1F", "cuda:abc", "cuda:-1",
    "cuda:99999999999999999999", "cpu", "meta", "float32", "bfloat16", "float8_e4m3fn",
    "complex32", "uint8", "bool", "float128", "tensor", "numpy", "numpy_scalar", "bytes",
    "pickle", "0123456789abcdef", "__class__", "_dynamo", "xxh3_64",
]
HOSTILE_CONTAINERS = [
    [], {}, [0], [[0]], [1, 2], [1 << 40], [0, 0, 0], [1] * 200, [2 ** 61, 2 ** 61, 0],
    ["int", 1], ["float", "nan:00"], ["float", "0x1p99999"], ["device", "cuda:abc"],
    ["size", [-1]], ["size", [2 ** 63]], ["dtype", "__class__"], ["none", 1], ["complex", [1]],
    {"k": "w"}, {"d": []}, {"d": [["a", {"k": "w"}], ["a", {"k": "w"}]]},
    {"offsets": [0], "sizes": [1 << 40]}, {"offsets": [0], "sizes": [4], "flat": True},
]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=12),
    lambda inner: (st.lists(inner, max_size=4)
                   | st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12,
)
hostile = st.one_of(
    st.sampled_from(HOSTILE_SCALARS),
    st.sampled_from(HOSTILE_CONTAINERS).map(copy.deepcopy),
    st.integers(-2 ** 64, 2 ** 64),
    st.text(max_size=16),
    st.integers(1, 1200).map(deep),
    json_values,
)


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, prefix + (i,))


def at(body: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        body = body[part]
    return body


@st.composite
def plausible(draw: st.DrawFn, body: dict[str, Any]) -> None:
    """A change that keeps an entry well-formed (so the load goes on to read it, mostly): its
    bytes moved, its dtype, shape, kind or rank changed consistently."""
    t = draw(st.sampled_from(_dicts(body, "tensors") or [{}]))
    op = draw(st.sampled_from(["shift", "retype", "flatten", "kind", "rank", "world"]))
    try:
        sizes = list(t["chunk"]["sizes"])
        whole = not t["chunk"].get("flat") and sizes == t["shape"]
    except (KeyError, TypeError, AttributeError):  # already mangled: nothing plausible left
        return
    if op == "shift" and type(t.get("offset")) is int:
        t["offset"] += draw(st.sampled_from([-4096, -64, -16, -8, -4, 4, 8, 16, 64, 4096]))
    elif op == "retype":
        t["dtype"] = draw(st.sampled_from(sorted(DTYPE_ITEMSIZE)))
        t["nbytes"] = DTYPE_ITEMSIZE[t["dtype"]] * _numel(sizes)
    elif op == "flatten" and whole:
        t["shape"] = [_numel(sizes)]
        t["chunk"] = {"offsets": [0], "sizes": [_numel(sizes)]}
    elif op == "kind":
        t["kind"] = draw(st.sampled_from(KINDS))
    elif op == "rank":
        t["rank"] = draw(st.sampled_from([0, 1]))
    elif op == "world":
        body["world_size"] = draw(st.sampled_from([1, 2, 3]))


def _numel(sizes: list[Any]) -> int:
    n = 1
    for d in sizes:
        n *= d if type(d) is int else 1
    return n


def _dicts(body: dict[str, Any], field: str) -> list[dict[str, Any]]:
    """The entries of a list field that are still objects (earlier mutations may have broken
    them)."""
    entries = body.get(field)
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


@st.composite
def mutation(draw: st.DrawFn, body: dict[str, Any]) -> None:
    """Change ``body`` in place: one field of an entry (most likely), or any node."""
    how = draw(st.sampled_from(["tensor", "tensor", "plausible", "plausible", "object", "any",
                                "nudge", "drop", "copy", "swap"]))
    if how == "plausible":
        draw(plausible(body))
        return
    if how == "tensor" and _dicts(body, "tensors"):
        t = draw(st.sampled_from(_dicts(body, "tensors")))
        t[draw(st.sampled_from(TENSOR_FIELDS))] = draw(hostile)
        return
    if how == "object" and _dicts(body, "objects"):
        o = draw(st.sampled_from(_dicts(body, "objects")))
        o["value"] = draw(st.one_of(hostile, st.tuples(
            st.sampled_from(["none", "bool", "int", "float", "complex", "str", "size", "dtype",
                             "device"]), hostile).map(list)))
        return
    nodes = list(paths(body))[1:]
    if not nodes:
        return
    where = draw(st.sampled_from(nodes))
    parent, last = at(body, where[:-1]), where[-1]
    if how in ("any", "tensor", "object"):
        parent[last] = draw(hostile)
    elif how == "nudge" and type(parent[last]) is int:
        parent[last] += draw(st.sampled_from([-4096, -64, -8, -4, -2, -1, 1, 2, 4, 8, 64, 4096,
                                              1 << 40]))
    elif how == "drop":
        del parent[last]
    elif how == "copy" and isinstance(parent, list):
        parent.append(copy.deepcopy(parent[last]))
    elif how == "swap" and isinstance(parent, list) and len(parent) > 1:
        other = draw(st.integers(0, len(parent) - 1))
        parent[last], parent[other] = parent[other], parent[last]


@fuzz_settings(200)
@given(data=st.data())
def test_structured_mutations_load_exactly_or_raise_ckpt_error(ck, victim, data):
    variant = data.draw(st.sampled_from(sorted(victim.variants)), label="variant")
    body = copy.deepcopy(victim.variants[variant])
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        data.draw(mutation(body))
    if data.draw(st.booleans(), label="rechecksum"):
        rechecksum(body, victim.data)
    try:
        same = _normal(victim.decoded(body)) == _normal(victim.decoded(victim.variants[variant]))
    except ManifestError:
        same = False
    write_manifest(victim.path, wrap(body))
    try:
        load_error, _ = check(ck, victim.path, exact=same)
    finally:
        victim.restore()
    event(f"load: {type(load_error).__name__ if load_error else 'exact' if same else 'loaded'}")


def test_unmutated_variants_load_exactly(ck, victim):
    """The base of the fuzzer: every variant is valid and loads the saved state, through whole
    entries, row chunks and flat chunks (the latter two assembled, blocks checked)."""
    for name, body in victim.variants.items():
        write_manifest(victim.path, wrap(body))
        try:
            assert check(ck, victim.path, exact=True) == (None, None), name
        finally:
            victim.restore()
    assert entry(victim.body, "big")["blocks"], "the fuzzed checkpoint must have block checksums"


# --------------------------------------------------------------------------------------------
# raw byte mutations (CRC not fixed) and data damage


byte_edits = st.lists(st.tuples(st.sampled_from(["flip", "set", "insert", "delete"]),
                                st.floats(0, 1, exclude_max=True), st.integers(0, 255)),
                      min_size=1, max_size=4)


def edit(data: bytes, edits: list[tuple[str, float, int]]) -> bytes:
    out = bytearray(data)
    for op, where, value in edits:
        i = int(where * len(out)) if out else 0
        if op == "flip" and out:
            out[i] ^= value or 1
        elif op == "set" and out:
            out[i] = value
        elif op == "insert":
            out.insert(i, value)
        elif op == "delete" and out:
            del out[i]
    return bytes(out)


@fuzz_settings(100)
@given(edits=byte_edits, cut=st.none() | st.floats(0, 1))
def test_raw_manifest_damage_loads_exactly_or_raises(ck, victim, edits, cut):
    damaged = edit(victim.manifest_bytes, edits)
    if cut is not None:
        damaged = damaged[:int(cut * len(damaged))]
    write_manifest(victim.path, damaged)
    try:
        load_error, verify_error = check(ck, victim.path, exact=True)
        assert (load_error is None) == (verify_error is None)
    finally:
        victim.restore()


@fuzz_settings(40)
@given(edits=byte_edits, variant=st.sampled_from(["plain", "rows", "flat"]))
def test_data_file_damage_loads_exactly_or_raises(ck, victim, edits, variant):
    write_manifest(victim.path, wrap(victim.variants[variant]))
    (name, data), = victim.data.items()
    (victim.path / name).write_bytes(edit(data, [e for e in edits if e[0] in ("flip", "set")]))
    try:
        load_error, verify_error = check(ck, victim.path, exact=True)
        assert (load_error is None) == (verify_error is None)
        if load_error is not None:
            assert isinstance(load_error, CorruptCheckpointError)
    finally:
        victim.restore()


# --------------------------------------------------------------------------------------------
# the decoder and values.decode alone (no I/O: many examples)


@fuzz_settings(300)
@given(body=json_values | st.fixed_dictionaries({}, optional={
    k: json_values for k in ("format", "version", "save_id", "checksum_algorithm", "world_size",
                             "files", "tensors", "objects", "aliases", "tree", "meta",
                             "block_nbytes")}))
def test_decoder_on_arbitrary_json_raises_only_manifest_error(body):
    try:
        m = manifest.decode(wrap(json.dumps(body).encode()), "fuzz")
        manifest.check_values(m, "fuzz")
    except ManifestError as exc:
        assert "fuzz" in str(exc)
        return
    assert m.tensors == () and m.objects == ()  # a body this random passes only when empty


@fuzz_settings(200)
@given(data=st.data())
def test_decoder_on_mutated_real_bodies_raises_only_manifest_error(victim, data):
    variant = data.draw(st.sampled_from(sorted(victim.variants)))
    body = copy.deepcopy(victim.variants[variant])
    for _ in range(data.draw(st.integers(1, 4))):
        data.draw(mutation(body))
    try:
        m = manifest.decode(wrap(body), "fuzz")
        manifest.check_values(m, "fuzz")
    except ManifestError as exc:
        assert "fuzz" in str(exc)


@fuzz_settings(200)
@given(raw=st.binary(max_size=300))
def test_decoder_on_random_bytes_raises_only_manifest_error(raw):
    for data in (raw, wrap(raw)):
        with pytest.raises(ManifestError):
            manifest.decode(data, "fuzz")


@fuzz_settings(300)
@given(tagged=json_values | st.tuples(st.sampled_from(sorted(values._DECODERS)),
                                      hostile | json_values).map(list))
def test_values_decode_raises_only_value_error(tagged):
    try:
        decoded = values.decode(tagged)
    except ValueError:
        return
    assert values.decode(values.encode(decoded)) == decoded or decoded != decoded


@fuzz_settings(200)
@given(text=st.text(max_size=40) | st.from_regex(r"[a-z]{2,6}:-?[0-9a-z]{1,25}", fullmatch=True))
def test_any_device_string_decodes_or_raises_value_error(text):
    try:
        device = values.decode(["device", text])
    except ValueError as exc:
        assert "device" in str(exc)
        return
    assert isinstance(device, torch.device)


# --------------------------------------------------------------------------------------------
# the decoder's building blocks against slow, obviously right references


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


tricky_text = st.text(alphabet='[]{}"\\/,:ab \n\x00\u00fc\U0001f600', max_size=8)
tricky_json = st.recursive(
    st.none() | st.integers() | tricky_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(tricky_text, inner, max_size=3),
    max_leaves=20,
)


@fuzz_settings(300)
@given(value=tricky_json, ascii_only=st.booleans())
def test_json_depth_matches_the_nesting(value, ascii_only):
    """Brackets inside strings (escaped quotes and backslashes too) never count."""
    text = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert manifest.json_depth(text) == _depth(value)


def _covered_once(chunks: list[Chunk], shape: tuple[int, ...]) -> bool:
    """Every element of ``shape`` in exactly one chunk, counted element by element."""
    count: dict[int, int] = {}
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    for chunk in chunks:
        if chunk.flat:
            flat = range(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0])
        else:
            flat = (sum(i * s for i, s in zip(index, strides)) for index in itertools.product(
                *(range(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))))
        for i in flat:
            count[i] = count.get(i, 0) + 1
    total = math.prod(shape)
    return len(count) == total and all(count.get(i, 0) == 1 for i in range(total))


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[Chunk], tuple[int, ...]]:
    """A tiling (boxes cut recursively, or flat ranges, some then written as their boxes), often
    damaged: a chunk shrunk, moved or doubled."""
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    if draw(st.booleans()):
        boxes = [((0,) * len(shape), shape)]
        for _ in range(draw(st.integers(0, 6))):
            lo, hi = boxes.pop(draw(st.integers(0, len(boxes) - 1)))
            dim = draw(st.integers(0, len(shape) - 1))
            if hi[dim] - lo[dim] < 2:
                boxes.append((lo, hi))
                continue
            cut = draw(st.integers(lo[dim] + 1, hi[dim] - 1))
            boxes += [(lo, hi[:dim] + (cut,) + hi[dim + 1:]),
                      (lo[:dim] + (cut,) + lo[dim + 1:], hi)]
        chunks = [Chunk(lo, tuple(h - o for o, h in zip(lo, hi))) for lo, hi in boxes]
    else:
        total = math.prod(shape)
        cuts = sorted(draw(st.sets(st.integers(1, total - 1), max_size=4))) if total > 1 else []
        ends = [0, *cuts, total]
        chunks = [Chunk((a,), (b - a,), flat=True) for a, b in zip(ends, ends[1:])]
        if draw(st.booleans()):  # some ranges as the boxes they are made of: a mixed layout
            ranges = [c for c in chunks if draw(st.booleans())]
            chunks = [c for c in chunks if c not in ranges] + [
                box for c in ranges
                for _first, box in flat_boxes(FlatRange(c.offsets[0], c.sizes[0]), shape)]
    damage = draw(st.sampled_from(["none", "none", "shrink", "move", "double"]))
    i = draw(st.integers(0, len(chunks) - 1))
    c, dim = chunks[i], draw(st.integers(0, len(chunks[i].sizes) - 1))
    grow = tuple(n - (d == dim) for d, n in enumerate(c.sizes))
    if damage == "shrink" and c.sizes[dim] > 1:
        chunks[i] = Chunk(c.offsets, grow, c.flat)
    elif damage == "move" and c.offsets[dim] > 0:
        chunks[i] = Chunk(tuple(o - (d == dim) for d, o in enumerate(c.offsets)), c.sizes, c.flat)
    elif damage == "double":
        chunks.append(c)
    return [c for c in chunks if c.fits(shape)], shape


@fuzz_settings(300)
@given(layout=layouts())
def test_tiling_check_matches_counting_every_element(layout):
    chunks, shape = layout
    assert (manifest.tiling_problem(chunks, shape) is None) == _covered_once(chunks, shape)


def test_tiling_check_is_linear_for_the_layouts_saves_make():
    """Grids, row and column shards, and strips both ways are accepted with work proportional to
    their chunks (a layout costing more than _TILING_WORK per chunk is refused, never a hang)."""
    grid = [Chunk((i, j), (3, 5)) for i in range(0, 300, 3) for j in range(0, 500, 5)]
    strips = ([Chunk((i, 0), (1, 400)) for i in range(400)]
              + [Chunk((0, 400 + j), (400, 1)) for j in range(400)])
    started = time.perf_counter()
    assert manifest.tiling_problem(grid, (300, 500)) is None
    assert manifest.tiling_problem(strips, (400, 800)) is None
    assert time.perf_counter() - started < MAX_SECONDS
    missing = grid[:-1] + [Chunk((297, 495), (3, 4))]
    assert "hold 149997 of the 150000 elements" in manifest.tiling_problem(missing, (300, 500))


def test_tiling_check_refuses_rather_than_exceed_its_budget(monkeypatch):
    grid = [Chunk((i, j), (1, 1)) for i in range(4) for j in range(4)]
    assert tiling.tiling_problem(grid, (4, 4)) is None
    monkeypatch.setattr(tiling, "_TILING_WORK", 0)
    assert "too irregularly" in tiling.tiling_problem(grid, (4, 4))


# --------------------------------------------------------------------------------------------
# one deterministic regression per hostile class of issue 11


def _mutated(victim: Victim, change: Callable[[dict[str, Any]], Any], *,
             data_too: bool = False) -> bytes:
    body = copy.deepcopy(victim.body)
    replaced = change(body)
    if data_too:
        rechecksum(body, victim.data)
    return replaced if isinstance(replaced, bytes) else wrap(body)


def _set_object(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda body: obj(body, key).__setitem__("value", value)


def _set_tensor(key: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda body: entry(body, key).update(fields)


def _deep_header(_body: dict[str, Any]) -> bytes:
    return b"[" * 100_000 + b"]" * 100_000 + b"\n{}\n"


def _deep_body(body: dict[str, Any]) -> None:
    body["meta"] = deep(5000)


def _deep_value(body: dict[str, Any]) -> None:
    obj(body, "py.n")["value"] = ["int", deep(900)]


def _misaligned(body: dict[str, Any]) -> None:
    entry(body, "w")["offset"] += 2


def _huge_shape(body: dict[str, Any]) -> None:
    entry(body, "w").update(shape=[1 << 40], chunk={"offsets": [0], "sizes": [128]})


REGRESSIONS = [
    pytest.param(_deep_header, "bad header line", id="deep-header"),
    pytest.param(_deep_body, "nests deeper", id="deep-body"),
    pytest.param(_deep_value, "nests deeper", id="deep-inline-value"),
    pytest.param(_misaligned, "not a multiple", id="offset-not-multiple-of-itemsize"),
    pytest.param(_set_object("py.nan", ["float", "nan:00"]), "'py.nan'", id="float-nan-short"),
    pytest.param(_set_object("py.x", ["float", "0x1p99999"]), "too large", id="float-overflow"),
    pytest.param(_set_object("py.dev", ["device", "cuda:abc"]), "device", id="device-malformed"),
    pytest.param(_set_tensor("h", kind="numpy"), "cannot hold dtype bfloat16", id="bf16-as-numpy"),
    pytest.param(_set_tensor("f8", kind="bytes"), "1-D uint8", id="fp8-as-bytes"),
    pytest.param(_huge_shape, "1099511627776 elements", id="shape-far-larger-than-chunks"),
    pytest.param(_set_tensor("w", dtype=["float32"]), "dtype must be a string", id="dtype-not-str"),
    pytest.param(_set_tensor("w", dtype={"a": 1}), "dtype must be a string", id="dtype-dict"),
]


@pytest.mark.parametrize("change,says", REGRESSIONS)
def test_hostile_class_raises_manifest_error_naming_the_field(ck, victim, change, says):
    """Each class, its data checksums recomputed (only the manifest's structure can refuse it):
    load (fresh, unverified, in place) and verify raise ManifestError naming the field;
    verify's message names the manifest and the fix."""
    write_manifest(victim.path, _mutated(victim, change, data_too=True))
    try:
        with guarded(victim.path):
            for call in (ck.load, lambda p: ck.load(p, verify=False),
                         lambda p: ck.load(p, make_state())):
                with pytest.raises(ManifestError) as info:
                    call(victim.path)
                assert says in str(info.value), str(info.value)
            with pytest.raises(ManifestError) as info:
                ck.verify(victim.path)
        message = str(info.value)
        assert says in message and str(victim.path / manifest.MANIFEST_NAME) in message, message
        assert "load an earlier" in message, message
    finally:
        victim.restore()


def test_misaligned_offset_is_refused_with_matching_checksums(victim):
    """With the checksum recomputed the shifted bytes are 'intact': only the alignment rule
    keeps them from a view as float32 at an offset that is not a multiple of 4."""
    forged = _mutated(victim, _misaligned, data_too=True)
    assert entry(split(forged), "w")["checksum"] != entry(victim.body, "w")["checksum"]
    with pytest.raises(ManifestError, match="'w'.*offset .* not a multiple of the 4-byte"):
        manifest.decode(forged, "m")


def test_huge_shape_is_refused_before_any_allocation(victim, tmp_path):
    """In a process whose address space cannot hold the claimed tensor (4 GiB), a manifest
    claiming it is refused by the decoder, not by a failed or lazy allocation."""
    path = tmp_path / "c"
    shutil.copytree(victim.path, path)

    def claim(body: dict[str, Any]) -> None:
        entry(body, "w").update(shape=[1 << 30], chunk={"offsets": [0], "sizes": [128]})

    forged = _mutated(victim, claim, data_too=True)
    script = textwrap.dedent(f"""
        import resource, sys
        sys.path[:0] = {sys.path!r}
        import ckptio, torch
        from ckptio import ManifestError
        ckptio.load({str(path)!r})  # warm: pool, threads, lazy imports
        vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))
        try:
            torch.empty(1 << 30, dtype=torch.float32)
        except RuntimeError:
            print("limit-holds")
        ckptio.load({str(path)!r})
        open({str(path / manifest.MANIFEST_NAME)!r}, "wb").write({forged!r})
        try:
            ckptio.load({str(path)!r})
        except ManifestError as exc:
            print("refused:", exc)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "limit-holds" in result.stdout, "the address-space limit must stop a 4 GiB tensor"
    assert "refused:" in result.stdout and "1073741824 elements" in result.stdout, result.stdout


def test_file_names_outside_the_checkpoint_are_refused_before_any_open(ck, victim, tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(next(iter(victim.data.values())))
    for name in (str(outside), "../outside.bin", "..", "sub/x.bin", "a\\b"):
        def rename(body: dict[str, Any], name: str = name) -> None:
            old = body["files"][0]["name"]
            body["files"][0]["name"] = name
            for t in body["tensors"]:
                if t["file"] == old:
                    t["file"] = name

        write_manifest(victim.path, _mutated(victim, rename))
        try:
            with guarded(victim.path) as opened:
                for call in (ck.load, ck.verify):
                    with pytest.raises(ManifestError, match="not a plain file name"):
                        call(victim.path)
            assert opened == [str(victim.path / manifest.MANIFEST_NAME)] * 2, opened
        finally:
            victim.restore()


def test_kind_forged_to_pickle_is_refused_without_unpickling(ck, victim):
    """A bytes entry relabelled 'pickle' (valid: uint8, 1-D) is refused by load unless
    allow_pickle=True; verify passes it (its bytes are intact) but never unpickles either."""
    write_manifest(victim.path, _mutated(victim, _set_tensor("blob", kind="pickle")))
    try:
        with guarded(victim.path):
            with pytest.raises(PickleRefusedError, match="blob"):
                ck.load(victim.path)
            assert ck.verify(victim.path) > 0
    finally:
        victim.restore()


# --------------------------------------------------------------------------------------------
# verify is as strict as load


def test_verify_refuses_chunks_that_do_not_cover_their_tensor(ck, victim):
    body = copy.deepcopy(victim.variants["rows"])
    body["tensors"].remove(next(t for t in body["tensors"]
                                if t["key"] == "w" and t["chunk"]["offsets"] == [4, 0]))
    write_manifest(victim.path, wrap(body))
    try:
        for call in (ck.verify, ck.load):
            with pytest.raises(ManifestError, match="'w'.*64 of the 128 elements"):
                call(victim.path)
    finally:
        victim.restore()


def test_verify_refuses_a_wrong_block_checksum_that_a_partial_load_would_hit(ck, victim):
    """The last flat chunk of "big" has block checksums, which the assembling load checks: a
    wrong one fails that load, and verify. On the whole entry of the plain layout a load reads
    the entry whole: under xxh3_64_tree (the default) its whole checksum is of the blocks', so
    that load fails too, naming the block (under xxh3_64 it passed and only verify refused)."""
    for variant in ("flat", "plain"):
        body = copy.deepcopy(victim.variants[variant])
        big = [t for t in body["tensors"] if t["key"] == "big" and t.get("blocks")][-1]
        big["blocks"][1] = "0123456789abcdef"
        write_manifest(victim.path, wrap(body))
        try:
            with pytest.raises(CorruptCheckpointError, match="block checksum 1 of key 'big'"):
                ck.verify(victim.path)
            with pytest.raises(CorruptCheckpointError,
                               match="(checksum mismatch for|block checksum 1 of) key 'big'"):
                ck.load(victim.path)
        finally:
            victim.restore()


@pytest.mark.parametrize("value", [["float", "nan:00"], ["device", "cuda:abc"], ["size", [-1]],
                                   ["int", "12"], ["dtype", "_dynamo"], ["none", 0], 5])
def test_verify_decodes_every_inline_value(ck, victim, value):
    write_manifest(victim.path, _mutated(victim, _set_object("py.s", value)))
    try:
        with pytest.raises(ManifestError, match="'py.s'"):
            ck.verify(victim.path)
        with pytest.raises(ManifestError, match="'py.s'"):
            ck.load(victim.path)
    finally:
        victim.restore()

