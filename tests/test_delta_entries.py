"""Delta checkpoints at the engine level (format version 4, issue 28): ``save(..., base=)``
references chunks equal to the base's and stores changed ones as their XOR with it; loads are
bit-exact for every dtype (NaN payloads, infinities, -0.0, subnormals), resharded or whole,
through local directories, host memory and shm; a damaged or missing base is found, naming the
base step, the key and the file."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import ckptio
from conftest import ALL_DTYPES
from special_values import bits_equal, specials
from ckptio.errors import CkptError, CorruptCheckpointError
from ckptio.format import manifest

MiB = 1 << 20
FRAME = 256 << 10  # frames of a 1 MiB-buffer checkpointer


def options(compression: str = "bytegroup+zstd") -> ckptio.Options:
    return ckptio.Options(buffer_bytes=MiB, pool_bytes=4 * MiB, compression=compression)


def body(path: str) -> dict:
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        return json.loads(f.read().split(b"\n")[1])


def rows(path: str) -> dict[str, dict]:
    return {t["key"]: t for t in body(path)["tensors"]}


def data_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
               if n.startswith("data-"))


def touched(t: torch.Tensor, every: int = 97) -> torch.Tensor:
    """``t`` with one byte in ``every`` changed (a training step's small update)."""
    out = t.clone()
    flat = out.reshape(-1).view(torch.uint8)
    flat[::every] ^= 1
    if t.dtype == torch.bool:
        flat.clamp_(0, 1)
    return out


def every_dtype(seed: int) -> dict[str, torch.Tensor]:
    return {str(d).removeprefix("torch."): specials(d, (2 * FRAME // torch.empty((), dtype=d)
                                                        .element_size() + 40,), seed)
            for d in ALL_DTYPES}


def test_every_dtype_with_refs_and_xors_round_trips(tmp_path):
    base_state = every_dtype(0)
    base_state["frozen"] = specials(torch.bfloat16, (300, 500), 5)
    base_state["bias"] = specials(torch.float32, (13,), 6)
    ck = ckptio.Checkpointer(options())
    ck.save(base_state, str(tmp_path / "step-1"))
    state = {k: (v if k in ("frozen", "bias") else touched(v)) for k, v in base_state.items()}
    ck.save(state, str(tmp_path / "step-2"), base=str(tmp_path / "step-1"))
    delta = str(tmp_path / "step-2")
    record = body(delta)
    assert record["version"] == manifest.VERSION_CODED and record["bases"] == ["step-1"]
    where = os.path.join(delta, "manifest.json")
    with open(where, "rb") as f:
        assert manifest.bases_of(manifest.decode(f.read(), where)) == ("step-1",)
    by_key = rows(delta)
    assert by_key["frozen"]["ref"] == {"checkpoint": "step-1"}
    assert by_key["bias"]["ref"] == {"checkpoint": "step-1"}
    assert by_key["frozen"]["file"] == rows(str(tmp_path / "step-1"))["frozen"]["file"]
    changed = [k for k in by_key if k not in ("frozen", "bias")]
    assert all("xor" in by_key[k] or "ref" not in by_key[k] for k in changed)
    assert sum("xor" in by_key[k] for k in changed) >= len(changed) - 2  # XOR of sparse changes pays
    out = ck.load(delta)
    for key, value in state.items():
        assert bits_equal(out[key], value), key
    ck.verify(delta)
    base_out = ck.load(str(tmp_path / "step-1"))  # the base is untouched
    assert all(bits_equal(base_out[k], v) for k, v in base_state.items())


def test_frozen_state_costs_nothing(tmp_path):
    state = {"frozen": torch.randn(512, 1024), "emb": torch.randn(1000, 256).to(torch.bfloat16)}
    ck = ckptio.Checkpointer(options("off"))  # references need no codec
    ck.save(state, str(tmp_path / "step-1"))
    ck.save(state, str(tmp_path / "step-2"), base=str(tmp_path / "step-1"))
    delta = str(tmp_path / "step-2")
    assert all("ref" in r for r in rows(delta).values())
    assert data_bytes(delta) <= 4096  # one empty segment file
    assert data_bytes(str(tmp_path / "step-1")) > 2 * MiB
    out = ck.load(delta)
    assert all(bits_equal(out[k], v) for k, v in state.items())


def test_without_a_codec_changed_chunks_are_stored_whole(tmp_path):
    state = {"w": specials(torch.float32, (FRAME,))}
    ck = ckptio.Checkpointer(options("off"))
    ck.save(state, str(tmp_path / "step-1"))
    new = {"w": touched(state["w"])}
    ck.save(new, str(tmp_path / "step-2"), base=str(tmp_path / "step-1"))
    row = rows(str(tmp_path / "step-2"))["w"]
    assert "xor" not in row and "ref" not in row and "stored" not in row
    assert bits_equal(ck.load(str(tmp_path / "step-2"))["w"], new["w"])


def test_resharded_loads_of_ref_and_xor_entries(tmp_path):
    full = specials(torch.bfloat16, (1024, 1024), 3)  # 8 frames
    ck = ckptio.Checkpointer(options())
    ck.save({"w": full, "f": full[:300].clone()}, str(tmp_path / "step-1"))
    new = touched(full)
    ck.save({"w": new, "f": full[:300].clone()}, str(tmp_path / "step-2"),
            base=str(tmp_path / "step-1"))
    by_key = rows(str(tmp_path / "step-2"))
    assert "xor" in by_key["w"] and "ref" in by_key["f"]
    band = ckptio.TensorShard(torch.zeros(200, 1024, dtype=full.dtype), (1024, 1024), (500, 0))
    head = ckptio.FlatShard(torch.zeros(1000, dtype=full.dtype), (300, 1024), 70_000)
    ck.load(str(tmp_path / "step-2"), {"w": band, "f": head})
    assert bits_equal(band.local, new[500:700])
    assert bits_equal(head.local, full[:300].reshape(-1)[70_000:71_000])


def _flip(path: str, file: str, offset: int) -> None:
    with open(os.path.join(path, file), "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def test_a_damaged_base_is_found_naming_the_step_key_and_file(tmp_path):
    full = specials(torch.float32, (FRAME // 2,), 4)  # 2 frames, incompressible: stored raw
    ck = ckptio.Checkpointer(options())
    base = str(tmp_path / "step-00000001")
    ck.save({"w": full, "frozen": full[:1000].clone()}, base)
    ck.save({"w": touched(full, 7), "frozen": full[:1000].clone()}, str(tmp_path / "step-2"),
            base=base)
    base_row = rows(base)["w"]
    _flip(base, base_row["file"], base_row["offset"] + FRAME + 5)  # frame 1 of the base
    with pytest.raises(CorruptCheckpointError) as info:
        ck.load(str(tmp_path / "step-2"))
    text = str(info.value)
    assert "base checkpoint step-00000001" in text and "'w'" in text
    assert base_row["file"] in text and "frame 1" in text
    band = ckptio.FlatShard(torch.zeros(1000), tuple(full.shape), 0)  # frame 0 only: fine
    ck.load(str(tmp_path / "step-2"), {"w": band}, strict=False)
    assert bits_equal(band.local, touched(full, 7)[:1000])
    frozen_row = rows(base)["frozen"]
    _flip(base, frozen_row["file"], frozen_row["offset"] + 3)  # a referenced entry
    with pytest.raises(CorruptCheckpointError, match=r"'frozen' of base checkpoint step-00000001"):
        ck.load(str(tmp_path / "step-2"), keys=["frozen"])


def test_a_missing_or_delta_base_is_refused(tmp_path):
    state = {"w": torch.randn(1000)}
    ck = ckptio.Checkpointer(options())
    ck.save(state, str(tmp_path / "step-1"))
    ck.save({"w": touched(state["w"])}, str(tmp_path / "step-2"), base=str(tmp_path / "step-1"))
    with pytest.raises(CkptError, match="itself a delta"):
        ck.save(state, str(tmp_path / "step-3"), base=str(tmp_path / "step-2"))
    with pytest.raises(CkptError, match="same directory"):
        ck.save(state, str(tmp_path / "other" / "step-3"), base=str(tmp_path / "step-1"))
    assert not os.path.exists(tmp_path / "step-3")
    shutil.rmtree(tmp_path / "step-1")
    with pytest.raises(CorruptCheckpointError, match="base checkpoint step-1"):
        ck.load(str(tmp_path / "step-2"))


def test_a_delta_named_by_a_bare_relative_path_finds_its_base(tmp_path, monkeypatch):
    """``cd ckpts && ckptio verify step-2`` (or load("step-2")): the base is the sibling
    ``step-1`` of the working directory; it was looked for at ``/step-1``, so a sound delta
    was refused as damaged, and a delta save named so was refused."""
    state = {"w": torch.randn(1000), "frozen": torch.randn(3000)}
    ck = ckptio.Checkpointer(options())
    monkeypatch.chdir(tmp_path)
    ck.save(state, "step-1")
    new = {"w": touched(state["w"]), "frozen": state["frozen"]}
    ck.save(new, "step-2", base="step-1")
    assert body(str(tmp_path / "step-2"))["bases"] == ["step-1"]
    out = ck.load("step-2")
    assert bits_equal(out["w"], new["w"]) and bits_equal(out["frozen"], new["frozen"])
    assert ck.verify("step-2") > 0


@pytest.mark.parametrize("scheme", ["mem", "shm"])
def test_memory_stores_round_trip_compressed_deltas(tmp_path, scheme, monkeypatch):
    monkeypatch.setenv("CKPTIO_SHM_DIR", str(tmp_path / "shm"))
    root = f"{scheme}://deltas-{os.getpid()}-{id(tmp_path)}"
    state = {"w": specials(torch.bfloat16, (FRAME,), 8), "frozen": torch.randn(3000)}
    ck = ckptio.Checkpointer(options())
    ck.save(state, f"{root}/step-1")
    new = {"w": touched(state["w"]), "frozen": state["frozen"]}
    ck.save(new, f"{root}/step-2", base=f"{root}/step-1")
    out = ck.load(f"{root}/step-2")
    assert bits_equal(out["w"], new["w"]) and bits_equal(out["frozen"], new["frozen"])
    ck.verify(f"{root}/step-2")


def test_lazy_and_eager_async_saves_of_compressed_deltas(tmp_path):
    """The capture is the training thread's only share: a lazy save returns before the
    optimizer's state is copied, an eager one once everything is; both round-trip."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 400), torch.nn.Linear(400, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        model(torch.randn(8, 300)).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    ck = ckptio.Checkpointer(options())
    base = str(tmp_path / "step-1")
    ck.async_save({"model": model, "optim": opt}, base).wait()
    step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}
    handle = ck.async_save({"model": model, "optim": opt}, str(tmp_path / "step-2"), lazy=True,
                           optimizers=[opt], base=base)
    step()  # waits for the optimizer's state to be copied first
    result = handle.wait()
    assert result.files and all(name.startswith("data-") for name in result.files)
    assert all(os.path.exists(tmp_path / "step-2" / name) for name in result.files)
    fresh = torch.nn.Sequential(torch.nn.Linear(300, 400), torch.nn.Linear(400, 10))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    ck.load(str(tmp_path / "step-2"), {"model": fresh, "optim": fresh_opt})
    assert all(bits_equal(fresh.state_dict()[k], v) for k, v in want.items())
    for k, s in want_opt.items():
        assert all(bits_equal(fresh_opt.state_dict()["state"][k][n], t) for n, t in s.items())
    assert body(str(tmp_path / "step-2"))["bases"] == ["step-1"]
