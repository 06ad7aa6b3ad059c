"""Red team of ckptio's interop with other formats, both ways: a Hugging Face export that
transformers loads (tied embeddings), that export loaded back into a plain and an FSDP2 model,
DCP directories written by torch.distributed.checkpoint on two gloo ranks, torch.save files and
DCP metadata holding a pickle that would run code, damaged safetensors headers, a DCP directory
missing a data file, exports into a directory holding the user's files or onto a read-only
file system, names with spaces and non-ASCII letters. Each refusal is a CkptError naming the
file (or key) and the fix; nothing of the user's is deleted and nothing unpickled."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio.testing.rank_processes import run_ranks


class Tied(torch.nn.Module):
    """An embedding and an output layer sharing one weight, as a language model ties them."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(rows, 4)
        self.head = torch.nn.Linear(4, rows, bias=False)
        self.head.weight = self.emb.weight


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _fsdp_tied(rows: int, world: int) -> Tied:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Tied(rows)
    torch.nn.init.zeros_(model.emb.weight)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model


def load_fsdp_tied(rank: int, world: int, path: str, rows: int) -> dict[str, Any]:
    """Load ``path`` in place into an FSDP2 model whose head is tied to its embedding ->
    {"error": (type, message) or None, "full": each key's full tensor bytes}."""
    model = _fsdp_tied(rows, world)
    error = None
    try:
        ckptio.load(path, model.state_dict())
    except ckptio.CkptError as exc:
        error = (type(exc).__name__, str(exc))
    full = {k: _bits(v.full_tensor()) for k, v in model.state_dict().items()}
    return {"error": error, "full": full}


def save_dcp_sharded(rank: int, world: int, path: str) -> None:
    """dcp.save of a row-sharded DTensor, a bf16 and a float8 tensor and Python values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _mixed()
    state = {**full, "w": distribute_tensor(full["w"], mesh, [Shard(0)])}
    dcp.save(state, checkpoint_id=path)


def load_dcp_resharded(rank: int, world: int, path: str, through_dcp: bool) -> bytes:
    """Load ``path`` into the weight sharded by columns (ckptio.load, or dcp.load through
    ckptio.DcpReader) -> the full weight's bytes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    into = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in _mixed().items()}
    into["w"] = distribute_tensor(torch.zeros(8, 6), mesh, [Shard(1)])
    if through_dcp:
        dcp.load(into, storage_reader=ckptio.DcpReader(path))
    else:
        ckptio.load(path, into)
    want = _mixed()
    assert all(_bits(into[k]) == _bits(want[k]) for k in ("b16", "f8")), "values"
    return _bits(into["w"].full_tensor())


def _mixed() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(8, 6, generator=g),
            "b16": torch.randn(5, generator=g).to(torch.bfloat16),
            "f8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn), "step": 3}


@pytest.mark.parametrize("rows", [8, 1])
def test_an_hf_export_loads_into_an_fsdp2_model_whose_head_is_tied(tmp_path: Path,
                                                                  rows: int) -> None:
    """The guide's round trip on FSDP2: the export leaves out the tied head, and loading it in
    place into ``model.state_dict()`` of an FSDP2 model fills the head through its tie, as for
    a plain model (one row on two ranks: one rank's shard is empty); it was refused as missing
    from the checkpoint."""
    torch.manual_seed(0)
    model = Tied(rows)
    ckptio.save({"model": model.state_dict()}, str(tmp_path / "ck"))
    hf = str(tmp_path / "hf")
    assert ckptio.export_hf(str(tmp_path / "ck"), hf).dropped == ("model.head.weight",)
    for got in run_ranks(2, load_fsdp_tied, hf, rows):
        assert got["error"] is None, got["error"]
        assert got["full"] == {k: _bits(v) for k, v in model.state_dict().items()}


def test_an_fsdp2_tied_state_refuses_a_checkpoint_holding_the_two_keys_apart(
        tmp_path: Path) -> None:
    """A checkpoint holding different values for the two keys an FSDP2 model ties (saved
    untied) is refused naming both keys, as for a plain model; it loaded both into the one
    tensor, which silently held the second key's values under the first."""
    torch.manual_seed(0)
    untied = {"emb.weight": torch.randn(8, 4), "head.weight": torch.randn(8, 4)}
    path = str(tmp_path / "untied")
    ckptio.save(untied, path)
    for got in run_ranks(2, load_fsdp_tied, path, 8):
        assert got["error"] is not None, "loaded one tensor with two different values"
        kind, message = got["error"]
        assert kind == "StateMismatchError" and "emb.weight" in message, message
        assert "head.weight" in message and "untie" in message, message


def _gpt2() -> Any:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        x = torch.randint(0, 64, (2, 8))
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_a_trained_gpt2_exports_for_from_pretrained_bitwise_with_its_tie(tmp_path: Path) -> None:
    """A few training steps, ckptio.save, export_hf with the config copied along (into a
    folder named with a space and non-ASCII letters): from_pretrained gives every tensor
    bitwise, its head tied again; the export loads back into a fresh model the same way."""
    import transformers

    model, opt = _gpt2()
    src, cfg, hf = (str(tmp_path / n) for n in ("ck", "cfg", "hf ü out"))
    ckptio.save({"model": model, "optim": opt, "step": 2}, src)
    model.config.save_pretrained(cfg)
    done = ckptio.export_hf(src, hf, copy_from=cfg)
    assert done.dropped == ("model.lm_head.weight",)
    back = transformers.AutoModelForCausalLM.from_pretrained(hf)
    want = {k: _bits(v) for k, v in model.state_dict().items()}
    assert {k: _bits(v) for k, v in back.state_dict().items()} == want
    assert back.lm_head.weight.data_ptr() == back.transformer.wte.weight.data_ptr()
    fresh = transformers.GPT2LMHeadModel(model.config)
    ckptio.load(hf, fresh)
    assert {k: _bits(v) for k, v in fresh.state_dict().items()} == want


def test_an_export_loaded_into_the_state_under_model_names_the_fix(tmp_path: Path) -> None:
    """An export (names without 'model.') loaded into {"model": model}, and a checkpoint of
    {"model": ...} loaded into the model itself: refused, saying which entry the keys are under
    and how to load them, not 'strict=False' (which would load nothing)."""
    torch.manual_seed(0)
    model = Tied(8)
    src, hf = str(tmp_path / "ck"), str(tmp_path / "hf")
    ckptio.save({"model": model, "step": 1}, src)
    ckptio.export_hf(src, hf)
    with pytest.raises(ckptio.StateMismatchError) as err:
        ckptio.load(hf, {"model": Tied(8)})
    assert "under 'model'" in str(err.value) and "ckptio.load(path, model)" in str(err.value)
    assert "strict=False" not in str(err.value)
    with pytest.raises(ckptio.StateMismatchError) as err:
        ckptio.load(src, Tied(8))
    assert "keys=['model']" in str(err.value) and "strict=False" not in str(err.value)
    into = Tied(8)
    ckptio.load(src, {"model": into}, keys=["model"])
    assert _bits(into.emb.weight) == _bits(model.emb.weight)


def test_load_keys_with_export_hfs_trailing_dot_names_the_fix(tmp_path: Path) -> None:
    """export_hf's keys= is a prefix ('model.'); load's names an entry: keys='model.' selects
    nothing, and the refusal says to drop the dot."""
    path = str(tmp_path / "ck")
    ckptio.save({"model": {"w": torch.ones(2)}, "step": 1}, path)
    with pytest.raises(ckptio.StateMismatchError) as err:
        ckptio.load(path, {"model": {"w": torch.zeros(2)}}, keys="model.")
    assert "keys=['model']" in str(err.value), str(err.value)


def test_dcp_written_on_two_ranks_and_ckptio_read_each_other_resharded(tmp_path: Path) -> None:
    """dcp.save on two gloo ranks (row shards, bf16, float8, a value) is read by ckptio into
    column shards and whole; ckptio's save of it is read by dcp.load through DcpReader."""
    path = str(tmp_path / "dcp dir ü")
    run_ranks(2, save_dcp_sharded, path)
    want = _bits(_mixed()["w"])
    assert run_ranks(2, load_dcp_resharded, path, False) == [want, want]
    whole = ckptio.load(path)
    assert whole["step"] == 3 and whole["f8"].dtype == torch.float8_e4m3fn
    assert _bits(whole["f8"]) == _bits(_mixed()["f8"]) and _bits(whole["w"]) == want
    ours = str(tmp_path / "ours")
    ckptio.save(whole, ours)
    assert run_ranks(2, load_dcp_resharded, ours, True) == [want, want]


class _Runs:
    """A pickled object that would create ``mark`` if it were ever unpickled."""

    def __init__(self, mark: str) -> None:
        self.mark = mark

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch '{self.mark}'",))


def test_no_default_load_unpickles_a_torch_save_file_or_dcp_metadata(tmp_path: Path) -> None:
    """A torch.save file holding a code-running object and DCP metadata replaced by one: load,
    verify, export and the CLI refuse them (PickleRefusedError naming the file and the opt-in)
    and nothing runs."""
    import torch.distributed.checkpoint as dcp

    mark = str(tmp_path / "ran")
    pt = str(tmp_path / "evil.pt")
    torch.save({"a": torch.ones(3), "obj": _Runs(mark)}, pt)
    meta = str(tmp_path / "dcp")
    dcp.save({"a": torch.ones(3)}, checkpoint_id=meta, no_dist=True)
    with open(os.path.join(meta, ".metadata"), "wb") as f:
        pickle.dump(_Runs(mark), f)
    for path, file in ((pt, "evil.pt"), (meta, ".metadata")):
        for call in (lambda: ckptio.load(path), lambda: ckptio.load(path, {"a": torch.zeros(3)}),
                     lambda: ckptio.verify(path),
                     lambda: ckptio.export_hf(path, str(tmp_path / "hf"), keys=None)):
            with pytest.raises(ckptio.PickleRefusedError) as err:
                call()
            assert file in str(err.value) and "trust" in str(err.value)
        cli = subprocess.run([sys.executable, "-m", "ckptio", "ls", path], capture_output=True,
                             text=True, timeout=120)
        assert cli.returncode == 2 and file in cli.stderr and "Traceback" not in cli.stderr
    assert not os.path.exists(mark)


def _safetensors(path: str) -> tuple[bytes, int]:
    st = pytest.importorskip("safetensors.torch")
    st.save_file({"a": torch.randn(4, 4), "b": torch.randn(3).to(torch.bfloat16)}, path)
    with open(path, "rb") as f:
        raw = f.read()
    return raw, struct.unpack("<Q", raw[:8])[0]


def test_damaged_safetensors_headers_are_refused_naming_the_file(tmp_path: Path) -> None:
    """Cut inside the length, inside the header, in the data; bad JSON; a huge length; an
    offset out of the file: CorruptCheckpointError naming the file, by load and verify."""
    good = str(tmp_path / "good name ü.safetensors")
    raw, n = _safetensors(good)
    header = json.loads(raw[8:8 + n])
    header["a"]["data_offsets"] = [0, 10 ** 6]
    moved = json.dumps(header).encode()
    cases = {"short": raw[:4], "header": raw[:8 + n // 2], "data": raw[:-5],
             "json": raw[:8] + b"!" + raw[9:], "huge": struct.pack("<Q", 1 << 62) + raw[8:],
             "offset": struct.pack("<Q", len(moved)) + moved + raw[8 + n:]}
    for name, data in cases.items():
        path = tmp_path / f"{name} ü.safetensors"
        path.write_bytes(data)
        for call in (ckptio.load, ckptio.verify):
            with pytest.raises(ckptio.CorruptCheckpointError) as err:
                call(str(path))
            assert str(path) in str(err.value), (name, str(err.value))


def test_a_dcp_directory_missing_a_data_file_is_refused_naming_it(tmp_path: Path) -> None:
    """A DCP directory whose data file is gone, or cut short: CorruptCheckpointError naming
    the file and to load an earlier checkpoint, for a fresh and an in-place load."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "dcp")
    dcp.save({"a": torch.randn(5), "b": torch.randn(3)}, checkpoint_id=path, no_dist=True)
    data = os.path.join(path, "__0_0.distcp")
    shutil.move(data, str(tmp_path / "aside"))
    for call in (lambda: ckptio.load(path), lambda: ckptio.load(path, {"a": torch.zeros(5)})):
        with pytest.raises(ckptio.CorruptCheckpointError) as err:
            call()
        assert "__0_0.distcp" in str(err.value) and "earlier" in str(err.value)
    shutil.move(str(tmp_path / "aside"), data)
    os.truncate(data, os.path.getsize(data) - 30)
    with pytest.raises(ckptio.CorruptCheckpointError, match="__0_0.distcp is truncated"):
        ckptio.load(path)


def test_an_export_over_the_users_files_keeps_them(tmp_path: Path) -> None:
    """A destination holding the user's README and a subfolder: refused without overwrite
    (naming the fix); with it the export is replaced and the user's files are left."""
    src, dst = str(tmp_path / "ck"), tmp_path / "hf"
    ckptio.save({"model": {"w": torch.randn(4, 4)}}, src)
    (dst / "sub").mkdir(parents=True)
    (dst / "README.md").write_text("mine")
    (dst / "sub" / "notes.txt").write_text("mine")
    with pytest.raises(ckptio.CkptError, match="overwrite=True"):
        ckptio.export_hf(src, str(dst))
    ckptio.export_hf(src, str(dst), overwrite=True)
    ckptio.export_hf(src, str(dst), overwrite=True)
    assert (dst / "README.md").read_text() == "mine"
    assert (dst / "sub" / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(dst)) == ["README.md", "model.safetensors", "sub"]


def test_an_export_with_overwrite_removes_only_an_exports_own_weight_files(
        tmp_path: Path) -> None:
    """overwrite=True into a PEFT-style folder: the old export's shards go, the user's other
    safetensors files (adapter_model.safetensors) stay; every top-level .safetensors file was
    deleted."""
    src, dst = str(tmp_path / "ck"), tmp_path / "hf"
    ckptio.save({"model": {"w": torch.randn(4, 4)}}, src)
    dst.mkdir()
    mine = ("adapter_model.safetensors", "ema.safetensors", "model-final.safetensors",
            "pytorch_model.bin")
    for name in (*mine, "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (dst / name).write_bytes(b"the user's")
    ckptio.export_hf(src, str(dst), overwrite=True)
    assert sorted(os.listdir(dst)) == sorted((*mine, "model.safetensors"))
    assert all((dst / name).read_bytes() == b"the user's" for name in mine)


@contextmanager
def _read_only_mount(where: Path) -> Iterator[None]:
    """``where`` an empty read-only tmpfs (root and mount(8)); skips where it cannot be."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a read-only mount needs root and mount(8)")
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro",
                           f"ckptio-rtinterop-{uuid.uuid4().hex[:6]}", str(where)],
                          capture_output=True, text=True, check=False, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


def test_an_export_onto_a_read_only_file_system_names_the_path(tmp_path: Path) -> None:
    """export_hf and convert onto a read-only file system (into it, and a new folder in it):
    a StorageIOError naming the path and the cause, never an OSError."""
    from ckptio.convert import convert

    src, ro = str(tmp_path / "ck"), tmp_path / "ro"
    ckptio.save({"model": {"w": torch.randn(4, 4)}, "step": 1}, src)
    with _read_only_mount(ro):
        calls = {str(ro): lambda: ckptio.export_hf(src, str(ro)),
                 str(ro / "new"): lambda: ckptio.export_hf(src, str(ro / "new")),
                 str(ro / "x.pt"): lambda: convert(src, str(ro / "x.pt"), to="torch.save"),
                 str(ro / "x.dcp"): lambda: convert(src, str(ro / "x.dcp"), to="dcp")}
        for where, call in calls.items():
            with pytest.raises(ckptio.StorageIOError) as err:
                call()
            assert where in str(err.value) and "ead-only" in str(err.value), str(err.value)


def test_a_ckptio_save_into_a_dcp_checkpoint_is_refused_and_the_dcp_one_kept(
        tmp_path: Path) -> None:
    """ckptio.save (overwrite or not), async_save and dcp.save through DcpWriter into a
    directory holding a DCP checkpoint: refused naming it, nothing written, DCP's own reader
    still reads it; they wrote a manifest beside it, so dcp.load read the old values and
    ckptio.load the new ones."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = str(tmp_path / "dcp")
    dcp.save({"a": torch.zeros(3)}, checkpoint_id=path, no_dist=True)
    before = sorted(os.listdir(path))
    for save in (lambda: ckptio.save({"a": torch.ones(3)}, path),
                 lambda: _save_overwriting(path),
                 lambda: ckptio.async_save({"a": torch.ones(3)}, path).wait()):
        with pytest.raises(ckptio.CkptError) as err:
            save()
        assert path in str(err.value) and ".metadata" in str(err.value), str(err.value)
    for overwrite in (False, True):
        with pytest.raises(CheckpointException) as failed:
            dcp.save({"a": torch.ones(3)}, no_dist=True,
                     storage_writer=ckptio.DcpWriter(path, overwrite=overwrite))
        (cause, _trace), = failed.value.failures.values()
        assert isinstance(cause, ckptio.CkptError) and ".metadata" in str(cause), cause
        assert ("Checkpoint already exists" in str(cause)) is not overwrite
    assert sorted(os.listdir(path)) == before
    into = {"a": torch.full((3,), 7.0)}
    dcp.load(into, checkpoint_id=path, no_dist=True)
    assert torch.equal(into["a"], torch.zeros(3))


def _save_overwriting(path: str) -> None:
    with ckptio.Checkpointer() as checkpointer:
        checkpointer.save({"a": torch.ones(3)}, path, overwrite=True)


def test_a_dcp_save_over_a_ckptio_checkpoint_is_not_loaded_as_the_old_one(
        tmp_path: Path) -> None:
    """dcp.save (FileSystemWriter) into a ckptio checkpoint leaves both; ckptio.load refused
    naming both files and what to move, where it loaded the old ckptio values silently."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ck")
    ckptio.save({"a": torch.zeros(3)}, path)
    dcp.save({"a": torch.ones(3)}, checkpoint_id=path, no_dist=True)
    for call in (lambda: ckptio.load(path), lambda: ckptio.load(path, {"a": torch.zeros(3)}),
                 lambda: ckptio.verify(path)):
        with pytest.raises(ckptio.CkptError) as err:
            call()
        said = str(err.value)
        assert path in said and "manifest.json" in said and ".metadata" in said, said


def test_a_folder_with_a_single_file_its_index_does_not_name_is_refused(tmp_path: Path) -> None:
    """model.safetensors beside an index naming other shards (two exports in one folder):
    from_pretrained loads the single file, ckptio loaded the index's; now refused naming both
    and the fix, while each still loads by name."""
    st = pytest.importorskip("safetensors.torch")
    folder = tmp_path / "hf"
    folder.mkdir()
    st.save_file({"x": torch.ones(2)}, str(folder / "model.safetensors"))
    st.save_file({"x": torch.zeros(2)}, str(folder / "model-00001-of-00001.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"x": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(ckptio.CorruptCheckpointError) as err:
        ckptio.load(str(folder))
    assert "model.safetensors.index.json" in str(err.value) and "stale" in str(err.value)
    assert torch.equal(ckptio.load(str(folder / "model.safetensors"))["x"], torch.ones(2))
    index = str(folder / "model.safetensors.index.json")
    assert torch.equal(ckptio.load(index)["x"], torch.zeros(2))


def test_a_torch_layout_value_in_a_torch_save_file_is_refused_not_read_as_a_str(
        tmp_path: Path) -> None:
    """torch.save({"x": torch.strided}): ckptio.load returned the str 'strided' in its place
    (the stand-in DTensor rebuilds use); now refused naming the key and the fix."""
    path = str(tmp_path / "layout.pt")
    torch.save({"x": torch.strided, "t": torch.ones(2)}, path)
    with pytest.raises(ckptio.CkptError) as err:
        ckptio.load(path)
    assert "'x'" in str(err.value) and "torch.load" in str(err.value), str(err.value)
    assert ckptio.load(path, allow_pickle=True)["x"] is torch.strided


def test_a_ckptio_save_into_a_hugging_face_folder_is_refused_and_its_weights_kept(
        tmp_path: Path) -> None:
    """ckptio.save into a folder holding model.safetensors (or an index): refused naming it,
    the folder as it was; it wrote a manifest beside the weights, which from_pretrained went
    on reading while ckptio.load read the new state."""
    src = str(tmp_path / "ck")
    ckptio.save({"model": {"w": torch.ones(3)}}, src)
    for shard in (None, 8):
        folder = str(tmp_path / f"hf{shard}")
        ckptio.export_hf(src, folder, **({} if shard is None else {"max_shard_bytes": shard}))
        before = sorted(os.listdir(folder))
        with pytest.raises(ckptio.CkptError) as err:
            ckptio.save({"w": torch.zeros(3)}, folder)
        assert folder in str(err.value) and "from_pretrained" in str(err.value), str(err.value)
        assert sorted(os.listdir(folder)) == before
        assert torch.equal(ckptio.load(folder)["w"], torch.ones(3))
