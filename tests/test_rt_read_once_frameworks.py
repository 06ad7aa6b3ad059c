"""Read once on a restart through the framework integrations (issue 67, many ranks on shared
storage): a Megatron-Core ``dist_checkpointing.load`` with the ckptio strategy reads the
committed manifest once per rank (it read it in its common-state check, for the padded
vocabulary's shapes, and again for the objects' load), its replicated tensors once in all on
two ranks, and a later load in the same process of a newer save there sees the newer save.
Each rank counts its store's manifest reads and the bytes it submits to the store's files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core.dist_checkpointing",
                    reason="megatron-core is not installed (the test extra has it)")
from megatron.core import dist_checkpointing as mdc  # noqa: E402
from megatron.core.dist_checkpointing.validation import StrictHandling  # noqa: E402

from ckptio.megatron_strategy import (  # noqa: E402
    CkptioLoadShardedStrategy,
    CkptioSaveShardedStrategy,
)
from ckptio.testing.rank_processes import run_ranks  # noqa: E402

SAVE, LOAD = CkptioSaveShardedStrategy, CkptioLoadShardedStrategy


def _gpt(tp: int, seed: int) -> torch.nn.Module:
    """A small Megatron GPTModel on the CPU at TP ``tp`` (its vocabulary padded: the embedding
    and output layer allow a shape mismatch, so the load looks at the saved shapes)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, 1)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                               use_cpu_initialization=True, tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=128, max_sequence_length=32)


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _counting() -> tuple[dict[str, int], Any]:
    """This process's manifest reads (counted from now on) and a counter of its data reads."""
    from ckptio.storage.local.local_store import LocalStore
    from ckptio.testing.readcount import count_store_reads

    counted = {"manifest": 0}
    read_manifest = LocalStore.read_manifest

    def counted_manifest(self: LocalStore) -> bytes:
        counted["manifest"] += 1
        return read_manifest(self)

    LocalStore.read_manifest = counted_manifest  # type: ignore[method-assign]
    return counted, count_store_reads()


def _load_counted(rank: int, world: int, root: str, tp: int) -> dict[str, Any]:
    """Save a GPTModel at TP ``tp``, load it into another -> this rank's manifest reads and
    data bytes read in the load, the data's size, whether it loaded bitwise, and the manifest
    reads of a strict load's metadata step (load_sharded_metadata)."""
    where = Path(root) / "gpt"
    where.mkdir(exist_ok=True)
    saved = _gpt(tp, 0)
    mdc.save(saved.sharded_state_dict(), str(where), sharded_strategy=SAVE())
    counted, data_read = _counting()
    model = _gpt(tp, 1)
    before = data_read()
    model.load_state_dict(mdc.load(model.sharded_state_dict(), str(where),
                                   sharded_strategy=LOAD()))
    out = {"manifest": counted["manifest"], "read": data_read() - before,
           "equal": all(torch.equal(v, _tensors(saved)[k]) for k, v in _tensors(model).items())}
    counted["manifest"] = 0
    LOAD().load_sharded_metadata(where)
    out["metadata_manifest"] = counted["manifest"]
    out["data"] = sum(f.stat().st_size for f in (where / "ckptio").iterdir()
                      if f.name != "manifest.json")
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_megatron_load_reads_the_manifest_once_per_rank(tmp_path: Path, world: int) -> None:
    """TP ``world``: one manifest read per rank per load (four before on the rank that
    read it for the tensors' load, three on the others), one in the metadata step (two)."""
    got = run_ranks(world, _load_counted, str(tmp_path), world, timeout_s=240)
    assert all(g["equal"] for g in got), got
    assert [g["manifest"] for g in got] == [1] * world, got
    assert [g["metadata_manifest"] for g in got] == [1] * world, got


def test_a_replicated_megatron_load_reads_each_byte_once_across_ranks(tmp_path: Path) -> None:
    """TP 1 on two ranks: every tensor is a replica on both; ckptio's read-once broadcast
    reads each of its bytes once in all, not once per rank."""
    got = run_ranks(2, _load_counted, str(tmp_path), 1, timeout_s=240)
    assert all(g["equal"] for g in got), got
    data = got[0]["data"]
    assert 0.9 * data <= sum(g["read"] for g in got) <= 1.25 * data, got
    assert [g["manifest"] for g in got] == [1, 1], got


def _save_load_save_load(rank: int, world: int, root: str) -> list[Any]:
    """One strategy object of each kind for the whole run, as a trainer keeps them: save,
    load, save a newer state over the same directory, load again -> what each load found."""
    where = Path(root) / "gpt"
    where.mkdir(exist_ok=True)
    save, load = SAVE(), LOAD()
    found = []
    for seed in (0, 2):
        saved = _gpt(world, seed)
        mdc.save(saved.sharded_state_dict(), str(where), sharded_strategy=save)
        model = _gpt(world, 1)
        model.load_state_dict(mdc.load(model.sharded_state_dict(), str(where),
                                       sharded_strategy=load, strict=StrictHandling.RAISE_ALL))
        want = _tensors(saved)
        found.append(sorted(k for k, v in _tensors(model).items() if not torch.equal(v, want[k])))
    return found


def test_a_second_save_then_load_in_the_same_process_sees_the_newer_checkpoint(
        tmp_path: Path) -> None:
    """No manifest kept from one load to the next: the second load (its metadata step too)
    is of the second save, and its common state matches it (a stale manifest would refuse
    the newer common.pt, or load the older tensors)."""
    got = run_ranks(2, _save_load_save_load, str(tmp_path), timeout_s=240)
    assert got == [[[], []], [[], []]], got
