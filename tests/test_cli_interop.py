"""The ``ckptio`` command as users type it (processes of their own importing this
checkout): ls (text, --json schema ckptio.ls/1, --depth), diff (exit codes, checksum and --data
paths), verify, convert (a DCP directory saved by torch.distributed.checkpoint, a torch.save
file), export (its arguments; a transformers model's state for real, read back by safetensors),
one-line errors, a closed pipe, progress bars on a terminal only, and that ls and
diff on ckptio checkpoints never import torch. docs/CLI.md documents what is checked here.
The commands run forked from a warm interpreter (``ckptio_cmd``), and as ``python -m ckptio``
in a fresh one where the interpreter is the point (imports, a closed pipe at exit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio import cli
from ckptio.cli import commands
from ckptio.testing.cli_process import run_cli
from conftest import ALL_DTYPES, assert_same
from special_values import bits_equal, specials
from test_cli_ls import _on_a_terminal

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def ckptio_cmd(*args: str) -> subprocess.CompletedProcess[str]:
    """``ckptio ARGS`` in a process of its own (stdout and stderr are pipes, not terminals),
    forked from a warm interpreter (ckptio.testing.cli_process; tests/test_cli_ls.py checks
    that it says what ``python -m ckptio`` says)."""
    return run_cli(*args, env=ENV)


def _one_line_error(done: subprocess.CompletedProcess[str], *phrases: str) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptio: error: "), done.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    return lines[0]


def _state(weight_shift: float = 0.0, step: int = 7) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight[0, 0] += weight_shift
    return {"model": model, "step": step,
            "meta": {"name": "run1", "betas": (0.9, 0.99), "dt": torch.bfloat16},
            "pair": (torch.arange(5), "x")}


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "a"
    ckptio.save(_state(), path)
    return path


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(path))


# ------------------------------------------------------------------------------------------------
# ls


def test_ls_prints_the_nested_tree_with_kinds_dtypes_shapes_and_values(saved: Path):
    done = ckptio_cmd("ls", str(saved))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"{saved}: ckptio checkpoint") and "xxh3_64" in lines[0]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert lines[2].split()[:2] == ["model*", "dict"]  # saved through its state_dict()
    assert lines[3].startswith("    weight") and rows["weight"].split()[1:5] == [
        "tensor", "float32", "[3,", "4]"] and rows["weight"].split()[5] == "48"
    assert rows["step"].split()[1:] == ["value", "7"]
    assert rows["name"].split()[1:] == ["value", "'run1'"]
    assert rows["dt"].split()[1:] == ["value", "torch.bfloat16"]
    assert [line.split()[:2] for line in lines if line.split()[0] in ("betas", "pair")] == [
        ["betas", "tuple"], ["pair", "tuple"]]
    flat = ckptio_cmd("ls", "--flat", str(saved)).stdout.splitlines()
    assert [line.split()[0] for line in flat[2:]] == [
        "model.weight", "model.bias", "step", "meta.name", "meta.betas.0", "meta.betas.1",
        "meta.dt", "pair.0", "pair.1"]
    shallow = ckptio_cmd("ls", str(saved), "--depth", "1").stdout.splitlines()
    assert [line.split()[0] for line in shallow[2:]] == ["model*", "step", "meta", "pair"]
    assert "2 leaves, not shown (--depth)" in shallow[2]


def test_ls_json_follows_schema_ckptio_ls_1(saved: Path):
    done = ckptio_cmd("ls", "--json", str(saved))
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert set(doc) == {"schema", "path", "format", "save_id", "world_size",
                        "checksum_algorithm", "nbytes", "files", "tree",
                        "stored_nbytes", "bases"}  # the last two: issue 28, a full step
    assert doc["bases"] == [] and doc["stored_nbytes"] == sum(f["nbytes"] for f in doc["files"])
    assert (doc["schema"], doc["format"], doc["world_size"], doc["checksum_algorithm"]) == (
        "ckptio.ls/1", "ckptio", 1, "xxh3_64_tree")
    assert doc["nbytes"] == 48 + 12 + 40 and doc["files"][0]["rank"] == 0
    root = doc["tree"]
    assert (root["name"], root["type"], root["leaves"], root["nbytes"]) == (None, "dict", 9, 100)
    model, step, meta, pair = root["children"]
    assert model["stateful"] is True and model["name"] == "model"
    assert model["children"][0] == {"name": "weight", "key": "model.weight", "type": "tensor",
                                    "dtype": "float32", "shape": [3, 4], "nbytes": 48,
                                    "chunks": 1, "ranks": None, "stored_nbytes": 48,
                                    "storage": ["raw"]}
    assert step == {"name": "step", "key": "step", "type": "value",
                    "values": [{"rank": None, "value": ["int", 7], "repr": "7"}]}
    betas = meta["children"][1]
    assert (betas["type"], [c["key"] for c in betas["children"]]) == (
        "tuple", ["meta.betas.0", "meta.betas.1"])
    assert meta["children"][2]["values"][0]["value"] == ["dtype", "bfloat16"]
    assert [c["name"] for c in pair["children"]] == [0, 1]
    shallow = json.loads(ckptio_cmd("ls", "--json", "--depth", "1", str(saved)).stdout)["tree"]
    assert shallow["children"][0]["truncated"] is True and "children" not in shallow["children"][0]
    assert shallow["children"][0]["leaves"] == 2 and shallow["children"][0]["nbytes"] == 60


def test_ls_reads_a_dcp_directory_and_a_torch_save_file(tmp_path: Path):
    state = {"model": {"w": torch.randn(4, 3), "b": torch.arange(3.0)}, "step": 5}
    _dcp_save(state, tmp_path / "dcp")
    torch.save(state, tmp_path / "model.pt")
    for path, kind in ((tmp_path / "dcp", "dcp"), (tmp_path / "model.pt", "torch.save")):
        done = ckptio_cmd("ls", "--json", str(path))
        assert done.returncode == 0, done.stderr
        doc = json.loads(done.stdout)
        assert (doc["format"], doc["checksum_algorithm"]) == (kind, "crc32")
        model, step = doc["tree"]["children"]
        assert [(c["key"], c["dtype"], c["shape"]) for c in model["children"]] == [
            ("model.w", "float32", [4, 3]), ("model.b", "float32", [3])]
        assert step["values"][0]["repr"] == "5"
    text = ckptio_cmd("ls", str(tmp_path / "dcp")).stdout
    assert text.startswith(f"{tmp_path / 'dcp'}: DCP checkpoint") and "model.w" not in text


def _imported_modules(*args: str) -> set[str]:
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "ckptio", *args],
                          capture_output=True, text=True, env=ENV, timeout=120, check=False)
    assert done.returncode in (0, 1), done.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


def test_ls_and_diff_on_ckptio_checkpoints_never_import_torch(saved: Path, tmp_path: Path):
    other = tmp_path / "b"
    ckptio.save(_state(step=8), other)
    for args in (("ls", str(saved)), ("ls", "--json", str(saved)),
                 ("diff", str(saved), str(other))):
        modules = _imported_modules(*args)
        assert "ckptio.format.manifest" in modules, args  # the check sees ckptio's imports
        assert "torch" not in modules and "numpy" not in modules, args
    assert "torch" in _imported_modules("ls", "--values", str(saved))


def test_import_ckptio_is_lazy_and_its_names_still_work():
    code = ("import sys, ckptio; assert 'torch' not in sys.modules; "
            "from ckptio import save, CkptError, AsyncSaveResult; "
            "assert ckptio.save is save and AsyncSaveResult is ckptio.SaveResult; "
            "assert set(ckptio.__all__) <= set(dir(ckptio)); print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV,
                          timeout=120, check=False)
    assert done.stdout.strip() == "ok", done.stderr
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        ckptio.nothing  # noqa: B018


# ------------------------------------------------------------------------------------------------
# diff


def test_diff_exit_codes_and_what_it_names(saved: Path, tmp_path: Path):
    same = ckptio_cmd("diff", str(saved), str(saved))
    assert (same.returncode, same.stdout.splitlines()[-1]) == (
        0, f"{saved} vs {saved}: the same (by stored checksums, data not read: --data reads "
        "and verifies it)")
    other = tmp_path / "b"
    state = _state(weight_shift=0.5, step=8)
    del state["pair"]
    state["extra"] = torch.zeros(2, dtype=torch.float16)
    state["meta"]["dt"] = torch.float32
    ckptio.save(state, other)
    done = ckptio_cmd("diff", str(saved), str(other))
    assert done.returncode == 1, done.stderr
    lines = {" ".join(line.split()[:2]): line for line in done.stdout.splitlines()[:-1]}
    assert "only in A: tensor int64 [5]" in lines["- pair.0"]
    assert "only in A: value 'x'" in lines["- pair.1"]
    assert "only in B: tensor float16 [2]" in lines["+ extra"]
    assert lines["~ step"].endswith("value 7 -> value 8")
    assert lines["~ meta.dt"].endswith("value torch.bfloat16 -> value torch.float32")
    assert lines["~ model.weight"].endswith("data differs (1 of 1 chunks' checksums)")
    assert "model.bias" not in done.stdout  # same checksum: the same, no data read
    assert set(lines) == {"- pair.0", "- pair.1", "+ extra", "~ step", "~ meta.dt",
                          "~ model.weight"}
    assert done.stdout.splitlines()[-1].endswith(": 6 difference(s)")


def test_diff_names_a_tuple_that_became_a_list(tmp_path: Path):
    ckptio.save({"p": (torch.ones(2), 3)}, tmp_path / "a")
    ckptio.save({"p": [torch.ones(2), 3]}, tmp_path / "b")
    done = ckptio_cmd("diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert done.returncode == 1
    assert [" ".join(line.split()) for line in done.stdout.splitlines()[:-1]] == [
        "~ p.0 nesting dict/tuple -> dict/list", "~ p.1 nesting dict/tuple -> dict/list"]


def test_diff_data_reports_max_abs_and_rel_differences(tmp_path: Path):
    a = torch.tensor([[1.0, 2.0, 4.0], [0.5, -1.0, 8.0]])
    b = a.clone()
    b[0, 2], b[1, 1] = 5.0, -0.75  # abs 1.0 (rel 0.2) and abs 0.25 (rel 1/3)
    ckptio.save({"w": a, "v": torch.ones(3)}, tmp_path / "a")
    ckptio.save({"w": b, "v": torch.ones(3)}, tmp_path / "b")
    done = ckptio_cmd("diff", "--data", str(tmp_path / "a"), str(tmp_path / "b"))
    assert done.returncode == 1 and done.stderr == "", done.stderr  # no bar into a pipe
    assert done.stdout.splitlines()[0].split() == [
        "~", "w", "data", "differs:", "max", "abs", "diff", "1,", "max", "rel", "diff",
        "0.333333", "(2", "of", "6", "elements)"]
    assert len(done.stdout.splitlines()) == 2


def test_diff_data_compares_large_tensors_a_slice_at_a_time(monkeypatch, tmp_path: Path,
                                                             capsys):
    """The same numbers when the comparison runs 3 elements at a time (bounded memory)."""
    from ckptio.cli import diff

    monkeypatch.setattr(diff, "SLICE", 3)
    a = torch.tensor([1.0, 2.0, 4.0, 0.5, -1.0, 8.0, 3.0])
    b = a.clone()
    b[2], b[4], b[6] = 5.0, -0.75, 0.0  # rel 0.2, 1/3 and inf (b is 0), in three slices
    ckptio.save({"w": a}, tmp_path / "a")
    ckptio.save({"w": b}, tmp_path / "b")
    assert cli.main(["diff", "--data", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert capsys.readouterr().out.splitlines()[0].split()[2:] == [
        "data", "differs:", "max", "abs", "diff", "3,", "max", "rel", "diff", "inf", "(3", "of",
        "7", "elements)"]


def test_diff_of_a_dcp_directory_and_its_conversion(tmp_path: Path):
    """Other checksums (crc32 vs xxh3_64_tree): compared by their data without --data (a small
    checkpoint: tests/test_cli_ls.py has the one line naming --data for a large one), and
    with it."""
    _dcp_save({"w": torch.randn(64, 8), "step": 3}, tmp_path / "dcp")
    assert ckptio_cmd("convert", str(tmp_path / "dcp"), str(tmp_path / "c")).returncode == 0
    plain = ckptio_cmd("diff", str(tmp_path / "dcp"), str(tmp_path / "c"))
    assert plain.returncode == 0 and "1 tensor(s) compared by their data (other checksum " \
        "algorithms (crc32 vs xxh3_64_tree))" in plain.stdout, plain.stdout
    sure = ckptio_cmd("diff", "--data", str(tmp_path / "dcp"), str(tmp_path / "c"))
    assert sure.returncode == 0 and sure.stdout.strip().endswith(
        ": the same (every tensor read, checksums verified)"), sure.stdout


def test_diff_data_of_a_damaged_copy_fails_loudly(saved: Path, tmp_path: Path):
    """A copy with one flipped data byte: the manifests agree, so plain diff says the same
    by stored checksums (and says the data was not read); --data reads it, and the checksum
    mismatch is a one-line error (exit 2), never "the same"."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    data = next(p for p in sorted(copy.iterdir()) if p.name.startswith("data-"))
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))
    plain = ckptio_cmd("diff", str(saved), str(copy))
    assert plain.returncode == 0 and "data not read" in plain.stdout
    done = ckptio_cmd("diff", "--data", str(saved), str(copy))
    assert done.returncode == 2 and "the same" not in done.stdout, done.stdout
    assert "checksum" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


# ------------------------------------------------------------------------------------------------
# convert, verify, export


def test_convert_a_dcp_directory_then_verify_and_load_bitwise(tmp_path: Path):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    state = {"model": model.state_dict(), "step": 11, "names": ["a", "b"]}
    _dcp_save(state, tmp_path / "dcp")
    dst = tmp_path / "ckpt"
    done = ckptio_cmd("convert", str(tmp_path / "dcp"), str(dst))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert (dst / "manifest.json").is_file()
    verified = ckptio_cmd("verify", str(dst))
    assert verified.returncode == 0 and ": OK" in verified.stdout, verified.stderr
    got = ckptio.load(dst)
    assert got["step"] == 11 and list(got["names"]) == ["a", "b"]
    for key, want in state["model"].items():
        assert got["model"][key].dtype == torch.bfloat16
        assert torch.equal(got["model"][key].view(torch.int16), want.view(torch.int16)), key
    before = (dst / "manifest.json").read_bytes()
    again = ckptio_cmd("convert", str(tmp_path / "dcp"), str(dst))
    _one_line_error(again, str(dst), "already holds a ckptio checkpoint", "--overwrite")
    assert (dst / "manifest.json").read_bytes() == before  # untouched
    over = ckptio_cmd("convert", "--overwrite", str(tmp_path / "dcp"), str(dst))
    assert over.returncode == 0 and (dst / "manifest.json").read_bytes() != before
    assert "about the checkpoint's size in RAM" in ckptio_cmd("convert", "--help").stdout


def test_verify_with_progress_reads_in_batches_and_still_finds_damage(monkeypatch,
                                                                      tmp_path: Path):
    from ckptio.loading import load_session

    monkeypatch.setattr(load_session, "VERIFY_BATCH_NBYTES", 64 << 10)  # 64 KiB batches
    state = {f"t{i}": torch.full((16 << 10,), float(i)) for i in range(6)}  # 64 KiB each
    ckptio.save(state, tmp_path / "c")
    checkpointer = ckptio.Checkpointer()
    calls: list[int] = []
    assert checkpointer.verify(tmp_path / "c", progress=calls.append) == sum(calls)
    assert len(calls) == 6 and sum(calls) >= 6 * (64 << 10)
    (data,) = (tmp_path / "c").glob("data-*")
    entry = json.loads((tmp_path / "c" / "manifest.json").read_bytes().split(b"\n", 1)[1])
    last = next(t for t in entry["tensors"] if t["key"] == "t5")
    with open(data, "r+b") as f:
        f.seek(last["offset"] + 100)
        byte = f.read(1)
        f.seek(last["offset"] + 100)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ckptio.CorruptCheckpointError, match="'t5'"):
        checkpointer.verify(tmp_path / "c", progress=calls.append)
    checkpointer.close()


def test_verify_a_torch_save_file(tmp_path: Path):
    torch.save({"w": torch.randn(16, 16)}, tmp_path / "m.pt")
    done = ckptio_cmd("verify", str(tmp_path / "m.pt"))
    assert done.returncode == 0 and ": OK" in done.stdout, done.stderr


def test_export_without_ckptio_export_is_one_line(monkeypatch, saved: Path, tmp_path: Path,
                                                  capsys):
    monkeypatch.setitem(sys.modules, "ckptio.export", None)  # as in a ckptio without it
    assert cli.main(["export", str(saved), str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err.strip() == (
        "ckptio: error: ckptio export: this ckptio has no Hugging Face export yet (no module "
        "ckptio.export); upgrade ckptio")


def _fake_export(monkeypatch) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """ckptio.export.export_hf recording its calls (its tests are tests/test_export*.py)."""
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def export_hf(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return types.SimpleNamespace(files=("model.safetensors",), total_size=60,
                                     total_parameters=15, dropped=("lm_head.weight",))

    fake = types.ModuleType("ckptio.export")
    fake.export_hf = export_hf  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ckptio.export", fake)
    return calls


def test_export_passes_its_arguments_to_export_hf(monkeypatch, saved: Path, tmp_path: Path,
                                                   capsys):
    calls = _fake_export(monkeypatch)
    status = cli.main(["export", str(saved), str(tmp_path / "hf"), "--keys", "model.",
                       "--rename", "weight=w", "--rename", "b=B", "--dtype", "bf16",
                       "--max-shard-size", "2GiB", "--copy-from", str(tmp_path),
                       "--overwrite", "--no-verify"])
    out = capsys.readouterr()
    assert status == 0 and out.err == ""
    assert out.out.strip() == (f"{saved} -> {tmp_path / 'hf'}: 1 safetensors file(s), 60 bytes, "
                               "15 parameters, tied alias(es) left out (from_pretrained ties them "
                               "again): lm_head.weight")
    ((args, kwargs),) = calls
    rename = kwargs.pop("rename")
    assert callable(kwargs.pop("progress"))  # the bar's (done, total) callback
    assert args == (str(saved), str(tmp_path / "hf")) and kwargs == {
        "keys": "model.", "dtype": "bfloat16", "max_shard_bytes": 2 * 2**30,
        "copy_from": str(tmp_path), "overwrite": True, "verify": False}
    assert [rename(n) for n in ("weight", "weight.x", "bias", "x.weight")] == [
        "w", "w.x", "Bias", "x.weight"]
    calls.clear()
    assert cli.main(["export", str(saved), str(tmp_path / "hf"), "--keys", "",
                     "--no-progress"]) == 0
    assert calls[0][1] == {"keys": None, "rename": None, "dtype": None, "verify": None,
                           "max_shard_bytes": 5 * 10**9, "copy_from": None, "overwrite": False,
                           "progress": None}


def test_export_names_a_missing_dependency(monkeypatch, saved: Path, tmp_path: Path, capsys):
    fake = types.ModuleType("ckptio.export")

    def importing(name: str) -> Any:  # as if ckptio/export.py's own imports failed
        raise ModuleNotFoundError("No module named 'safetensors'", name="safetensors")

    fake.__getattr__ = importing  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "ckptio.export", fake)
    assert cli.main(["export", str(saved), str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err.strip() == "ckptio: error: ckptio export needs the package " \
        "safetensors (No module named 'safetensors'); install it (pip install safetensors)"


def _safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export, read by the safetensors library through its index."""
    from safetensors.torch import load_file

    index = json.loads((path / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        part = load_file(path / name)
        assert {k for k, v in index["weight_map"].items() if v == name} == set(part), name
        out.update(part)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in out.values())
    return out


def test_export_a_transformers_model_from_the_command_line(tmp_path: Path):
    """``ckptio export`` for real: a small GPT-2's state saved with ckptio, exported in
    shards with its config, read back by safetensors bit for bit (the lm_head tied to the
    embedding is left out, as Hugging Face writes it), and converted with --dtype bf16."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    torch.manual_seed(3)
    config = transformers.GPT2Config(vocab_size=101, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ckptio.save({"model": model.state_dict(), "step": 7}, tmp_path / "ck")
    model.config.save_pretrained(tmp_path / "cfg")
    done = ckptio_cmd("export", str(tmp_path / "ck"), str(tmp_path / "hf"),
                      "--max-shard-size", "40KB", "--copy-from", str(tmp_path / "cfg"))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert "tied alias(es) left out" in done.stdout and "lm_head.weight" in done.stdout
    exported = _safetensors_dir(tmp_path / "hf")
    assert len(set(json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
                   ["weight_map"].values())) > 1  # really sharded
    assert sorted(exported) == sorted(k for k in weights if k != "lm_head.weight")
    for key, tensor in exported.items():
        assert bits_equal(tensor, weights[key]), key
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["n_embd"] == 32
    bf16 = ckptio_cmd("export", str(tmp_path / "ck"), str(tmp_path / "bf16"), "--dtype", "bf16")
    assert bf16.returncode == 0, bf16.stderr
    from safetensors.torch import load_file

    converted = load_file(tmp_path / "bf16" / "model.safetensors")  # one file: all fit
    assert sorted(converted) == sorted(exported)
    for key, tensor in converted.items():
        assert bits_equal(tensor, weights[key].to(torch.bfloat16)), key


def test_convert_a_torch_save_file_bitwise(tmp_path: Path):
    """``ckptio convert model.pt DST``: every tensor (NaN payloads, -0.0, subnormals, float8,
    complex, bool), tied weights and plain values as torch.save stored them; the original file
    is untouched."""
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    tied = specials(torch.float32, (6, 7), seed=1)
    state = {"model": dict(model.state_dict()), "step": 11, "names": ["a", "b"], "lr": -0.0,
             "special": {str(d).removeprefix("torch."): specials(d, (5, 9), seed=n)
                         for n, d in enumerate(ALL_DTYPES)},
             "tied": tied, "tied_again": tied, "big": specials(torch.float32, (300, 500), seed=2)}
    source = tmp_path / "model.pt"
    torch.save(state, source)
    before = source.read_bytes()
    done = ckptio_cmd("convert", str(source), str(tmp_path / "c"))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert source.read_bytes() == before
    got = ckptio.load(tmp_path / "c")
    assert_same(got, torch.load(source, weights_only=True))
    assert got["tied_again"] is got["tied"]  # stored once, loaded as one tensor
    assert ckptio_cmd("verify", str(tmp_path / "c")).returncode == 0


@pytest.mark.parametrize(("text", "nbytes"), [("5GB", 5 * 10**9), ("500MB", 500 * 10**6),
                                              ("2GiB", 2 * 2**30), ("1.5G", 15 * 10**8),
                                              ("4096", 4096), ("10kib", 10240)])
def test_sizes_parse_as_hugging_face_writes_them(text: str, nbytes: int):
    assert commands.parse_size(text) == nbytes


def test_a_bad_size_is_refused_by_argparse(saved: Path):
    done = ckptio_cmd("export", str(saved), "x", "--max-shard-size", "lots")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "'lots' is not a size such as 5GB" in done.stderr


# ------------------------------------------------------------------------------------------------
# errors, pipes, progress


def test_errors_are_one_line_naming_the_path(saved: Path, tmp_path: Path):
    missing = tmp_path / "nope"
    _one_line_error(ckptio_cmd("ls", str(missing)), str(missing), "does not exist")
    _one_line_error(ckptio_cmd("diff", str(saved), str(missing)), str(missing))
    _one_line_error(ckptio_cmd("verify", str(missing)), str(missing))
    _one_line_error(ckptio_cmd("ls", "hdfs://bucket/x"), "hdfs://", "s3://")
    broken = tmp_path / "broken"
    broken.mkdir()
    body = bytearray((saved / "manifest.json").read_bytes())
    body[len(body) // 2] ^= 1
    (broken / "manifest.json").write_bytes(bytes(body))
    _one_line_error(ckptio_cmd("ls", str(broken)), str(broken / "manifest.json"), "damaged")
    (data,) = saved.glob("data-*")
    raw = bytearray(data.read_bytes())
    raw[3] ^= 1
    data.write_bytes(bytes(raw))
    damaged = ckptio_cmd("verify", str(saved))  # a report, not an error: exit 1 (tests/test_cli_ls.py)
    assert damaged.returncode == 1 and damaged.stderr == "", damaged.stderr
    assert "checksum mismatch" in damaged.stdout and "'model.weight'" in damaged.stdout
    assert data.name in damaged.stdout


def test_a_closed_pipe_exits_quietly(tmp_path: Path):
    ckptio.save({f"layer{i}": {"w": torch.zeros(1), "n": i} for i in range(3000)},
                tmp_path / "big")
    proc = subprocess.Popen([sys.executable, "-m", "ckptio", "ls", str(tmp_path / "big")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(str(tmp_path / "big").encode())
    proc.stdout.close()  # `| head -1`
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and err == "", err
    # diff knows its answer before it prints: a closed pipe keeps "1, they differ"
    ckptio.save({f"layer{i}": {"w": torch.ones(1), "n": i} for i in range(3000)},
                tmp_path / "other")
    proc = subprocess.Popen([sys.executable, "-m", "ckptio", "diff", str(tmp_path / "big"),
                             str(tmp_path / "other")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b"~ ")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and err == "", err


def test_progress_bar_on_a_terminal_only_and_not_with_no_progress(tmp_path: Path):
    ckptio.save({"w": torch.randn(1 << 18)}, tmp_path / "c")
    status, shown = _on_a_terminal("verify", str(tmp_path / "c"))
    assert status == 0 and "verify" in shown and "1.00M" in shown, shown
    status, shown = _on_a_terminal("verify", "--no-progress", str(tmp_path / "c"))
    assert status == 0 and shown == "", shown
    piped = ckptio_cmd("verify", str(tmp_path / "c"))
    assert piped.returncode == 0 and piped.stderr == ""
    ckptio.save({"w": torch.zeros(1 << 18)}, tmp_path / "d")
    status, shown = _on_a_terminal("diff", "--data", str(tmp_path / "c"), str(tmp_path / "d"))
    assert status == 1 and "diff" in shown and "2.00M" in shown, shown
    status, shown = _on_a_terminal("convert", str(tmp_path / "c"), str(tmp_path / "e"))
    assert status == 0 and "convert" in shown and "1.00M" in shown, shown


def test_reading_a_committed_manifest_takes_no_staging_pool(saved: Path) -> None:
    """What ``ls`` and DcpReader.read_metadata need is the manifest alone: it is read without
    allocating (and pre-faulting) the Checkpointer's staging pool."""
    checkpointer = ckptio.Checkpointer(ckptio.Options())
    try:
        record = checkpointer.manifest(saved)
        assert record.tensors and checkpointer.resources().pool is None
    finally:
        checkpointer.close()
