"""Megatron-Core's ``dist_checkpointing.save`` / ``load`` through ckptio's strategies
(ckptio/megatron_strategy.py), with the shapes of Megatron's own tests
(tests/unit_tests/dist_checkpointing/test_serialization.py): ShardedTensors sharded by tensor
parallelism, stacked with ``prepend_axis_num`` (pipeline layers), replicated over data
parallelism (replica ids), a ShardedTensorFactory, ShardedObjects and a common state. Saved on
2 gloo ranks with TP 2, loaded as TP 2 with the ranks swapped, as TP 1 / DP 2 (whole tensors on
every rank) and in one process; each load is compared bit for bit with what was saved and with
Megatron's own ``torch_dist`` strategy saving and loading the same state in the same processes.

CI's Python 3.11 venv has megatron-core 0.16.1 (the test extra; 0.19 needs Python >= 3.12,
where dev/megatron_tests.sh runs this file with 0.19.2, docs/guides/megatron.md); skipped
where it is not installed.
torch_dist calls ``torch.cuda.current_device()`` in its state-dict saver and
``torch.cuda.synchronize()`` in its writer; on a machine without a GPU the control replaces both
(ckptio's strategy saves first, before those replacements).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core.dist_checkpointing",
                    reason="megatron-core is not installed (the test extra has it); "
                           "dev/megatron_tests.sh runs this file with 0.19.2 on Python 3.12")
from megatron.core import dist_checkpointing as mdc  # noqa: E402
from megatron.core.dist_checkpointing.mapping import (  # noqa: E402
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.validation import StrictHandling  # noqa: E402

import ckptio  # noqa: E402
from ckptio.megatron_strategy import (  # noqa: E402
    CkptioLoadShardedStrategy,
    CkptioSaveShardedStrategy,
)
from ckptio.testing.rank_processes import run_ranks  # noqa: E402

A = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) / 7  # TP-split on rows
B = (torch.arange(2 * 5 * 4, dtype=torch.int64).reshape(2, 5, 4) * 1000003) % 99991  # 2 layers
C = torch.randn(3, 7, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # replicated
D = torch.arange(5, dtype=torch.float64)  # a factory's tensor


def _parts(key: str, tensor: torch.Tensor, replica_id: Any, flattened_range: Any) -> list[Any]:
    return [ShardedTensor.from_rank_offsets(f"{key}.part{i}", tensor * (i + 1),
                                            replica_id=replica_id) for i in range(3)]


def _merge(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] + parts[1] + parts[2]


def _state(tp: int, tp_rank: int, dp_rank: int, obj: int, fill: bool = True) -> dict[str, Any]:
    """The sharded state dict of a rank at (tp_rank of tp, dp_rank), holding piece ``obj`` of
    the 2-piece ShardedObject (objects are not resharded: their pieces keep the saved layout);
    ``fill``: this rank's values (else zeros and Nones, to load into)."""
    rows = A.shape[0] // tp

    def data(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if fill else torch.zeros_like(t)

    layers = {f"layer{i}": ShardedTensor.from_rank_offsets(
        "B", data(B[i]), (0, i, B.shape[0]), prepend_axis_num=1, replica_id=(0, 0, dp_rank))
        for i in range(B.shape[0]) if i % tp == tp_rank}  # a pipeline stage per TP rank
    return {
        "model": {
            "A": ShardedTensor.from_rank_offsets("A", data(A[tp_rank * rows:(tp_rank + 1) * rows]),
                                                 (0, tp_rank, tp), replica_id=(0, 0, dp_rank)),
            "layers": layers,
            "C": ShardedTensor.from_rank_offsets("C", data(C), replica_id=(0, tp_rank, dp_rank)),
            "D": ShardedTensorFactory("D", data(D), _parts, _merge, replica_id=(0, tp_rank, dp_rank)),
        },
        "objects": [ShardedObject("obj", {"piece": obj, "v": [1.5, None]} if fill else None,
                                  (2,), (obj,), replica_id=0),
                    ShardedObject("shared", b"\x00bytes" if fill else None, (1,), (0,),
                                  replica_id=tp_rank * 10 + dp_rank)],
        "iteration": 7,  # the common state
        "opt_param_scheduler": {"lr": 0.01, "steps": [1, 2]},
    }


def _expected(tp: int, tp_rank: int, obj: int) -> dict[str, Any]:
    rows = A.shape[0] // tp
    return {"A": A[tp_rank * rows:(tp_rank + 1) * rows],
            "layers": {f"layer{i}": B[i] for i in range(B.shape[0]) if i % tp == tp_rank},
            "C": C, "D": D * 6, "obj": {"piece": obj, "v": [1.5, None]},
            "shared": b"\x00bytes", "iteration": 7}


def _check(got: dict[str, Any], tp: int, tp_rank: int, obj: int) -> None:
    want = _expected(tp, tp_rank, obj)
    model = got["model"]
    for key in ("A", "C", "D"):
        assert model[key].dtype == want[key].dtype, key
        assert torch.equal(model[key].view(torch.uint8), want[key].view(torch.uint8)), key
    assert set(model["layers"]) == set(want["layers"])
    for name, t in want["layers"].items():
        assert torch.equal(model["layers"][name], t), name
    assert got["objects"][0] == want["obj"]
    assert got["objects"][1] == want["shared"]
    assert got["iteration"] == 7 and got["opt_param_scheduler"] == {"lr": 0.01, "steps": [1, 2]}


def _no_cuda_for_torch_dist() -> None:
    """torch_dist's saver puts a flag on ``torch.cuda.current_device()`` (on CPU: the host), its
    writer calls ``torch.cuda.synchronize()`` after staging and starts a multiprocessing
    Manager, which a daemonic rank process may not."""
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
        torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    mp.current_process().daemon = False


def _save_both(rank: int, world: int, root: str) -> None:
    """TP = world: ckptio's strategy (before any workaround for torch_dist), then torch_dist's."""
    for name in ("ckptio", "torch_dist"):
        if name == "torch_dist":
            _no_cuda_for_torch_dist()
        where = Path(root, name)
        if rank == 0:
            where.mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()
        strategy = CkptioSaveShardedStrategy() if name == "ckptio" else None
        mdc.save(_state(world, rank, 0, rank), str(where), sharded_strategy=strategy)


def _load_both(rank: int, world: int, root: str, tp: int, swap: bool) -> dict[str, Any]:
    """Load as ``tp`` (rank r takes TP rank r, or world - 1 - r with ``swap``) through both
    strategies; -> what ckptio's load gave, after checking both."""
    tp_rank = (world - 1 - rank if swap else rank) % tp
    dp_rank = rank // tp
    obj = world - 1 - rank if swap else rank
    got = {}
    for name in ("ckptio", "torch_dist"):  # ckptio's first: it makes no CUDA call
        if name == "torch_dist":
            _no_cuda_for_torch_dist()
        strategy = CkptioLoadShardedStrategy() if name == "ckptio" else None
        got[name] = mdc.load(_state(tp, tp_rank, dp_rank, obj, False), str(Path(root, name)),
                             sharded_strategy=strategy,
                             validate_access_integrity=world > 1)  # 1 rank: object piece 0 only
        _check(got[name], tp, tp_rank, obj)
    return {"tp_rank": tp_rank, "A": got["ckptio"]["model"]["A"]}


def _save_then_load(rank: int, world: int, root: str) -> list[dict[str, Any]]:
    _save_both(rank, world, root)
    return [_load_both(rank, world, root, 2, True), _load_both(rank, world, root, 1, False)]


def _metadata(root: str) -> tuple[Any, ...]:
    strategy = CkptioLoadShardedStrategy()
    tensors = mdc.load_tensors_metadata(root, strategy)
    sharded = mdc.serialization.load_sharded_metadata(root, strategy)
    state = _state(1, 0, 0, 0, fill=False)
    state["model"]["extra"] = ShardedTensor.from_rank_offsets("not_saved", torch.zeros(2))
    del state["model"]["C"]
    _loaded, missing, unexpected = mdc.load(state, root, sharded_strategy=strategy,
                                            strict=StrictHandling.RETURN_ALL,
                                            validate_access_integrity=False)
    return ({k: (tuple(v.global_shape), v.dtype) for k, v in tensors.items()}, sorted(sharded),
            sorted(missing), sorted(unexpected))


def _one_process(rank: int, world: int, root: str) -> tuple[Any, ...]:
    return _load_both(rank, world, root, 1, False), _metadata(str(Path(root, "ckptio")))


@pytest.fixture(scope="module")
def saved_tp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """Saved by both strategies on 2 ranks as TP 2, loaded back there as TP 2 with the ranks
    swapped and as TP 1 / DP 2."""
    root = tmp_path_factory.mktemp("tp2")
    return root, run_ranks(2, _save_then_load, str(root))


def test_tp2_saved_loads_as_tp2_swapped_and_tp1_dp2(saved_tp2: tuple[Path, list[Any]]) -> None:
    root, (rank0, rank1) = saved_tp2
    assert (root / "ckptio" / "ckptio").is_dir()  # ckptio's files inside Megatron's dir
    assert (root / "ckptio" / "metadata.json").is_file()
    assert [rank0[0]["tp_rank"], rank1[0]["tp_rank"]] == [1, 0]
    assert torch.equal(rank0[1]["A"], A) and torch.equal(rank1[1]["A"], A)


def test_one_process_load_metadata_and_strict_keys(saved_tp2: tuple[Path, list[Any]]) -> None:
    (got,) = run_ranks(1, _one_process, str(saved_tp2[0]))
    loaded, (tensors, sharded, missing, unexpected) = got
    assert torch.equal(loaded["A"], A)
    assert tensors["A"] == ((8, 6), torch.float32)
    assert tensors["B"] == ((2, 5, 4), torch.int64)
    assert tensors["C"] == ((3, 7), torch.bfloat16)
    assert set(tensors) == {"A", "B", "C", "D.part0", "D.part1", "D.part2"}
    assert {"obj/shard_0_2", "obj/shard_1_2", "shared/shard_0_1"} <= set(sharded)
    # Megatron's words: "missing" saved but asked for by no rank, "unexpected" asked for, not saved
    assert missing == ["C"]
    assert unexpected == ["not_saved"]


def _async_then_pickle(rank: int, world: int, root: str) -> list[str]:
    seen = []
    where = Path(root, "async")
    where.mkdir(parents=True, exist_ok=True)
    request = mdc.save(_state(1, 0, 0, 0), str(where), sharded_strategy=CkptioSaveShardedStrategy(),
                       async_sharded_save=True, validate_access_integrity=False)
    seen.append(f"metadata before finalize: {(where / 'metadata.json').exists()}")
    request.execute_sync()  # what Megatron's async queue does once the request is done
    _check(mdc.load(_state(1, 0, 0, 0, fill=False), str(where), validate_access_integrity=False,
                    sharded_strategy=CkptioLoadShardedStrategy()), 1, 0, 0)
    seen.append("async loaded")
    ns = Path(root, "namespace")
    ns.mkdir()

    def with_args(args: Any) -> dict[str, Any]:
        return {"args": ShardedObject("args", args, (1,), (0,), replica_id=0)}

    try:
        mdc.save(with_args(argparse.Namespace(lr=0.5)), str(ns),
                 sharded_strategy=CkptioSaveShardedStrategy())
    except ckptio.UnsupportedStateError as exc:
        seen.append(f"save refused: {exc}")
    mdc.save(with_args(argparse.Namespace(lr=0.5)), str(ns),
             sharded_strategy=CkptioSaveShardedStrategy(allow_pickle=True))
    try:
        mdc.load(with_args(None), str(ns), sharded_strategy=CkptioLoadShardedStrategy())
    except ckptio.PickleRefusedError as exc:
        seen.append(f"load refused: {exc}")
    got = mdc.load(with_args(None), str(ns),
                   sharded_strategy=CkptioLoadShardedStrategy(allow_pickle=True))
    seen.append(f"loaded {got['args']!r}")
    return seen


def test_async_request_and_pickle_only_by_opt_in(tmp_path: Path) -> None:
    (seen,) = run_ranks(1, _async_then_pickle, str(tmp_path))
    assert seen[0] == "metadata before finalize: False"
    assert seen[1] == "async loaded"
    assert seen[2].startswith("save refused: ") and "args/shard_0_1" in seen[2]
    assert "allow_pickle=True" in seen[2]
    assert seen[3].startswith("load refused: ") and "allow_pickle" in seen[3]
    assert seen[4] == "loaded Namespace(lr=0.5)"


def _kill_mid_save(root: str, phase: str) -> None:
    """In a process of its own (one rank): save, then save again into the same directory and
    die (SIGKILL) while ckptio writes (``phase="write"``) or after its commit, before
    ``common.pt`` is replaced (``"common"``)."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{root}.pg", rank=0,
                                         world_size=1)
    mdc.save(_state(1, 0, 0, 0), root, sharded_strategy=CkptioSaveShardedStrategy(),
             validate_access_integrity=False)
    newer = _state(1, 0, 0, 0)
    newer["model"]["A"].data.add_(1)
    newer["iteration"] = 8
    from ckptio import megatron_strategy
    from ckptio.saving import persist

    def die(*_args: Any, **_kwargs: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if phase == "write":
        persist.SaveJob.finish = die  # type: ignore[method-assign]
    else:
        megatron_strategy.write_common = die  # type: ignore[assignment]
    mdc.save(newer, root, sharded_strategy=CkptioSaveShardedStrategy(),
             validate_access_integrity=False)


def _load_one(rank: int, world: int, root: str) -> str:
    try:
        got = mdc.load(_state(1, 0, 0, 0, fill=False), root,
                       sharded_strategy=CkptioLoadShardedStrategy(),
                       validate_access_integrity=False)
    except ckptio.CorruptCheckpointError as exc:
        return f"refused: {exc}"
    _check(got, 1, 0, 0)
    return "previous"


def _megatron_writes_common_first() -> bool:
    """Before 0.19 Megatron's ``save`` writes ``common.pt`` itself, before the strategy runs;
    0.19 hands the common state to the strategy (which writes it after ckptio's commit)."""
    import inspect

    from megatron.core.dist_checkpointing import serialization

    return "common_strategy.save_common(" in inspect.getsource(serialization.save)


def test_kill_mid_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """Killed while ckptio writes: the previous save loads bit for bit where ``common.pt`` is
    the strategy's to write; where Megatron wrote the new one first, the load refuses it (it
    resumed the new iteration's common state with the old tensors before). Killed after
    ckptio's commit, before the strategy's ``common.pt``: refused, never mixed."""
    tests = str(Path(__file__).resolve().parent)
    first = _megatron_writes_common_first()
    for phase in ("write",) if first else ("write", "common"):
        root = tmp_path / phase
        root.mkdir()
        code = (f"import sys; sys.path.insert(0, {tests!r}); import test_megatron; "
                f"test_megatron._kill_mid_save({str(root)!r}, {phase!r})")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
        (outcome,) = run_ranks(1, _load_one, str(root))
        if phase == "write" and not first:
            assert outcome == "previous"
        else:
            assert outcome.startswith("refused: ") and "common.pt" in outcome
            assert "different saves" in outcome


def gpt_model(tp: int, seed: int) -> torch.nn.Module:
    """Megatron's GPTModel (2 layers, its local layer spec, no Transformer Engine) split by
    tensor parallelism ``tp``, initialized on the CPU: the whole weights are drawn first and
    then split, so a seed gives the same model at every TP."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, 1)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                               use_cpu_initialization=True, tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=128, max_sequence_length=32)


def _gpt_round(rank: int, world: int, root: str, save: bool) -> list[str]:
    """TP = world: save the seed-0 model (``save``); load into a seed-1 model -> the keys that
    differ from the seed-0 model's."""
    if save:
        mdc.save(gpt_model(world, 0).sharded_state_dict(), root,
                 sharded_strategy=CkptioSaveShardedStrategy())
    want = gpt_model(world, 0).state_dict()
    model = gpt_model(world, 1)
    model.load_state_dict(mdc.load(model.sharded_state_dict(), root,
                                   sharded_strategy=CkptioLoadShardedStrategy()))
    got = model.state_dict()
    return [k for k, v in want.items() if isinstance(v, torch.Tensor) and not torch.equal(v, got[k])]


def test_a_gpt_model_saved_as_tp2_loads_as_tp2_and_tp1(tmp_path: Path) -> None:
    """A real Megatron model's sharded state dict (its layers stacked: several pieces of one key
    per rank, each a Parameter): saved on 2 ranks as TP 2, loaded bit for bit into a model
    made with another seed as TP 2 and in one process as TP 1 (loading a stacked layer into a
    Parameter raised torch's in-place error on a leaf before)."""
    assert run_ranks(2, _gpt_round, str(tmp_path), True) == [[], []]
    assert run_ranks(1, _gpt_round, str(tmp_path), False) == [[]]
