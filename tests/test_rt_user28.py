"""A new user's trial of the save, load, conversion and CLI guides (the twenty-eighth session):
the misuses it found that said the wrong thing, or did the wrong thing, each now refused with
what to write instead. Each test fails on the code before."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckptio


def test_a_state_that_holds_itself_is_named_as_a_cycle(tmp_path: Path) -> None:
    """It was refused as "nests deeper than 256 levels" under a key of 1,300 characters."""
    looped: dict[str, object] = {"w": torch.ones(2)}
    looped["self"] = looped
    inner: list[object] = [1, {"y": None}]
    inner[1]["y"] = inner  # type: ignore[index]
    for state, key in ((looped, "self"), ({"x": inner}, "x.1.y")):
        with pytest.raises(ckptio.UnsupportedStateError,
                           match=rf"key '{key}' holds a container it is in \(the state refers "
                                 r"to itself\)"):
            ckptio.save(state, tmp_path / "ck")
    deep: dict[str, object] = {}
    node = deep
    for _ in range(300):
        node["n"] = {}
        node = node["n"]  # type: ignore[assignment]
    with pytest.raises(ckptio.UnsupportedStateError, match="nests deeper than") as info:
        ckptio.save(deep, tmp_path / "ck")
    assert len(str(info.value)) < 400
    shared = [1, 2]
    ckptio.save({"a": shared, "b": shared}, tmp_path / "ok")  # shared, not a cycle
    assert ckptio.load(tmp_path / "ok") == {"a": [1, 2], "b": [1, 2]}


def test_an_int_key_beside_the_same_str_key_is_named_so(tmp_path: Path) -> None:
    """{1: ..., "1": ...} was refused as "a dict key containing '.' collides"."""
    with pytest.raises(ckptio.UnsupportedStateError,
                       match=r"key 'v\.1' names two different leaves .*an int key with the same "
                             r"str key: 1 and '1'"):
        ckptio.save({"v": {1: "a", "1": "b"}}, tmp_path / "ck")


def test_an_empty_path_and_a_tilde_are_refused_not_made_folders(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """save(state, "~/ckpt") made a folder '~' in the working directory (a trap for a later
    rm -rf ~); save(state, "") said "the file is missing (removed or never written)"."""
    monkeypatch.chdir(tmp_path)
    state = {"w": torch.ones(2)}
    with pytest.raises(ckptio.UnsupportedPathError,
                       match=r"~/ckpt: begins with '~', which ckptio does not expand .*"
                             r"os\.path\.expanduser\('~/ckpt'\), or \./~/ckpt"):
        ckptio.save(state, "~/ckpt")
    with pytest.raises(ckptio.UnsupportedPathError, match="~: begins with"):
        ckptio.CheckpointManager("~")
    with pytest.raises(ckptio.UnsupportedPathError, match="an empty path"):
        ckptio.save(state, "")
    with pytest.raises(ckptio.UnsupportedPathError, match="an empty path"):
        ckptio.load("")
    assert os.listdir(tmp_path) == []
    ckptio.save(state, "./~/ckpt")  # a folder so named, asked for
    assert torch.equal(ckptio.load("./~/ckpt")["w"], state["w"])


def test_a_generator_is_refused_with_how_to_save_its_state(tmp_path: Path) -> None:
    """A DataLoader's torch.Generator was refused with "pass allow_pickle=True", and the
    pickled generator came back as a new object in place of the loader's own (its order not
    restored, nothing said). The refusal now says to save get_state() and call set_state()."""
    gen = torch.Generator().manual_seed(3)
    with pytest.raises(ckptio.UnsupportedStateError,
                       match=r"key 'loader\.gen': a torch\.Generator is saved as its state: put "
                             r"'gen': gen\.get_state\(\) .*gen\.set_state"):
        ckptio.save({"loader": {"gen": gen}}, tmp_path / "ck")
    ckptio.save({"loader": {"gen": gen.get_state()}}, tmp_path / "ck")  # as it says
    again = torch.Generator()
    again.set_state(ckptio.load(tmp_path / "ck")["loader"]["gen"])
    assert torch.equal(torch.rand(4, generator=again), torch.rand(4, generator=gen))


def test_a_dcp_item_damaged_at_its_start_is_named_damage_not_another_format(
        tmp_path: Path) -> None:
    """A byte flipped at the start of a DCP data file was "not a torch.save zip (DCP's
    serialization_format=SAFETENSORS, or another writer) ... load it with dcp.load": a plain
    CkptError with the wrong fix. Where the item begins its data file (no DCP format keeps an
    item there) it is CorruptCheckpointError; elsewhere both causes are named."""
    import pickle

    import torch.distributed.checkpoint as dcp

    dcp.save({"a": torch.randn(1000), "b": torch.randn(1000)}, checkpoint_id=str(tmp_path / "d"))
    meta = pickle.loads((tmp_path / "d" / ".metadata").read_bytes())
    starts = {k.fqn: (v.relative_path, v.offset) for k, v in meta.storage_data.items()}
    assert starts["a"][1] == 0 and starts["b"][1] > 0 and starts["a"][0] == starts["b"][0]
    data = tmp_path / "d" / starts["a"][0]
    good = data.read_bytes()
    for key, error, said in (
            ("a", ckptio.CorruptCheckpointError, r"\(item of key 'a'\) does not begin as a "
             r"torch\.save zip, and it begins its data file .*the data file is damaged"),
            ("b", ckptio.CkptError, r"\(item of key 'b'\) is not a torch\.save zip: its data "
             r"file is damaged .*or was written in DCP's serialization_format=SAFETENSORS")):
        raw = bytearray(good)
        raw[starts[key][1]] ^= 0xFF
        data.write_bytes(bytes(raw))
        with pytest.raises(error, match=said):
            ckptio.load(tmp_path / "d")
