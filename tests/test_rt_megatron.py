"""A demanding Megatron user against ckptio's ``dist_checkpointing`` strategies with real
GPTModels on the CPU (gloo ranks): TP 2 -> TP 1 / DP 2 -> TP 2, pipeline stages (PP 2) loaded
as PP 1 and back, replicas written once, a changed model (hidden size, layers, sequence
length) refused before anything loads, a padded vocabulary of another size loaded, another
backend's directory refused naming it, a rank's mismatch, strict modes, plain-tensor and
metadata reads, an async save killed before its finalize, Megatron's RNG-state ShardedObject
(with its empty dict) round trip without pickle, and no thread or fd growth over many saves.
Scenarios are batched into two run_ranks calls (each rank process imports Megatron once).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core.dist_checkpointing",
                    reason="megatron-core is not installed (the test extra has it)")
from megatron.core import dist_checkpointing as mdc  # noqa: E402
from megatron.core.dist_checkpointing.core import CheckpointingException  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.validation import StrictHandling  # noqa: E402

import ckptio  # noqa: E402
from ckptio.megatron_strategy import (  # noqa: E402
    CkptioLoadShardedStrategy,
    CkptioSaveShardedStrategy,
    MissingInCheckpointError,
)
from ckptio.testing.rank_processes import run_ranks  # noqa: E402

SAVE, LOAD = CkptioSaveShardedStrategy, CkptioLoadShardedStrategy


def _gpt(tp: int, seed: int, pp: int = 1, layers: int = 2, hidden: int = 64,
         vocab: int = 128, max_sequence_length: int = 32, gated: bool = False) -> torch.nn.Module:
    """Megatron's GPTModel on the CPU (local layer spec) at TP ``tp`` / PP ``pp`` (this rank's
    stage only); ``gated``: a gated MLP (SwiGLU-style ``linear_fc1``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp)
    config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=4,
                               use_cpu_initialization=True, tensor_model_parallel_size=tp,
                               pipeline_model_parallel_size=pp,
                               pipeline_dtype=torch.float32 if pp > 1 else None,
                               gated_linear_unit=gated)
    torch.manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=vocab, max_sequence_length=max_sequence_length,
                    pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage())


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _load(model: torch.nn.Module, where: Path) -> dict[str, torch.Tensor]:
    model.load_state_dict(mdc.load(model.sharded_state_dict(), str(where), sharded_strategy=LOAD()))
    return _tensors(model)


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in a if not torch.equal(a[k], b[k]))


def _changed_model(world: int, where: Path) -> list[tuple[str, str, int]]:
    """Models built differently from the TP ``world`` save: -> (change, error, tensors that
    changed in place) each."""
    out = []
    for change in ({"hidden": 128}, {"layers": 3}, {"max_sequence_length": 64}):
        model = _gpt(world, 1, **change)  # type: ignore[arg-type]
        before = _tensors(model)
        try:
            _load(model, where)
            error = "loaded"
        except MissingInCheckpointError as exc:
            error = f"{isinstance(exc, CheckpointingException)} {exc}"
        out.append((str(change), error, len(_differ(before, _tensors(model)))))
    return out


def _vocab(rank: int, where: Path, full: dict[str, torch.Tensor]) -> list[str]:
    """Another (padded) vocabulary size, as a TP change makes in Megatron: its embedding and
    output layer allow a shape mismatch; each rank's rows load from the saved ones where
    there are some, zeros beyond (as torch_dist does; refused before) -> what differs."""
    wrong = []
    for vocab in (256, 64):
        got = _load(_gpt(2, 1, vocab=vocab), where)
        rows = vocab // 2
        for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            want = torch.zeros(rows, 64)
            saved = full[key][rank * rows:(rank + 1) * rows]
            want[:len(saved)] = saved
            if not torch.equal(got[key], want):
                wrong.append(f"{vocab} {key}")
        got.pop("embedding.word_embeddings.weight")
        got.pop("output_layer.weight")
        wrong += [f"{vocab} {k}" for k in _differ(got, _tensors(_gpt(2, 0)))]
    return wrong


def _adam(model: torch.nn.Module, grads: bool) -> tuple[torch.optim.Adam, dict[str, Any]]:
    """A stepped Adam and the model's and its sharded state (Megatron's mapping of each
    per-parameter state to its parameter's ShardedTensor; ``step`` stays out of it)."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    torch.manual_seed(7)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.randn_like(p) if grads else torch.zeros_like(p)
    opt.step()
    sharded = model.sharded_state_dict()
    state = opt.state_dict()
    optim_state_to_sharding_state(state, get_param_id_to_sharded_param_map(
        sharded, [p for g in opt.param_groups for p in g["params"]]), exclude_keys=("step",))
    return opt, {"model": sharded, "optimizer": state}


def _optimizer(rank: int, where: Path) -> list[str]:
    """Adam's state saved at TP 2, loaded at TP 2 and TP 1 / DP 2 -> what differs."""
    opt, state = _adam(_gpt(2, 0), True)
    mdc.save(state, str(where), sharded_strategy=SAVE())
    saved = [opt.state[p] for g in opt.param_groups for p in g["params"]]
    wrong = []
    for tp in (2, 1):
        model = _gpt(tp, 1)
        _fresh, empty = _adam(model, False)
        got = mdc.load(empty, str(where), sharded_strategy=LOAD())["optimizer"]
        for i in range(len(saved)):
            for name in ("exp_avg", "exp_avg_sq"):
                want = saved[i][name]
                have = got["state"][i][name]
                if tp == 1 and have.shape != want.shape:  # the embedding, split by TP 2 rows
                    have = have[rank * want.shape[0]:(rank + 1) * want.shape[0]]
                if (tp == 2 or i == 0) and not torch.equal(have, want):  # TP 1: the embedding
                    wrong.append(f"{tp} {i} {name}")
    return wrong


def _gated(base: Path) -> list[str]:
    """A gated MLP at TP 2: refused on every rank before ckptio writes (its fc1 halves are
    apart: a known limit); with the state the refusal names (Megatron's singleton local
    shards) saved, then loaded at TP 1 / DP 2 -> [refusal, what differs]."""
    where = base / "gated"
    where.mkdir(exist_ok=True)
    try:
        mdc.save(_gpt(2, 0, gated=True).sharded_state_dict(), str(where), sharded_strategy=SAVE())
        refusal = "saved"
    except ckptio.UnsupportedStateError as exc:
        refusal = str(exc)
    def singleton() -> dict[str, Any]:  # Megatron adds its DP group to the dict given
        return {"singleton_local_shards": True}

    mdc.save(_gpt(2, 0, gated=True).sharded_state_dict(metadata=singleton()), str(where),
             sharded_strategy=SAVE())
    want = _tensors(_gpt(1, 0, gated=True))
    model = _gpt(1, 1, gated=True)
    model.load_state_dict(mdc.load(model.sharded_state_dict(metadata=singleton()), str(where),
                                   sharded_strategy=LOAD()))
    return [refusal, *_differ(want, _tensors(model))]


def _one_rank_mismatch(rank: int, root: Path) -> str:
    """Only rank 0's state differs (one key's shape): every rank raises a ckptio error."""
    def state(n: int) -> dict[str, Any]:
        return {"a": ShardedTensor.from_rank_offsets("A", torch.arange(n) * 1.0, (0, rank, 2))}

    mdc.save(state(4), str(root), sharded_strategy=SAVE())
    try:
        mdc.load(state(5 if rank == 0 else 4), str(root), sharded_strategy=LOAD(),
                 validate_access_integrity=False)
    except ckptio.CkptError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def _written_once(where: Path) -> bool:
    """Every element of every saved tensor is stored exactly once (no replica's copy)."""
    record = ckptio.Checkpointer().manifest(where / "ckptio")
    shapes: dict[str, tuple[tuple[int, ...], int]] = {}
    stored: dict[str, int] = {}
    for e in record.tensors:
        if e.key.startswith("tensors."):
            size = torch.empty((), dtype=getattr(torch, e.dtype.removeprefix("torch."))).itemsize
            shapes[e.key] = (e.shape, size)
            stored[e.key] = stored.get(e.key, 0) + e.nbytes
    return all(stored[k] == int(torch.Size(s).numel()) * n for k, (s, n) in shapes.items())


def _layouts(rank: int, world: int, root: str) -> dict[str, Any]:
    base = Path(root)
    out: dict[str, Any] = {}
    mdc.save(_gpt(2, 0).sharded_state_dict(), str(base / "tp2"), sharded_strategy=SAVE()) \
        if (base / "tp2").mkdir(exist_ok=True) is None else None
    full = _tensors(_gpt(1, 0))  # TP 1 / DP 2: every rank the whole model
    tp1 = _gpt(1, 1)
    out["tp2->tp1"] = _differ(full, _load(tp1, base / "tp2"))
    (base / "tp1").mkdir(exist_ok=True)
    mdc.save(tp1.sharded_state_dict(), str(base / "tp1"), sharded_strategy=SAVE())
    out["tp1 once"] = _written_once(base / "tp1")
    out["tp1->tp2"] = _differ(_tensors(_gpt(2, 0)), _load(_gpt(2, 2), base / "tp1"))
    plain = mdc.load_plain_tensors(str(base / "tp2"))  # no strategy named: the registry's
    out["plain"] = [k for k, v in full.items() if k in plain and not torch.equal(plain[k], v)]
    out["stacked"] = tuple(plain["decoder.layers.self_attention.linear_qkv.weight"].shape)
    out["changed"] = _changed_model(2, base / "tp2")
    out["vocab"] = _vocab(rank, base / "tp2", full)
    stage = _gpt(1, 0, pp=2)  # PP 2: each rank its stage's layer
    out["stage"] = _tensors(stage)
    (base / "pp2").mkdir(exist_ok=True)
    mdc.save(stage.sharded_state_dict(), str(base / "pp2"), sharded_strategy=SAVE())
    whole = _gpt(1, 1)
    out["pp1"] = _load(whole, base / "pp2")
    (base / "pp1").mkdir(exist_ok=True)
    mdc.save(whole.sharded_state_dict(), str(base / "pp1"), sharded_strategy=SAVE())
    out["back"] = _differ(out["stage"], _load(_gpt(1, 2, pp=2), base / "pp1"))
    (base / "adam").mkdir(exist_ok=True)
    out["adam"] = _optimizer(rank, base / "adam")
    out["gated"] = _gated(base)
    (base / "one").mkdir(exist_ok=True)
    out["one rank"] = _one_rank_mismatch(rank, base / "one")
    return out


def test_gpt_layouts_round_trip_and_a_changed_model_loads_nothing(tmp_path: Path) -> None:
    """TP 2 -> TP 1 / DP 2 -> TP 2 and PP 2 -> PP 1 -> PP 2 bit for bit; DP replicas stored
    once; a model built with another hidden size / layer count / sequence length is refused
    on every rank naming the key and both shapes, with no tensor of the model changed (the
    matching ones loaded in place before, then the error came); another vocabulary size
    loads as torch_dist loads it; Adam's state mapped by Megatron loads at TP 2 and TP 1; a
    gated MLP at TP 2 refused on every rank naming its key and the way round (a known
    limit), which then loads at TP 1."""
    results = run_ranks(2, _layouts, str(tmp_path), timeout_s=240)
    for rank, got in enumerate(results):
        assert got["tp2->tp1"] == [] and got["tp1->tp2"] == [], rank
        assert got["tp1 once"], rank
        assert got["back"] == [], rank
        for change, error, changed in got["changed"]:
            assert error.startswith("True "), (change, error)  # a CheckpointingException too
            assert "in the state" in error and "in the checkpoint" in error, error
            assert "nothing was loaded" in error
            assert changed == 0, (rank, change, error)
        hidden = got["changed"][0][1]
        assert "embedding.position_embeddings.weight: shape (32, 128) in the state, (32, 64)" \
            in hidden
        assert "decoder.layers.self_attention.linear_proj.weight" in got["changed"][1][1]
        assert "embedding.position_embeddings.weight: shape (64, 64)" in got["changed"][2][1]
        assert got["vocab"] == [], (rank, got["vocab"])
        assert got["adam"] == [], (rank, got["adam"])
        assert got["plain"] == [] and got["stacked"] == (2, 192, 64), rank
        refusal, *gated_differ = got["gated"]
        assert "'decoder.layers.mlp.linear_fc1.weight'" in refusal, refusal
        assert "gated MLP" in refusal and "'singleton_local_shards': True" in refusal
        assert gated_differ == [], gated_differ
    first, last = results[0], results[1]
    pp1 = first["pp1"]
    assert _differ(pp1, results[1]["pp1"]) == []  # DP 2 of PP 1: both the whole model
    for key, value in first["stage"].items():  # stage 0: layer 0 and the embedding
        assert torch.equal(pp1[key], value), key
    for key, value in last["stage"].items():  # stage 1: its layer 0 is layer 1
        assert torch.equal(pp1[key.replace("layers.0.", "layers.1.")], value), key
    assert results[0]["one rank"].startswith("MissingInCheckpointError: ")
    assert "tensors.A: shape (10,) in the state, (8,) in the checkpoint" in results[0]["one rank"]
    assert results[1]["one rank"].startswith("RankFailedError: ")
    assert "rank 0" in results[1]["one rank"] and "tensors.A" in results[1]["one rank"]


def _small(v: float, extra: bool = False) -> dict[str, Any]:
    state: dict[str, Any] = {"a": ShardedTensor.from_rank_offsets("A", torch.arange(4.0) + v),
                             "b": ShardedTensor.from_rank_offsets("B", torch.ones(3) * v),
                             "iteration": int(v)}
    if extra:
        state["x"] = ShardedTensor.from_rank_offsets("X", torch.ones(2))
    return state


def _outcome(call: Any) -> str:
    try:
        return f"ok {call()!r}"
    except (ckptio.CkptError, CheckpointingException) as exc:
        return f"{type(exc).__name__} {isinstance(exc, CheckpointingException)}: {exc}"


def _no_cuda() -> None:
    """torch_dist's saver and writer call CUDA; its writer starts a Manager (not daemonic)."""
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
        torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    mp.current_process().daemon = False


def _kill_async(root: str) -> None:
    """In a process of its own: a save, then an async save into the same directory killed
    (SIGKILL) while ckptio writes, before the request's finalize."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{root}.pg", rank=0,
                                         world_size=1)
    mdc.save(_small(1), root, sharded_strategy=SAVE(), validate_access_integrity=False)
    from ckptio.saving import persist

    def die(*_args: Any, **_kwargs: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    persist.SaveJob.finish = die  # type: ignore[method-assign]
    request = mdc.save(_small(2), root, sharded_strategy=SAVE(), async_sharded_save=True,
                       validate_access_integrity=False)
    request.execute_sync()


def _rng_state() -> dict[str, Any]:
    """What Megatron's training loop puts in its ``rng_state`` ShardedObject."""
    import numpy as np

    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}


def _rng_round(where: Path) -> str:
    """Megatron's RNG-state ShardedObject (tuples, a NumPy state, a tensor, an empty dict)
    saved without pickle, loaded (an empty dict under it vanished before: Megatron's resume
    reads ``rng_tracker_states``), then used; and the load of empty ShardedObjects under a
    strict mode that reads the checkpoint's metadata (they were "unexpected" and dropped)."""
    import numpy as np

    def state(value: Any, empty: Any = None) -> dict[str, Any]:
        return {"rng_state": ShardedObject("rng_state", value, (1,), (0,), replica_id=0),
                "empty": ShardedObject("empty", empty, (1,), (0,), replica_id=0)}

    where.mkdir()
    mdc.save(state([_rng_state()], {}), str(where), sharded_strategy=SAVE())
    loaded, missing, unexpected = mdc.load(state(None), str(where), sharded_strategy=LOAD(),
                                           strict=StrictHandling.RETURN_ALL)
    (got,) = loaded["rng_state"]
    random.setstate(got["random_rng_state"])
    np.random.set_state(got["np_rng_state"])
    torch.set_rng_state(got["torch_rng_state"])
    return (f"{sorted(got)} {got['rng_tracker_states']!r} {loaded.get('empty')!r} "
            f"{missing} {unexpected}")


def _one_process(rank: int, world: int, root: str) -> dict[str, str]:
    base, out = Path(root), {}
    tests = str(Path(__file__).resolve().parent)
    (base / "async").mkdir()
    code = (f"import sys; sys.path.insert(0, {tests!r}); import test_rt_megatron; "
            f"test_rt_megatron._kill_async({str(base / 'async')!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    out["killed"] = str(done.returncode)
    out["after kill"] = _outcome(lambda: mdc.load(_small(0), str(base / "async"),
                                                  sharded_strategy=LOAD()))
    out["rng"] = _rng_round(base / "rng")
    ck, td = base / "ck", base / "td"
    ck.mkdir()
    td.mkdir()
    mdc.save(_small(2), str(ck), sharded_strategy=SAVE())
    mdc.save(_small(3), str(ck), sharded_strategy=SAVE())  # a second save into one directory
    out["second"] = _outcome(lambda: mdc.load(_small(0), str(ck), sharded_strategy=LOAD())["b"])
    out["default load"] = _outcome(lambda: mdc.load(_small(0), str(ck))["a"])
    out["plain"] = _outcome(lambda: sorted(mdc.load_plain_tensors(str(ck)).items()))
    for strict in (StrictHandling.ASSUME_OK_UNEXPECTED, StrictHandling.RETURN_ALL):
        state = _small(0, extra=True)
        del state["b"]
        out[strict.name] = _outcome(lambda: mdc.load(state, str(ck), sharded_strategy=LOAD(),
                                                     strict=strict))
    _no_cuda()
    mdc.save(_small(4), str(td))  # torch_dist
    out["td by ckptio"] = _outcome(lambda: mdc.load(_small(0), str(td), sharded_strategy=LOAD()))
    out["td metadata"] = _outcome(lambda: mdc.load_tensors_metadata(str(td), LOAD()))
    mdc.save(_small(5), str(td), sharded_strategy=SAVE())  # ckptio's over torch_dist's
    bf16 = _small(0)
    bf16["a"] = ShardedTensor.from_rank_offsets("A", torch.zeros(4, dtype=torch.bfloat16))
    out["bf16"] = _outcome(lambda: mdc.load(bf16, str(ck), sharded_strategy=LOAD()))
    out["bf16 cast"] = _outcome(lambda: mdc.load(bf16, str(ck), sharded_strategy=LOAD(cast=True))["a"])
    out["over td"] = _outcome(lambda: mdc.load(_small(0), str(td), sharded_strategy=LOAD())["a"])
    mdc.save(_small(6), str(td))  # torch_dist's over ckptio's: ckptio's files stay, older
    out["td over"] = _outcome(lambda: mdc.load(_small(0), str(td), sharded_strategy=LOAD()))
    threads = fds = 0
    for i in range(14):  # after a first sync and async save: their threads are made
        if i == 2:
            threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
        request = mdc.save(_small(i), str(ck), sharded_strategy=SAVE(),
                           async_sharded_save=i % 2 == 1)
        if request is not None:
            request.execute_sync()
    out["growth"] = f"{threading.active_count() - threads} {len(os.listdir('/proc/self/fd')) - fds}"
    return out


def test_one_process_kill_pickle_backends_strict_and_leaks(tmp_path: Path) -> None:
    """An async save killed before its finalize: the load refuses the mixed directory; an RNG
    state refused without allow_pickle naming the key; a second save wins; the ckptio
    checkpoint loads without naming the strategy (Megatron's registry), and as plain tensors;
    strict modes; a bf16 state from fp32 refused naming cast=True, converted with it; a
    torch_dist directory refused naming its backend, also where an older ckptio save's files
    are left in it (it raised "no checkpoint
    at .../ckptio" before); no thread or fd growth over many saves."""
    (out,) = run_ranks(1, _one_process, str(tmp_path), timeout_s=240)
    assert out["killed"] == str(-signal.SIGKILL)
    assert out["after kill"].startswith("CorruptCheckpointError False: "), out["after kill"]
    assert "common.pt" in out["after kill"] and "different saves" in out["after kill"]
    assert out["rng"] == ("['np_rng_state', 'random_rng_state', 'rng_tracker_states', "
                          "'torch_rng_state'] {} {} set() set()"), out["rng"]
    assert out["second"] == "ok tensor([3., 3., 3.])"
    assert out["default load"] == "ok tensor([3., 4., 5., 6.])"
    assert "('A', tensor([3., 4., 5., 6.])), ('B', tensor([3., 3., 3.]))" in out["plain"]
    assumed = out["ASSUME_OK_UNEXPECTED"]
    assert assumed.startswith("MissingInCheckpointError True: ") and "tensors.X" in assumed
    assert out["RETURN_ALL"].endswith(", {'B'}, {'X'})")
    for key in ("td by ckptio", "td metadata", "td over"):
        assert out[key].startswith("NotCkptioCheckpointError True: "), out[key]
        assert "'torch_dist'" in out[key] and "without sharded_strategy=" in out[key]
    assert "metadata.json names backend 'torch_dist'" in out["td over"]
    assert "dtype torch.bfloat16 in the state, torch.float32 in the checkpoint" in out["bf16"]
    assert "CkptioLoadShardedStrategy(cast=True)" in out["bf16"]
    assert out["bf16 cast"] == "ok tensor([3., 4., 5., 6.], dtype=torch.bfloat16)"
    assert out["over td"] == "ok tensor([5., 6., 7., 8.])"
    assert out["growth"] == "0 0", out["growth"]


def test_a_load_of_some_keys_keeps_their_empty_containers(tmp_path: Path) -> None:
    """``keys=`` selecting a value that holds empty containers returns them (they were pruned
    with the containers the selection left empty); unselected empty ones stay out."""
    state = {"objects": {"rng/shard_0_1": [{"a": 1, "trackers": {}, "l": [], "t": ()}],
                         "other": {}}, "tensors": {}}
    ckptio.save(state, tmp_path / "c")
    got = ckptio.load(tmp_path / "c", keys=["objects.rng/shard_0_1"])
    assert got == {"objects": {"rng/shard_0_1": [{"a": 1, "trackers": {}, "l": [], "t": ()}]}}
    assert ckptio.load(tmp_path / "c", keys="objects") == {"objects": state["objects"]}
