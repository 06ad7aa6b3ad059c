"""``export_hf`` of a whole training state in one call (values dropped by ``rename``) and
``copy_from`` of a folder with subfolders (a sentence-transformers layout), safely: no
symlink out of the folder is followed, no symlink in the destination is written through.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio

safetensors_torch = pytest.importorskip("safetensors.torch")
OPTS = ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20)


def _training_state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    model = torch.nn.Linear(6, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 6, generator=gen)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 11,
            "config": {"lr": 1e-3, "name": "run-1"}}


def _values(key: str) -> str | None:
    """Drop what safetensors cannot hold: the Python values of this state."""
    return None if key in ("step", "config.lr", "config.name") or key.startswith(
        "optim.param_groups") else key


def test_whole_training_state_in_one_call_values_renamed_away(tmp_path: Path) -> None:
    state = _training_state()
    ckptio.save(state, tmp_path / "ck", options=OPTS)
    # before the fix, the first value under the prefix was refused before rename was asked
    result = ckptio.export_hf(tmp_path / "ck", tmp_path / "hf", keys=None, rename=_values,
                              options=OPTS)
    got = safetensors_torch.load_file(str(tmp_path / "hf" / result.files[0]))
    want = {"model.weight": state["model"]["weight"], "model.bias": state["model"]["bias"]}
    for i, slot in state["optim"]["state"].items():
        for name, value in slot.items():
            want[f"optim.state.{i}.{name}"] = value
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_value_not_renamed_away_is_still_refused_naming_it(tmp_path: Path) -> None:
    ckptio.save(_training_state(), tmp_path / "ck", options=OPTS)

    def keep_step(k: str) -> str | None:
        return None if k != "step" and _values(k) is None else k

    with pytest.raises(ckptio.CkptError, match="'step' is a Python value.*rename it to None"):
        ckptio.export_hf(tmp_path / "ck", tmp_path / "x", keys=None, rename=keep_step,
                         options=OPTS)
    with pytest.raises(ckptio.CkptError, match="'config.lr' is a Python value"):
        ckptio.export_hf(tmp_path / "ck", tmp_path / "x", keys="config.", options=OPTS)
    assert not (tmp_path / "x").exists() or not os.listdir(tmp_path / "x")


# ------------------------------------------------------------------------------------------------
# copy_from with subfolders


def _sentence_transformers_folder(root: Path) -> dict[str, bytes]:
    """The files of a sentence-transformers model folder (all-MiniLM-L6-v2's layout), as
    ``SentenceTransformer.save`` writes them, with the files' own contents."""
    files = {
        "config.json": json.dumps({"model_type": "bert", "hidden_size": 8}).encode(),
        "config_sentence_transformers.json": b'{"__version__": {"sentence_transformers": '
                                             b'"5.1.0"}, "similarity_fn_name": "cosine"}',
        "modules.json": json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling",
             "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Dense",
             "type": "sentence_transformers.models.Dense"},
        ]).encode(),
        "sentence_bert_config.json": b'{"max_seq_length": 256, "do_lower_case": false}',
        "tokenizer.json": b'{"version": "1.0"}',
        "vocab.txt": b"[PAD]\n[UNK]\nhello\n",
        "1_Pooling/config.json": b'{"word_embedding_dimension": 8, "pooling_mode_mean_tokens": '
                                 b'true}',
        "2_Dense/config.json": b'{"in_features": 8, "out_features": 4}',
        "2_Dense/model.safetensors": b"dense weights: another module's, copied along",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "model.safetensors").write_bytes(b"old weights: replaced by the export")
    (root / ".cache" / "huggingface").mkdir(parents=True)
    (root / ".cache" / "huggingface" / "x.lock").write_bytes(b"")
    return files


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in root.rglob("*") if p.is_file()}


def test_copy_from_copies_subfolders_sentence_transformers_layout(tmp_path: Path) -> None:
    ckptio.save({"model": {"embeddings.weight": torch.randn(5, 8)}}, tmp_path / "ck",
                options=OPTS)
    files = _sentence_transformers_folder(tmp_path / "st")
    ckptio.export_hf(tmp_path / "ck", tmp_path / "hf", copy_from=tmp_path / "st", options=OPTS)
    got = _tree(tmp_path / "hf")
    weights = got.pop("model.safetensors")
    assert got == files  # subfolders whole, their weights too; no hidden folder, no old weights
    assert list(safetensors_torch.load(weights)) == ["embeddings.weight"]
    # again with overwrite: the subfolder's files replaced in place, nothing left behind
    (tmp_path / "st" / "1_Pooling" / "config.json").write_bytes(b"{}")
    ckptio.export_hf(tmp_path / "ck", tmp_path / "hf", copy_from=tmp_path / "st",
                     overwrite=True, options=OPTS)
    assert (tmp_path / "hf" / "1_Pooling" / "config.json").read_bytes() == b"{}"
    assert not [p for p in (tmp_path / "hf").rglob(".*")]


def test_copy_from_leaves_a_checkpoint_inside_the_folder_behind(tmp_path: Path) -> None:
    """A Trainer's checkpoint-N: config.json beside ckptio/ (the whole training state, exported
    from): the config goes along, the checkpoint does not."""
    trainer_dir = tmp_path / "checkpoint-40"
    ckptio.save({"model": {"w": torch.ones(2)}, "optimizer": {"m": torch.zeros(2)}},
                trainer_dir / "ckptio", options=OPTS)
    (trainer_dir / "config.json").write_text("{}")
    ckptio.export_hf(trainer_dir / "ckptio", tmp_path / "hf", copy_from=trainer_dir,
                     options=OPTS)
    assert sorted(_tree(tmp_path / "hf")) == ["config.json", "model.safetensors"]


def test_copy_from_refuses_links_out_of_the_folder(tmp_path: Path) -> None:
    ckptio.save({"model": {"w": torch.ones(2)}}, tmp_path / "ck", options=OPTS)
    secret = tmp_path / "secret.txt"
    secret.write_text("private")
    src = tmp_path / "st"
    _sentence_transformers_folder(src)
    (src / "1_Pooling" / "tokenizer.json").symlink_to(secret)
    with pytest.raises(ckptio.CkptError, match="1_Pooling/tokenizer.json is a symlink to .*"
                       "secret.txt, outside the folder"):
        ckptio.export_hf(tmp_path / "ck", tmp_path / "hf", copy_from=src, options=OPTS)
    assert not (tmp_path / "hf").exists() or not os.listdir(tmp_path / "hf")
    # a link to a folder outside, and a link to a folder inside: not followed either
    (src / "1_Pooling" / "tokenizer.json").unlink()
    (src / "up").symlink_to(tmp_path)
    with pytest.raises(ckptio.CkptError, match="up is a symlink to .*outside the folder"):
        ckptio.export_hf(tmp_path / "ck", tmp_path / "hf", copy_from=src, options=OPTS)
    (src / "up").unlink()
    (src / "again").symlink_to(src / "1_Pooling")
    with pytest.raises(ckptio.CkptError, match="again is a symlink to .*not a file"):
        ckptio.export_hf(tmp_path / "ck", tmp_path / "hf", copy_from=src, options=OPTS)
    # a link to a file inside the folder is copied as that file
    (src / "again").unlink()
    (src / "vocab-link.txt").symlink_to(src / "vocab.txt")
    ckptio.export_hf(tmp_path / "ck", tmp_path / "hf", copy_from=src, options=OPTS)
    link = tmp_path / "hf" / "vocab-link.txt"
    assert not link.is_symlink() and link.read_bytes() == (src / "vocab.txt").read_bytes()
    # a destination whose subfolder is a symlink out: refused before anything is written, the
    # export there intact, nothing written through the link
    outside = tmp_path / "outside"
    outside.mkdir()
    ckptio.save({"model": {"a": torch.ones(2), "b": torch.zeros(3)}}, tmp_path / "ck2",
                options=OPTS)
    ckptio.export_hf(tmp_path / "ck2", tmp_path / "hf2", max_shard_bytes=8, options=OPTS)
    before = _tree(tmp_path / "hf2")
    assert "model.safetensors.index.json" in before
    (tmp_path / "hf2" / "1_Pooling").symlink_to(outside)
    with pytest.raises(ckptio.CkptError, match="1_Pooling is a symlink or a file"):
        ckptio.export_hf(tmp_path / "ck2", tmp_path / "hf2", copy_from=src, overwrite=True,
                         options=OPTS)
    assert not os.listdir(outside)
    (tmp_path / "hf2" / "1_Pooling").unlink()
    assert _tree(tmp_path / "hf2") == before
    # the destination inside the folder copied from
    with pytest.raises(ckptio.CkptError, match="inside it"):
        ckptio.export_hf(tmp_path / "ck", src / "hf", copy_from=src, options=OPTS)
