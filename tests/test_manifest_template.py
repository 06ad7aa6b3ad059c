"""A save whose plan is reused does not encode its manifest's body in full: its layout's
template (format/splice.py) gets only the per-save fields (save id, file names, checksums,
block checksums, objects, meta), and the bytes are those of the full encoding. For a state of
thousands of tensors the full encoding held the interpreter on the save's thread in one C
stretch per save of a training loop (docs/BENCH_LOOP.md sections 17 and 18). Anything else
that differs (a key, a shape, an offset, the tree, an int that became a bool) is encoded by
its own template or in full, never by the last one."""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio.format import manifest, splice
from ckptio.format.types import Chunk, FileInfo, Manifest, ObjectEntry, Stored, TensorEntry


_DUMPS = json.dumps  # the reference's, not counted by full_encodes


_TEMPLATES: list[splice.Templates] = []  # the test's own (one saver's)


@pytest.fixture(autouse=True)
def fresh_templates() -> Iterator[None]:
    """No template of another test's layouts: each test encodes with a saver's fresh ones."""
    _TEMPLATES[:] = [splice.Templates()]
    yield
    _TEMPLATES.clear()


def _full(m: Manifest) -> bytes:
    """The manifest's bytes encoded in full (the reference)."""
    body = _DUMPS(splice.body_json(m), separators=(",", ":"), allow_nan=False).encode()
    header = {"magic": manifest.MAGIC, "version": m.version, "body_nbytes": len(body),
              "body_crc32": zlib.crc32(body)}
    return _DUMPS(header).encode() + b"\n" + body + b"\n"


@pytest.fixture
def full_encodes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The save ids of the manifest bodies json.dumps encoded in full (a template's marked body
    does not count)."""
    seen: list[str] = []
    real = json.dumps

    def counting(value: Any, *args: Any, **kwargs: Any) -> str:
        if isinstance(value, dict) and "tensors" in value and value["save_id"][:1] != "\x00":
            seen.append(value["save_id"])
        return real(value, *args, **kwargs)
    monkeypatch.setattr(json, "dumps", counting)
    return seen


@pytest.fixture
def written(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Manifest, bytes]]:
    """Each manifest a save encodes, with its bytes."""
    out: list[tuple[Manifest, bytes]] = []
    real = manifest.encode

    def recording(m: Manifest, templates: splice.Templates | None = None) -> bytes:
        data = real(m, templates)
        out.append((m, data))
        return data
    monkeypatch.setattr(manifest, "encode", recording)
    return out


def _state(step: int, extra: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    tied = torch.randn(4, 3, generator=g)
    state: dict[str, Any] = {
        "model": {"w": tied, "tied": tied, "b": torch.randn(3, generator=g).to(torch.bfloat16),
                  "idx": torch.arange(6, dtype=torch.int64) * step, "flag": torch.ones(2) > 0,
                  "none": torch.empty(0, 3), "big": torch.randn(300_000, generator=g)},
        "opt": {"state": {0: {"step": torch.tensor(float(step)), "m": torch.randn(5, generator=g)}},
                "groups": [{"lr": 0.1 / (step + 1), "betas": (0.9, 0.99), "name": f"g{step}"}]},
        "step": step, "done": step % 2 == 0, "note": None, "tag": "ü-" * step,
    }
    if extra:
        state["model"]["extra"] = torch.ones(7, dtype=torch.float16)
    return state


def test_steady_saves_splice_and_write_the_full_bytes(
        tmp_path: Path, full_encodes: list[str], written: list[tuple[Manifest, bytes]]) -> None:
    with ckptio.CheckpointManager(tmp_path / "run", keep_last=2) as mgr:
        for step in range(1, 7):
            mgr.save(step, _state(step), asynchronous=step % 2 == 1)
        mgr.wait()
        assert len(written) == 6
        # the first save of the layout is encoded in full, the second makes the template
        # (checked against the full encoding once), the rest only splice
        assert full_encodes == [m.save_id for m, _ in written[:2]]
        for m, data in written:
            assert data == _full(m)
        assert {entry.blocks != () for entry in written[-1][0].tensors} == {True, False}
        mgr.save(7, _state(7, extra=True))  # another plan: a new layout, encoded in full
        assert full_encodes[-1] == written[-1][0].save_id and written[-1][1] == _full(written[-1][0])
    back = _state(0, extra=True)
    with ckptio.CheckpointManager(tmp_path / "run") as again:
        assert again.restore(back) == 7
    assert back["step"] == 7 and back["tag"] == "ü-" * 7
    assert torch.equal(back["model"]["idx"], torch.arange(6) * 7)


A, B, C, D = (c * 16 for c in "abcd")


def _entry(key: str, offset: int, checksum: str = "0123456789abcdef",
           blocks: tuple[str, ...] = (), file: str = "data-a-r00000.bin") -> TensorEntry:
    shape = (4, 8) if blocks else (4,)
    return TensorEntry(key, "tensor", "float32", shape, Chunk.whole(shape), file, offset,
                       128 if blocks else 16, checksum, blocks=blocks)


def _manifest(save_id: str, **changes: Any) -> Manifest:
    m = Manifest(version=3, save_id=save_id, checksum_algorithm="xxh3_64_tree", world_size=1,
                 files=(FileInfo(f"data-{save_id}-r00000.bin", 8192, 0),),
                 tensors=(_entry("w", 0, file=f"data-{save_id}-r00000.bin"),
                          _entry("v", 128, blocks=(A, B), file=f"data-{save_id}-r00000.bin")),
                 objects=(ObjectEntry("step", ["int", 7]),), aliases=(("t", "w"),),
                 tree={"d": [["w", {"k": "w"}], ["v", {"k": "v"}], ["t", {"k": "t"}],
                             ["step", {"k": "step"}]]},
                 meta={"created_unix": 1.5}, block_nbytes=64)
    return dataclasses.replace(m, **changes)


def _encoded(m: Manifest, readable: bool = True) -> bytes:
    """``m``'s bytes, checked to be its full encoding (and, ``readable``, to decode to it)."""
    data = manifest.encode(m, _TEMPLATES[0])
    assert data == _full(m)
    if readable:
        assert manifest.decode(data, "x") == m
    return data


def test_what_a_template_does_not_splice_makes_another(full_encodes: list[str]) -> None:
    base = _manifest("a")
    for _ in range(3):  # in full, then the template made (checked against the full text once)
        _encoded(base)
    assert full_encodes == ["a", "a"]
    # per-save fields change freely under the template: nothing encoded in full
    for n, sums in enumerate([(C, D), (D, A)]):
        name = f"data-k{n}-r00000.bin"
        _encoded(_manifest(f"k{n}", tensors=(_entry("w", 0, checksum=f"{n:016x}", file=name),
                                             _entry("v", 128, blocks=sums, file=name)),
                           objects=(ObjectEntry("step", ["int", 8 + n]),),
                           meta={"created_unix": 2.5}))
    assert full_encodes == ["a", "a"]
    tensors = base.tensors
    variants = [  # each is a layout of its own: a template of its own (none for a coded entry)
        _manifest("b", tensors=(tensors[0], dataclasses.replace(tensors[1], offset=256))),
        _manifest("c", tensors=(tensors[0], dataclasses.replace(tensors[1], shape=(True, 8)))),
        _manifest("d", tensors=(tensors[0], dataclasses.replace(tensors[1], blocks=()))),
        _manifest("e", tensors=(tensors[0], dataclasses.replace(tensors[1], rank=0))),
        _manifest("f", files=(FileInfo("data-f-r00000.bin", 4096, 0),)),
        _manifest("g", aliases=()),
        _manifest("h", block_nbytes=128),
        _manifest("i", tree={**base.tree, "d": [*base.tree["d"], ["x", {"k": "x"}]]}),
        _manifest("j", tensors=(tensors[0], dataclasses.replace(
            tensors[1], stored=Stored("zstd", 100, (60, 40)))), version=4),
    ]
    for m in variants:
        for _ in range(3):
            _encoded(m, readable=False)
        # no template for a coded entry, nor for a bool where an int belongs (not immutable
        # as far as the template's check goes: encoded in full every time)
        assert full_encodes[2:].count(m.save_id) == (3 if m.save_id in "cj" else 2)
    for _ in range(3):  # the base's template was dropped for the later ones: made again
        _encoded(dataclasses.replace(base, save_id="z"))
    assert full_encodes.count("z") == 2


def test_a_tree_changed_in_place_is_seen() -> None:
    m = _manifest("a")
    for _ in range(3):
        _encoded(m)
    m.tree["d"][0][0] = "W"  # the same object, another text
    assert b'"W"' in _encoded(m)


def test_a_marker_in_the_fixed_text_makes_no_template(full_encodes: list[str]) -> None:
    m = _manifest("a", aliases=(("\x00ckptio-splice:F", "w"),),
                  tree={"d": [["w", {"k": "w"}], ["v", {"k": "v"}],
                              ["t", {"k": "\x00ckptio-splice:F"}], ["step", {"k": "step"}]]})
    for _ in range(3):
        _encoded(m)
    assert full_encodes == ["a"] * 3


def test_equal_entries_of_new_objects_use_the_template(full_encodes: list[str]) -> None:
    for n in range(4):  # a plan made again each save: equal fields, new objects
        m = _manifest(f"s{n}")
        m = dataclasses.replace(m, tensors=tuple(dataclasses.replace(t, shape=tuple(list(t.shape)))
                                                 for t in m.tensors))
        _encoded(m)
    assert full_encodes == ["s0", "s1"]  # the first in full, the second's template checked
