"""Hugging Face safetensors export (``ckptio.export_hf``) and import (``ckptio.load`` of a
safetensors file or an HF folder).

As users meet them: a checkpoint saved by ckptio from one process, or by 2 gloo ranks (FSDP2
DTensors, TensorShard rows, FlatShard partitions), exported by one process or by every rank
together; the result read by the safetensors library itself and by transformers'
``from_pretrained`` (tiny GPT-2 and Llama built from a config, random weights: logits equal);
then loaded back by ckptio in place, resharded into FSDP2 (reading only each rank's rows).
Refusals: a non-empty destination, non-tensor keys, hostile safetensors headers and indexes.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckptio
from ckptio.format import safetensors as st
from ckptio.planning.export_plan import plan_files, select, windows
from ckptio.testing.rank_processes import run_ranks
from dist_cases import fully_shard_linears

safetensors_torch = pytest.importorskip("safetensors.torch")
OPTS = ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20)
DIMS = (12, 30, 17, 5)  # uneven rows for 2 ranks


def _hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an exported folder, read by the safetensors library."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        got = safetensors_torch.load_file(str(f))
        assert not set(got) & set(out)
        out.update(got)
    return out


def _check_index(path: Path, files: int) -> dict[str, Any]:
    index = json.loads((path / st.INDEX_NAME).read_text())
    names = sorted(p.name for p in path.glob("*.safetensors"))
    assert names == [f"model-{i:05d}-of-{files:05d}.safetensors" for i in range(1, files + 1)]
    for name in names:
        held = safetensors_torch.load_file(str(path / name))
        assert sorted(held) == sorted(k for k, v in index["weight_map"].items() if v == name)
    tensors = _hf_tensors(path)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in tensors.values())
    assert index["metadata"]["total_parameters"] == sum(t.numel() for t in tensors.values())
    assert not [p for p in path.iterdir() if p.name.startswith(".")]  # no temp files left
    return index


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    return {"model": {"big": torch.randn(700, 1000, generator=gen),  # 2.8 MB: several windows
                      "embed": torch.randn(40, 16, generator=gen),
                      "layer.w": torch.randn(16, 16, generator=gen, dtype=torch.float64),
                      "layer.b": torch.randn(16, generator=gen).half(),
                      "count": torch.arange(9, dtype=torch.int32),
                      "scale": torch.tensor(2.5),
                      "mask": torch.tensor([True, False, True])},
            "optim": {"m": torch.ones(4)}, "step": 3}


def test_export_one_rank_shards_dtype_rename(tmp_path: Path) -> None:
    state = _state()
    ckptio.save(state, tmp_path / "ck", options=OPTS)
    dst = tmp_path / "hf"
    result = ckptio.export_hf(tmp_path / "ck", dst, max_shard_bytes=300, dtype=torch.bfloat16,
                              rename=lambda k: None if k == "count" else "m." + k, options=OPTS)
    assert len(result.files) >= 3
    _check_index(dst, len(result.files))
    got = _hf_tensors(dst)
    assert sorted(got) == sorted("m." + k for k in state["model"] if k != "count")
    for key, want in state["model"].items():
        if key == "count":
            continue
        want = want.to(torch.bfloat16) if want.is_floating_point() else want
        assert got["m." + key].dtype == want.dtype and torch.equal(got["m." + key], want), key
    from safetensors import safe_open

    with safe_open(str(dst / result.files[0]), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_export_single_file_same_dtype_and_import(tmp_path: Path) -> None:
    state = _state()
    ckptio.save(state, tmp_path / "ck", options=OPTS)
    result = ckptio.export_hf(tmp_path / "ck", tmp_path / "hf", options=OPTS)
    assert result.files == ("model.safetensors",)
    assert sorted(os.listdir(tmp_path / "hf")) == ["model.safetensors"]
    got = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert got.keys() == state["model"].keys()
    for key, want in state["model"].items():
        assert got[key].dtype == want.dtype and torch.equal(got[key], want), key
    # back in, in place, from the folder and from the file
    for path in (tmp_path / "hf", tmp_path / "hf" / "model.safetensors"):
        fresh = {k: torch.zeros_like(v) for k, v in state["model"].items()}
        report = ckptio.load(path, fresh)
        assert sorted(report.loaded) == sorted(fresh)
        assert all(torch.equal(fresh[k], v) for k, v in state["model"].items())
    assert ckptio.verify(tmp_path / "hf") > 0


def test_windows_cover_every_byte_once(tmp_path: Path) -> None:
    state = _state()
    ckptio.save(state, tmp_path / "ck", options=OPTS)
    record = ckptio.Checkpointer(OPTS).manifest(tmp_path / "ck")
    sources, _ = select(record, "model.", None, None)
    for window_bytes in (4096, 8192, 1 << 20):
        for file in plan_files(sources, 700, 4096):
            covered = bytearray(file.nbytes)
            covered[:len(file.header)] = b"\1" * len(file.header)
            for w in windows(file, window_bytes):
                assert w.offset % 4096 == 0 and w.nbytes <= window_bytes
                for p in w.parts:
                    size = torch.empty(0, dtype=getattr(torch, p.tensor.source.out_dtype)
                                       ).element_size()
                    lo = w.offset + p.at
                    assert lo == p.tensor.offset + p.start * size and lo % size == 0
                    assert not any(covered[lo:lo + p.count * size])
                    covered[lo:lo + p.count * size] = b"\1" * (p.count * size)
            assert all(covered)


def test_refusals_and_overwrite(tmp_path: Path) -> None:
    ckptio.save(_state(), tmp_path / "ck", options=OPTS)
    dst = tmp_path / "hf"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(ckptio.CkptError, match="not empty.*overwrite=True"):
        ckptio.export_hf(tmp_path / "ck", dst, options=OPTS)
    assert os.listdir(dst) == ["keep.txt"]
    with pytest.raises(ckptio.CkptError, match="'step' is a Python value"):
        ckptio.export_hf(tmp_path / "ck", tmp_path / "x", keys=None, options=OPTS)
    with pytest.raises(ckptio.CkptError, match="no tensor key starts with 'nope.'"):
        ckptio.export_hf(tmp_path / "ck", tmp_path / "x", keys="nope.", options=OPTS)
    with pytest.raises(ckptio.CkptError, match="both exported as 'same'"):
        ckptio.export_hf(tmp_path / "ck", tmp_path / "x", rename=lambda k: "same", options=OPTS)
    assert not (tmp_path / "x").exists() or not os.listdir(tmp_path / "x")
    # overwrite: a 2nd export with fewer shards leaves no stale shard of the 1st
    ckptio.export_hf(tmp_path / "ck", dst, max_shard_bytes=512, overwrite=True, options=OPTS)
    many = len(list(dst.glob("*.safetensors")))
    assert many > 2
    ckptio.export_hf(tmp_path / "ck", dst, max_shard_bytes=10**7, overwrite=True, options=OPTS)
    assert sorted(os.listdir(dst)) == ["keep.txt", "model.safetensors"]


def test_copy_from_and_tied_aliases_dropped(tmp_path: Path) -> None:
    w = torch.randn(10, 4)
    ckptio.save({"model": {"wte": w, "lm_head": w, "b": torch.zeros(2)}}, tmp_path / "ck",
                options=OPTS)
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "config.json").write_text('{"a": 1}')
    (cfg / "tokenizer.json").write_text("{}")
    (cfg / "old.safetensors").write_bytes(b"x")
    result = ckptio.export_hf(tmp_path / "ck", tmp_path / "hf", copy_from=cfg, options=OPTS)
    assert result.dropped == ("model.lm_head",)
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors",
                                                    "tokenizer.json"]
    got = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(got) == ["b", "wte"] and torch.equal(got["wte"], w)


# ------------------------------------------------------------------------------------------------
# hostile input


def _write_st(path: Path, header: Any, data: bytes, n: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if n is None else n) + raw + data)
    return path


@pytest.mark.parametrize("header,data,n,match", [
    (b"{not json", b"", None, "not valid JSON"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, None, "overlaps"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, None,
     "cover 8 data bytes but the file holds 4"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, b"\0" * 16, None, "gap"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None, "needs 12"),
    ({"a": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "dtype"),
    ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "shape"),
    ({}, b"", 1 << 62, "header claims"),
    ({}, b"", 10_000, "file has only"),
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {}}', b"\0" * 4, None,
     "twice"),
])
def test_hostile_headers_refused(tmp_path: Path, header: Any, data: bytes, n: int | None,
                                 match: str) -> None:
    path = _write_st(tmp_path / "bad.safetensors", header, data, n)
    with pytest.raises(ckptio.CorruptCheckpointError, match=match) as info:
        ckptio.load(path)
    assert "bad.safetensors" in str(info.value)


def test_hostile_index_refused(tmp_path: Path) -> None:
    safetensors_torch.save_file({"a": torch.ones(2)}, str(tmp_path / "model-1.safetensors"))
    index = {"metadata": {}, "weight_map": {"a": "../model-1.safetensors"}}
    (tmp_path / st.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ckptio.CorruptCheckpointError, match="not a plain file name"):
        ckptio.load(tmp_path)
    index["weight_map"] = {"a": "model-1.safetensors", "b": "model-1.safetensors"}
    (tmp_path / st.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ckptio.CorruptCheckpointError, match="'b'.*does not hold it"):
        ckptio.load(tmp_path)


# ------------------------------------------------------------------------------------------------
# many ranks (module level: the ranks import this module)


def _build(seed: int, fsdp: bool) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in itertools.pairwise(DIMS)])
    if fsdp:
        fully_shard_linears(model)
    return model


def _full() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {"rows": torch.randn(600, 700, generator=gen),  # 1.7 MB: windows cross the ranks' cut
            "flat": torch.randn(5, 11, generator=gen)}


def save_two_ranks(rank: int, world: int, path: str) -> None:
    """FSDP2 model state (DTensors) plus TensorShard rows and FlatShard partitions."""
    model = _build(11, fsdp=True)
    full = _full()
    rows = full["rows"][:250] if rank == 0 else full["rows"][250:]
    flat = full["flat"].reshape(-1)
    cut = 23  # not on a row boundary
    part = flat[:cut] if rank == 0 else flat[cut:]
    state = {"model": model.state_dict(),
             "extra": {"rows": ckptio.TensorShard(rows.clone(), (600, 700),
                                                  (0 if rank == 0 else 250, 0)),
                       "flat": ckptio.FlatShard(part.clone(), (5, 11), 0 if rank == 0 else cut)}}
    ckptio.save(state, path, options=OPTS)


def export_two_ranks(rank: int, world: int, src: str, dst: str) -> tuple[int, tuple[str, ...]]:
    result = ckptio.export_hf(src, dst, keys=None, max_shard_bytes=600, options=OPTS)
    return result.nbytes_written, result.files


def load_two_ranks(rank: int, world: int, hf: str) -> tuple[dict[str, np.ndarray], int]:
    model = _build(99, fsdp=True)
    sd = model.state_dict()
    report = ckptio.load(hf, {"model": sd}, keys="model", options=OPTS)
    return {k: v.full_tensor().detach().numpy().copy() for k, v in sd.items()}, report.nbytes_read


def test_two_ranks_save_then_parallel_export_then_fsdp2_import(tmp_path: Path) -> None:
    src, dst = str(tmp_path / "ck"), str(tmp_path / "hf")
    run_ranks(2, save_two_ranks, src, timeout_s=300)
    want = {f"model.{k}": v.detach() for k, v in _build(11, fsdp=False).state_dict().items()}
    want.update({f"extra.{k}": v for k, v in _full().items()})
    # one process exports what 2 ranks saved
    one = tmp_path / "one"
    ckptio.export_hf(src, one, keys=None, max_shard_bytes=600, options=OPTS)
    # both ranks export together: files split between them, one index
    results = run_ranks(2, export_two_ranks, src, dst, timeout_s=300)
    files = results[0][1]
    assert results[1][1] == files and len(files) >= 3
    index = _check_index(Path(dst), len(files))
    sizes = sum(os.path.getsize(os.path.join(dst, f)) for f in files)
    assert results[0][0] > 0 and results[1][0] > 0 and results[0][0] + results[1][0] == sizes
    for path in (one, Path(dst)):
        got = _hf_tensors(path)
        assert sorted(got) == sorted(want) == sorted(index["weight_map"])
        assert all(torch.equal(got[k], want[k]) for k in want)
    # import, resharded into FSDP2 on 2 ranks: each reads its rows only
    hf_model = tmp_path / "hf_model"
    ckptio.export_hf(src, hf_model, keys=None, options=OPTS)
    loaded = run_ranks(2, load_two_ranks, str(hf_model), timeout_s=300)
    for got, nbytes in loaded:
        for k, v in got.items():
            assert np.array_equal(v, want[f"model.{k}"].numpy()), k
        assert nbytes < os.path.getsize(hf_model / "model.safetensors")


# ------------------------------------------------------------------------------------------------
# transformers


def _tiny(kind: str, seed: int) -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=101, n_positions=32, n_embd=32, n_layer=2,
                                         n_head=2)
    else:
        config = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_transformers_from_pretrained_and_back(tmp_path: Path, kind: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    model = _tiny(kind, seed=5)
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    model.config.save_pretrained(tmp_path / "cfg")
    ckptio.save({"model": model.state_dict(), "step": 7}, tmp_path / "ck", options=OPTS)
    result = ckptio.export_hf(tmp_path / "ck", tmp_path / "hf", keys="model.",
                              copy_from=tmp_path / "cfg", max_shard_bytes=40_000, options=OPTS)
    assert len(result.files) > 1 and (tmp_path / "hf" / "config.json").exists()
    assert result.dropped == (("model.lm_head.weight",) if kind == "gpt2" else ())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", local_files_only=True).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)
    # back into a fresh model, in place, strict (tied lm_head: HF files leave it out, the tie
    # fills it, so it is loaded, not missing)
    fresh = _tiny(kind, seed=6)
    sd = fresh.state_dict()
    report = ckptio.load(tmp_path / "hf", sd, options=OPTS)
    assert not report.missing and not report.unexpected
    assert "lm_head.weight" in report.loaded  # gpt2: through the tie; llama: from the file
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, want)


# ------------------------------------------------------------------------------------------------
# failures: nothing committed, the previous export intact


def test_write_failure_leaves_previous_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    from ckptio import export

    ckptio.save(_state(), tmp_path / "ck", options=OPTS)
    dst = tmp_path / "hf"
    ckptio.export_hf(tmp_path / "ck", dst, max_shard_bytes=300, options=OPTS)
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    real = export.write_windows
    calls = []

    def failing(*args: Any, **kwargs: Any) -> int:
        calls.append(1)
        if len(calls) == 2:
            raise ckptio.StorageIOError("disk full (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(export, "write_windows", failing)
    with pytest.raises(ckptio.StorageIOError, match="injected"):
        ckptio.export_hf(tmp_path / "ck", dst, max_shard_bytes=300, dtype=torch.bfloat16,
                         overwrite=True, options=OPTS)
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before  # no temp file either


def export_failing_on_rank_1(rank: int, world: int, src: str, dst: str) -> str:
    def rename(key: str) -> str:
        if rank == 1:
            raise ckptio.CkptError("rename refused on rank 1 (injected)")
        return key

    try:
        ckptio.export_hf(src, dst, keys=None, rename=rename, options=OPTS)
    except ckptio.CkptError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_one_rank_failing_fails_every_rank(tmp_path: Path) -> None:
    src, dst = str(tmp_path / "ck"), str(tmp_path / "hf")
    run_ranks(2, save_two_ranks, src, timeout_s=300)
    errors = run_ranks(2, export_failing_on_rank_1, src, dst, timeout_s=300)
    assert errors[0].startswith("RankFailedError") and "rank 1" in errors[0], errors[0]
    assert "injected" in errors[1]
    assert not os.path.exists(dst) or not os.listdir(dst)


def export_to_own_dst(rank: int, world: int, src: str, root: str) -> str:
    try:
        ckptio.export_hf(src, os.path.join(root, f"hf{rank}"), keys=None, options=OPTS)
    except ckptio.CkptError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_ranks_exporting_to_different_folders_are_refused(tmp_path: Path) -> None:
    """Each rank wrote its share into its own folder and rank 0 indexed all the files in its
    own (an export naming files that are elsewhere); now refused on every rank, naming both."""
    src = str(tmp_path / "ck")
    run_ranks(2, save_two_ranks, src, timeout_s=300)
    errors = run_ranks(2, export_to_own_dst, src, str(tmp_path), timeout_s=300)
    for said in errors:
        assert "ranks disagree on the destination" in said, said
        assert str(tmp_path / "hf0") in said and str(tmp_path / "hf1") in said, said
    assert not any(os.listdir(tmp_path / d) for d in ("hf0", "hf1")
                   if os.path.exists(tmp_path / d))


@pytest.mark.parametrize("verify", [True, False])
def test_export_from_dcp_dir_and_torch_save_file(tmp_path: Path, verify: bool) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    model = {k: v for k, v in _state()["model"].items() if k != "scale"}  # DCP: 0-dim is bytes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": model}, checkpoint_id=str(tmp_path / "dcp"))
    torch.save({"model": model}, tmp_path / "t.pt")
    for i, src in enumerate((tmp_path / "dcp", tmp_path / "t.pt")):
        dst = tmp_path / f"hf{i}"
        ckptio.export_hf(src, dst, max_shard_bytes=300, verify=verify, options=OPTS)
        got = _hf_tensors(dst)
        assert sorted(got) == sorted(model)
        assert all(torch.equal(got[k], v) for k, v in model.items())


def test_import_bf16_into_fp32_with_cast(tmp_path: Path) -> None:
    state = {"model": {"w": torch.randn(6, 5), "n": torch.arange(3)}}
    ckptio.save(state, tmp_path / "ck", options=OPTS)
    ckptio.export_hf(tmp_path / "ck", tmp_path / "hf", dtype="bfloat16", options=OPTS)
    fresh = {"w": torch.zeros(6, 5), "n": torch.zeros(3, dtype=torch.int64)}
    with pytest.raises(ckptio.StateMismatchError, match="w"):
        ckptio.load(tmp_path / "hf", fresh, options=OPTS)
    ckptio.load(tmp_path / "hf", fresh, cast=True, options=OPTS)
    assert torch.equal(fresh["w"], state["model"]["w"].bfloat16().float())
    assert torch.equal(fresh["n"], state["model"]["n"])


def test_export_and_import_need_no_safetensors_package(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    state = _state()
    ckptio.save(state, tmp_path / "ck", options=OPTS)
    for name in [n for n in sys.modules if n == "safetensors" or n.startswith("safetensors.")]:
        monkeypatch.setitem(sys.modules, name, None)  # any import of it now raises ImportError
    monkeypatch.setitem(sys.modules, "safetensors", None)
    ckptio.export_hf(tmp_path / "ck", tmp_path / "hf", max_shard_bytes=300, options=OPTS)
    fresh = {k: torch.zeros_like(v) for k, v in state["model"].items()}
    ckptio.load(tmp_path / "hf", fresh, options=OPTS)
    assert all(torch.equal(fresh[k], v) for k, v in state["model"].items())


_RSS_CHILD = """
import sys, torch, ckptio

def rss_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))

opts = ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current resident set
before = rss_kib("VmRSS:")
if sys.argv[3] == "export":
    ckptio.export_hf(sys.argv[1], sys.argv[2], max_shard_bytes=40 << 20, dtype=torch.bfloat16,
                     options=opts)
else:  # what the bound guards against: the whole state in memory
    state = ckptio.load(sys.argv[1], options=opts)
print(rss_kib("VmHWM:") - before)
"""


def test_export_memory_is_bounded(tmp_path: Path) -> None:
    """96 MB of fp32 exported (as bf16) by a fresh process grows its peak RSS by far less than
    the state: the pool (4 MB), two windows (2 MB), scratch and slack."""
    import subprocess
    import sys

    gen = torch.Generator().manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(1000, 3000, generator=gen) for i in range(8)}}
    ckptio.save(state, tmp_path / "ck", options=OPTS)
    del state
    grown = {}
    for what in ("export", "load"):
        out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(tmp_path / "ck"),
                              str(tmp_path / "hf"), what], check=False, capture_output=True,
                             text=True,
                             timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr
        grown[what] = int(out.stdout.split()[-1])
    assert grown["load"] > 90 * 1024, grown  # the measure sees a whole state in memory
    assert grown["export"] < 40 * 1024, f"peak RSS grew by {grown} KiB exporting 96 MB"
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) == 2


def test_load_folder_saved_by_transformers(tmp_path: Path) -> None:
    """A folder written by save_pretrained itself (sharded, with its index) loads in place."""
    model = _tiny("gpt2", seed=8)
    model.save_pretrained(tmp_path / "native", max_shard_size="20KB")
    assert (tmp_path / "native" / st.INDEX_NAME).exists()
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(2))
    fresh = _tiny("gpt2", seed=9)
    report = ckptio.load(tmp_path / "native", fresh.state_dict(), options=OPTS)
    assert not report.missing and not report.unexpected and "lm_head.weight" in report.loaded
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)
    assert ckptio.verify(tmp_path / "native") > 0


def test_alias_of_a_key_left_out_is_exported(tmp_path: Path) -> None:
    w = torch.randn(3, 4)
    ckptio.save({"emb": w, "model": {"head": w, "b": torch.ones(2)}}, tmp_path / "ck", options=OPTS)
    result = ckptio.export_hf(tmp_path / "ck", tmp_path / "hf", options=OPTS)
    assert result.dropped == ()
    got = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(got) == ["b", "head"] and torch.equal(got["head"], w)
    # the alias's target renamed away: the alias is the tensor's only copy, so it is exported
    ckptio.save({"model": {"wte": w, "lm_head": w}}, tmp_path / "ck2", options=OPTS)
    result = ckptio.export_hf(tmp_path / "ck2", tmp_path / "hf2", options=OPTS,
                              rename=lambda k: None if k == "wte" else k)
    assert result.dropped == ()
    got = safetensors_torch.load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert sorted(got) == ["lm_head"] and torch.equal(got["lm_head"], w)


def test_smallest_pool_metadata_and_copy_from_refusals(tmp_path: Path) -> None:
    """A pool of two buffers (the least Options allows) still exports; metadata safetensors
    cannot hold, or that would change ``format``, and a copy_from that is not a folder are
    refused before anything is written."""
    state = _state()
    ckptio.save(state, tmp_path / "ck", options=OPTS)
    tiny = ckptio.Options(buffer_bytes=1 << 20, pool_bytes=2 << 20)
    ckptio.export_hf(tmp_path / "ck", tmp_path / "hf", options=tiny, dtype=torch.bfloat16)
    got = _hf_tensors(tmp_path / "hf")
    assert torch.equal(got["big"], state["model"]["big"].bfloat16())
    for metadata, match in [({"step": 5}, "'step': 5: safetensors metadata maps str to str"),
                            ({"format": "np"}, "format='np': the format is always 'pt'")]:
        with pytest.raises(ckptio.CkptError, match=match):
            ckptio.export_hf(tmp_path / "ck", tmp_path / "x", metadata=metadata, options=OPTS)
    with pytest.raises(ckptio.CkptError, match="copy_from=.*not a directory"):
        ckptio.export_hf(tmp_path / "ck", tmp_path / "x", copy_from=tmp_path / "nope",
                         options=OPTS)
    assert not (tmp_path / "x").exists()


def test_index_write_failure_leaves_no_temp_file(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptio import export

    ckptio.save(_state(), tmp_path / "ck", options=OPTS)
    real = export.write_durably

    def failing(path: str, data: bytes) -> None:
        real(path, data)
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(export, "write_durably", failing)
    with pytest.raises(ckptio.StorageIOError, match="injected"):
        ckptio.export_hf(tmp_path / "ck", tmp_path / "hf", max_shard_bytes=300, options=OPTS)
    assert not [p.name for p in (tmp_path / "hf").iterdir() if p.name.startswith(".")]


def test_verified_export_of_a_dcp_dir_reads_a_cut_tensor_twice_not_per_window(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DCP item has one CRC for all its bytes. An 8 MB tensor cut by 1 MiB windows is
    verified whole once, then read in parts: about twice its bytes, not once per window (eight
    times); a flipped byte in it is still caught."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from ckptio.loading import read as loading_read

    big = torch.randn(2000, 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": {"big": big}}, checkpoint_id=str(tmp_path / "dcp"))
    real, counted = loading_read.read_regions, []

    def counting(*args: Any, **kwargs: Any) -> int:
        counted.append(real(*args, **kwargs))
        return counted[-1]

    monkeypatch.setattr(loading_read, "read_regions", counting)
    ckptio.export_hf(tmp_path / "dcp", tmp_path / "hf", verify=True, options=OPTS)
    assert torch.equal(_hf_tensors(tmp_path / "hf")["big"], big)
    assert big.nbytes * 2 <= sum(counted) < big.nbytes * 2.5, (sum(counted), big.nbytes)
    data = next((tmp_path / "dcp").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(ckptio.CorruptCheckpointError):
        ckptio.export_hf(tmp_path / "dcp", tmp_path / "hf2", verify=True, options=OPTS)
    assert not (tmp_path / "hf2").exists() or not os.listdir(tmp_path / "hf2")
