"""ckptio.DcpReader: ``dcp.load(state, storage_reader=ckptio.DcpReader(path))`` of checkpoints
written by ``ckptio.save`` (FSDP2 on real gloo ranks, FlatShard partitions, per-rank and inline
values, aliases) and of stock DCP directories, with DCP's own planners.

Checked against DCP itself: the keys and planner_data DcpReader reports for a ckptio.save'd
state equal those of ``dcp.save`` of the same state (FileSystemWriter's .metadata), and what
``_load_state_dict_from_keys`` (DCP's ``_EmptyStateDictLoadPlanner``) returns through DcpReader
equals what it returns through FileSystemReader. Restored tensors are compared bitwise
(dtype and bytes). Faults: a flipped data byte reaches the caller as the CorruptCheckpointError
inside DCP's CheckpointException; a missing key or checkpoint is named.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

import ckptio
from ckptio.testing.rank_processes import run_ranks
from dist_cases import fully_shard_linears
from conftest import assert_same as _same

warnings.filterwarnings("ignore", message=".*process group.*", category=UserWarning)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

DIMS = (6, 10, 5)  # 5 rows over 2 or 4 ranks: uneven shards, one empty on 4
STEPS = 2


# ------------------------------------------------------------------------------------------------
# helpers (module level: the ranks import this module)


def _build(seed: int, fsdp: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(DIMS[0], DIMS[1]), torch.nn.ReLU(),
                                torch.nn.Linear(DIMS[1], DIMS[2]))
    if fsdp:
        fully_shard_linears(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        model(torch.randn(4, DIMS[0], generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _dcp_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # on a fresh optimizer this creates its state first (the tensors a load fills)
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _full(value: torch.Tensor) -> np.ndarray:
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    return full.detach().clone().numpy()


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every parameter and optimizer tensor whole (a collective under FSDP2), and the groups."""
    state = _dcp_state(model, opt)
    out: dict[str, Any] = {f"model.{k}": _full(v) for k, v in state["model"].items()}
    for fqn, slots in state["optim"]["state"].items():
        for name, value in slots.items():
            out[f"optim.{fqn}.{name}"] = _full(value)
    out["param_groups"] = [dict(g) for g in state["optim"]["param_groups"]]
    return out


def fsdp_save(rank: int, world: int, ck: str, stock: str) -> dict[str, Any]:
    """Train FSDP2 + AdamW, then save the same state with ckptio.save and with dcp.save."""
    model, opt = _build(0, fsdp=True)
    _train(model, opt)
    state = _dcp_state(model, opt)
    ckptio.save({**state, "step": STEPS}, ck)
    dcp.save({**state, "step": STEPS}, checkpoint_id=stock)
    return _snapshot(model, opt)


def fsdp_load(rank: int, world: int, paths: list[str]) -> list[dict[str, Any]]:
    """Fresh FSDP2 model and optimizer (another seed), loaded the way DCP users do."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    out = []
    for path in paths:
        model, opt = _build(1, fsdp=True)
        state = {**_dcp_state(model, opt), "step": -1}
        dcp.load(state, storage_reader=ckptio.DcpReader(path))
        assert state["step"] == STEPS, state["step"]
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out.append(_snapshot(model, opt))
    return out


# ------------------------------------------------------------------------------------------------
# (1) FSDP2 + AdamW saved by ckptio on 2 ranks, loaded by dcp.load on 2, 1 and 4 ranks; (5) the
# stock DCP checkpoint of the same state through DcpReader; keys equal to DCP's own


@pytest.fixture(scope="module")
def fsdp_saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fsdp")
    ck, stock = str(root / "ckptio"), str(root / "dcp")
    want = run_ranks(2, fsdp_save, ck, stock, timeout_s=300)
    _same(want[1], want[0], "ranks agree")
    return {"ck": ck, "stock": stock, "want": want[0]}


def test_keys_and_paths_match_dcp_save_of_the_same_state(fsdp_saved: dict[str, Any]) -> None:
    ours = ckptio.DcpReader(fsdp_saved["ck"]).read_metadata()
    theirs = FileSystemReader(fsdp_saved["stock"]).read_metadata()
    assert sorted(ours.state_dict_metadata) == sorted(theirs.state_dict_metadata)
    assert ours.planner_data == theirs.planner_data
    assert "optim.param_groups.0.betas" in ours.planner_data  # a tuple: one BYTE_IO key
    for fqn, md in theirs.state_dict_metadata.items():
        mine = ours.state_dict_metadata[fqn]
        assert type(mine) is type(md), fqn
        if hasattr(md, "size"):
            assert (mine.size, mine.properties.dtype) == (md.size, md.properties.dtype), fqn
            got = sorted((tuple(c.offsets), tuple(c.sizes)) for c in mine.chunks)
            assert got == sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks
                                 if all(c.sizes)), fqn


@pytest.mark.parametrize("world", [2, 1, 4])
def test_fsdp2_checkpoint_loads_through_dcp_load(fsdp_saved: dict[str, Any], world: int) -> None:
    results = run_ranks(world, fsdp_load, [fsdp_saved["ck"], fsdp_saved["stock"]], timeout_s=300)
    for rank, (from_ckptio, from_stock) in enumerate(results):
        _same(from_ckptio, fsdp_saved["want"], f"ckptio.save -> {world} ranks, rank {rank}")
        _same(from_stock, fsdp_saved["want"], f"dcp.save -> {world} ranks, rank {rank}")
    assert fsdp_saved["want"]["param_groups"][0]["betas"] == (0.8, 0.95)


def test_a_fresh_model_is_not_already_equal(fsdp_saved: dict[str, Any]) -> None:
    """The comparison can fail: a fresh model differs from the trained one."""
    model, _opt = _build(1, fsdp=False)
    fresh = model.state_dict()["0.weight"].numpy()
    assert not np.array_equal(fresh, fsdp_saved["want"]["model.0.weight"])


# ------------------------------------------------------------------------------------------------
# (2) FlatShard partitions and per-rank values saved on 2 ranks, loaded by dcp.load on 1 process

FLAT_SHAPE = (5, 7)
FLAT_SPLIT = 13  # not a multiple of the row length 7: rank 0 ends inside row 1


def _flat_global() -> torch.Tensor:
    return torch.arange(35, dtype=torch.float32).reshape(FLAT_SHAPE) * 1.5 - 7


def flat_save(rank: int, world: int, path: str) -> None:
    whole = _flat_global().reshape(-1)
    lo, hi = (0, FLAT_SPLIT) if rank == 0 else (FLAT_SPLIT, whole.numel())
    cols = _flat_global()[:, 4 * rank:4 + 3 * rank]  # columns 0-3 and 4-6: Shard(1)-like boxes
    ckptio.save({"w": ckptio.FlatShard(whole[lo:hi].clone(), FLAT_SHAPE, lo),
                 "c": ckptio.TensorShard(cols.clone(), FLAT_SHAPE, (0, 4 * rank)),
                 "rng": torch.full((3,), float(rank)), "seen": 10 + rank}, path)


def test_flat_shards_and_per_rank_values_load_through_dcp_load(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "flat")
    run_ranks(2, flat_save, path, timeout_s=120)
    calls = _count_read_passes(monkeypatch)
    state = {"w": torch.zeros(FLAT_SHAPE), "c": torch.zeros(FLAT_SHAPE), "rng": torch.zeros(3),
             "seen": 0}
    dcp.load(state, storage_reader=ckptio.DcpReader(path, per_rank_from=1))
    _same(state["w"], _flat_global(), "w")
    _same(state["c"], _flat_global(), "c: column boxes into non-contiguous views of the dest")
    _same(state["rng"], torch.full((3,), 1.0), "rng: saved rank 1's")
    assert state["seen"] == 11
    assert calls == [1]  # every tensor item of the plan in one read pass
    # the flat ranges became boxes: at most 2*ndim-1 per range, tiling the tensor
    md = ckptio.DcpReader(path, per_rank_from=0).read_metadata().state_dict_metadata["w"]
    boxes = sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
    assert boxes == [((0, 0), (1, 7)), ((1, 0), (1, 6)), ((1, 6), (1, 1)), ((2, 0), (3, 7))]
    # a destination of another dtype: read staged in the stored dtype, then converted
    wide = {"w": torch.zeros(FLAT_SHAPE, dtype=torch.float64)}
    dcp.load(wide, storage_reader=ckptio.DcpReader(path))
    _same(wide["w"], _flat_global().double(), "w as float64")
    # a sub-box of the tensor (a resharded destination) through the planner's narrowing
    part = _flat_global()[1:4, 2:6]
    got = _load_region(path, (1, 2), part.shape)
    _same(got, part, "w[1:4, 2:6]")


def _load_region(path: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """Load a box of "w" through DCP's own resharding (a ShardedTensor-free way: a planner
    that asks for the box as a read of the global tensor)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
    )
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import (
        create_read_items_for_chunk_list,
    )

    dest = torch.zeros(sizes)

    class Box(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            md = self.metadata.state_dict_metadata["w"]
            want = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            return LoadPlan(create_read_items_for_chunk_list("w", md, [want]))

        def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
            return dest

    dcp.load({"w": torch.zeros(FLAT_SHAPE)}, storage_reader=ckptio.DcpReader(path), planner=Box())
    return dest


def test_per_rank_values_on_another_world_size_need_per_rank_from(tmp_path: Path) -> None:
    path = str(tmp_path / "flat")
    run_ranks(2, flat_save, path, timeout_s=120)
    state = {"w": torch.zeros(FLAT_SHAPE), "rng": torch.zeros(3)}
    with pytest.raises(CheckpointException) as info:
        dcp.load(state, storage_reader=ckptio.DcpReader(path))
    error = _ckpt_error(info.value)
    assert isinstance(error, ckptio.StateMismatchError)
    assert "'rng'" in str(error) and "per_rank_from" in str(error)
    # without the per-rank key, the rest loads
    state = {"w": torch.zeros(FLAT_SHAPE), "c": torch.zeros(FLAT_SHAPE, dtype=torch.bfloat16)}
    dcp.load(state, storage_reader=ckptio.DcpReader(path))
    _same(state["w"], _flat_global(), "w")
    _same(state["c"], _flat_global().bfloat16(), "c as bfloat16")


def _count_read_passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many loading/read.read_regions passes each Checkpointer.read makes (appended)."""
    import ckptio.loading.read

    calls: list[int] = []
    real = ckptio.loading.read.read_regions

    def counting(*args: Any, **kwargs: Any) -> int:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ckptio.loading.read, "read_regions", counting)
    calls.clear()
    return calls


def _ckpt_error(exc: CheckpointException) -> BaseException:
    """The exception a rank raised, from DCP's CheckpointException (rank -> (exc, trace))."""
    (error, _trace), = exc.failures.values()
    return error


# ------------------------------------------------------------------------------------------------
# (3) inline values, aliases, nested containers; (4) _EmptyStateDictLoadPlanner


def _values_state() -> dict[str, Any]:
    shared = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    return {
        "step": 7, "lr": 0.1 + 0.2, "betas": (0.9, 0.999), "name": "run-3", "none": None,
        "flags": [True, False], "nest": [[1, 2], [3, [4.5, None]]], "tup": (1, ("a", 2.5)),
        "big": 1 << 70, "inf": float("-inf"),
        "tied": {"a": shared, "b": shared},  # one tensor under two keys: an alias
        "mixed": [torch.tensor([1.5, -2.0], dtype=torch.bfloat16), 5, {"x": torch.ones(2)}],
        "np": np.arange(4, dtype=np.int16), "raw": b"\x00\x01\xff",
        "group": {"params": [0, 1], "lr": 1e-3},
    }


def _blank(value: Any) -> Any:
    """The same structure with other values (what a fresh state holds before a load)."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: _blank(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_blank(v) for v in value]
    if isinstance(value, np.ndarray):
        return np.zeros_like(value)
    return None


def test_inline_values_and_aliases_come_back_equal(tmp_path: Path) -> None:
    path = str(tmp_path / "values")
    ckptio.save(_values_state(), path)
    state = _blank(_values_state())
    dcp.load(state, storage_reader=ckptio.DcpReader(path))
    _same(state, _values_state())
    md = ckptio.DcpReader(path).read_metadata()
    assert "betas" in md.state_dict_metadata and "betas.0" not in md.state_dict_metadata
    assert md.planner_data["mixed.2.x"] == ("mixed", 2, "x")


def test_empty_state_dict_planner_loads_everything_as_dcp_would(tmp_path: Path) -> None:
    """DCP's _EmptyStateDictLoadPlanner (dcp_to_torch_save) rebuilds the state from our
    metadata; the result equals what it rebuilds from dcp.save of the same state."""
    ck, stock = str(tmp_path / "ck"), str(tmp_path / "dcp")
    state = {k: v for k, v in _values_state().items() if k not in ("np", "raw")}
    ckptio.save(state, ck)
    dcp.save(state, checkpoint_id=stock)
    ours = _load_state_dict_from_keys(storage_reader=ckptio.DcpReader(ck))
    theirs = _load_state_dict_from_keys(storage_reader=FileSystemReader(stock))
    _same(ours, theirs)
    _same(ours["tied"]["b"], state["tied"]["b"], "alias")
    only = _load_state_dict_from_keys(keys={"tied"}, storage_reader=ckptio.DcpReader(ck))
    _same(only, {"tied": state["tied"]})


# ------------------------------------------------------------------------------------------------
# (6) corruption, (7) missing keys, and the reader's own contract


def test_a_flipped_data_byte_raises_corrupt_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    ckptio.save({"w": torch.arange(1000, dtype=torch.float32)}, str(path))
    (data,) = path.glob("data-*.bin")
    raw = bytearray(data.read_bytes())
    raw[123] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(1000)}, storage_reader=ckptio.DcpReader(str(path)))
    error = _ckpt_error(info.value)
    assert isinstance(error, ckptio.CorruptCheckpointError), error
    assert "'w'" in str(error) and data.name in str(error)
    assert "CorruptCheckpointError" in str(info.value)  # DCP's text names it too
    # verify=False reads it unchecked (the byte is wrong, the load completes)
    out = {"w": torch.zeros(1000)}
    dcp.load(out, storage_reader=ckptio.DcpReader(str(path), verify=False))
    assert not torch.equal(out["w"], torch.arange(1000, dtype=torch.float32))


def test_a_flipped_byte_of_a_stock_dcp_item_raises_corrupt_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "dcp"
    want = torch.arange(1000, dtype=torch.float32)
    dcp.save({"w": want}, checkpoint_id=str(path))
    (data,) = path.glob("*.distcp")
    raw = bytearray(data.read_bytes())
    at = raw.find(want.numpy().tobytes()[:64])
    assert at > 0
    raw[at + 200] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(1000)}, storage_reader=ckptio.DcpReader(str(path)))
    assert isinstance(_ckpt_error(info.value), ckptio.CorruptCheckpointError)


def test_a_key_the_checkpoint_lacks_is_named(tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    ckptio.save({"w": torch.ones(3)}, path)
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(3), "extra": torch.zeros(2)},
                 storage_reader=ckptio.DcpReader(path))
    assert "Missing key in checkpoint state_dict: extra" in str(info.value)
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(3)}, storage_reader=ckptio.DcpReader(str(tmp_path / "none")))
    text = str(info.value)  # DCP keeps only read_metadata's message, inside an AssertionError
    assert "global metadata read failed" in text and str(tmp_path / "none") in text


def test_the_reader_pickles_without_resources_and_checks_ids(tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    ckptio.save({"w": torch.ones(3)}, path)
    reader = ckptio.DcpReader(path, per_rank_from=0)
    reader.read_metadata()
    copy = pickle.loads(pickle.dumps(reader))
    assert vars(copy)["_record"] is None and copy.path == path and copy.per_rank_from == 0
    out = {"w": torch.zeros(3)}
    dcp.load(out, storage_reader=copy)
    _same(out["w"], torch.ones(3))
    other = str(tmp_path / "other")
    ckptio.save({"w": torch.full((3,), 2.0)}, other)
    dcp.load(out, checkpoint_id=other, storage_reader=copy)  # reset(checkpoint_id)
    _same(out["w"], torch.full((3,), 2.0))
    assert ckptio.DcpReader.validate_checkpoint_id(path)
    assert ckptio.DcpReader.validate_checkpoint_id("s3://bucket/prefix/step-1")
    assert ckptio.DcpReader.validate_checkpoint_id("gs://bucket/prefix/step-1")
    assert not ckptio.DcpReader.validate_checkpoint_id("hdfs://bucket/x")
    assert isinstance(reader, dcp.StorageReader)


class Opaque:
    """A value only pickle stores (saved with allow_pickle=True)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.n == self.n


def test_pickled_values_need_allow_pickle(tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    ckptio.save({"obj": Opaque(3), "w": torch.ones(2)}, path, allow_pickle=True)
    with pytest.raises(CheckpointException) as info:
        dcp.load({"obj": None, "w": torch.zeros(2)}, storage_reader=ckptio.DcpReader(path))
    error = _ckpt_error(info.value)
    assert isinstance(error, ckptio.PickleRefusedError) and "'obj'" in str(error), error
    state: dict[str, Any] = {"obj": None, "w": torch.zeros(2)}
    dcp.load(state, storage_reader=ckptio.DcpReader(path, allow_pickle=True))
    assert state["obj"] == Opaque(3)
    _same(state["w"], torch.ones(2))


def test_a_state_that_is_not_a_dict_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    ckptio.save([torch.ones(2), 3], path)
    with pytest.raises(ckptio.CkptError, match="ckptio.load"):
        ckptio.DcpReader(path).read_metadata()


def test_a_value_dcp_pickled_needs_allow_pickle_too(tmp_path: Path) -> None:
    """A value dcp.save wrote through DcpWriter as torch.save bytes (one weights_only refuses)
    reaches DCP's own torch.load(weights_only=False) only with allow_pickle=True."""
    path = str(tmp_path / "ck")
    dcp.save({"obj": Opaque(3), "w": torch.ones(2)}, storage_writer=ckptio.DcpWriter(path))
    with pytest.raises(CheckpointException) as info:
        dcp.load({"obj": None, "w": torch.zeros(2)}, storage_reader=ckptio.DcpReader(path))
    error = _ckpt_error(info.value)
    assert isinstance(error, ckptio.PickleRefusedError) and "'obj'" in str(error), error
    assert "allow_pickle=True" in str(error)
    state: dict[str, Any] = {"obj": None, "w": torch.zeros(2)}
    dcp.load(state, storage_reader=ckptio.DcpReader(path, allow_pickle=True))
    assert state["obj"] == Opaque(3)
    _same(state["w"], torch.ones(2))
