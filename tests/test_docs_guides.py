"""The guides' code blocks run as a reader runs them: each page's Python blocks in order, in one
namespace, in a fresh directory, after a prelude that binds what the page leaves to the reader
(``model``, ``opt``, ``state``, a training step) to small real objects and makes what the page
assumes already exists (a DCP checkpoint, a bucket on a local SeaweedFS). Nothing in a block
is rewritten. A block that cannot run here (CUDA, ranks on several hosts, a package the test
extra lacks, a probe that measures) says so in its page, ``<!-- not run: why -->`` on the line
before it, and is only compiled (tests/test_docs_blocks.py counts those).

Each test then checks what the page promises (a checkpoint committed, a step restored, bytes
equal), so a guide whose code stops working fails here.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from docs_blocks import NOT_RUN, marked_blocks

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


class Loader:
    """A data loader's position, as a stateful loader keeps it."""

    def __init__(self) -> None:
        self.index = 0

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.index = sd["index"]


def _user() -> dict[str, Any]:
    """A reader's own objects: a small model, AdamW, a scheduler, a state and a step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    loader = Loader()

    def train_step(*_: Any) -> float:
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        loader.index += 1
        return loss.item()

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, Loader]:
        return model, opt, sched, loader

    train_step()  # AdamW's state exists, as in any run past its first step
    loss = model(torch.randn(4, 8)).pow(2).mean()
    return {"torch": torch, "ckptio": ckptio, "model": model, "opt": opt, "optimizer": opt,
            "sched": sched, "scheduler": sched, "loader": loader, "train_step": train_step,
            "build": build, "loss": loss, "step": 1, "total_steps": 1000, "total": 20,
            "cfg": {"lr": 1e-2}, "path": "ckpts/step-1",
            "state": {"model": model, "optim": opt, "sched": sched, "step": 1}}


def _run_page(page: str, namespace: dict[str, Any]) -> dict[str, Any]:
    for code, why in marked_blocks(DOCS / page):
        if why is None:
            exec(compile(code, page, "exec"), namespace)  # noqa: S102 - the page's own block
    return namespace


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh working directory; shm:// under it, so nothing is left in /dev/shm."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CKPTIO_SHM_DIR", str(tmp_path / "shm"))
    return tmp_path


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    """A local SeaweedFS with the buckets the guides name (``bucket``, ``ckpt``)."""
    if importlib.util.find_spec("boto3") is None:
        pytest.skip("needs boto3 (the s3 extra)")
    from ckptio.testing.s3server import SeaweedServer, ServerError, make_client, weed_binary
    try:
        weed_binary()
    except ServerError as exc:
        pytest.skip(f"needs the weed binary: {exc}")
    with SeaweedServer(bucket="bucket") as server:  # started on entering
        make_client(server).create_bucket(Bucket="ckpt")
        yield server.env()


@pytest.fixture
def on_s3(s3: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in s3.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def on_gcs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The page's emulator (bucket ``ckpt``), reached through STORAGE_EMULATOR_HOST as it says."""
    if importlib.util.find_spec("gcp_storage_emulator") is None or importlib.util.find_spec(
            "google.cloud.storage") is None:
        pytest.skip("needs google-cloud-storage and gcp-storage-emulator (the test extra)")
    from gcs.conftest import Emulator
    server = Emulator(tmp_path / "emulator.log")
    server.start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.endpoint)
    yield
    server.close()


def _empty_s3(bucket: str, prefix: str) -> None:
    import boto3
    client = boto3.client("s3")
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            client.delete_object(Bucket=bucket, Key=item["Key"])


@pytest.fixture(scope="module")
def azurite() -> Iterator[str]:
    """A local Azurite blob service with the container the Azure guide names (``ckpt``)."""
    from ckptio.testing.azurite import AzuriteServer, missing
    why = missing()
    if why is not None:
        pytest.skip(f"needs Azurite: {why}")
    with AzuriteServer(container="ckpt") as server:
        yield server.connection


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-rank gloo job, as torchrun would start: DCP's process-based async_save needs one."""
    import torch.distributed as dist

    from ckptio.testing.s3server import free_ports
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_ports(n=1)[0]}",
                            rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _steps(directory: str) -> list[str]:
    return sorted(p.name for p in Path(directory).iterdir() if p.name.startswith("step-"))


def test_save_load(here: Path) -> None:
    ns = _run_page("guides/save-load.md", _user())
    assert ns["fresh"]["step"] == 100 and ns["fresh"]["loader"] == {"epoch": 3, "index": 1200}
    assert torch.equal(ns["fresh"]["model"]["0.weight"], ns["model"][0].weight)


def test_resume(here: Path) -> None:
    ns = _run_page("guides/resume.md", _user())
    assert ns["start"] == 0 and _steps("ckpts") == ["step-1", "step-1000", "step-500"]
    assert ns["mgr"].metadata(1000)["metadata"]["config"] == {"lr": 1e-2}
    assert _steps("ckpts-own") == ["step-200", "step-400", "step-500"]  # the user's policies
    again = _user()  # a second run of the page's first block restores step 1000
    exec(compile(marked_blocks(DOCS / "guides/resume.md")[0][0], "resume.md", "exec"), again)
    assert again["start"] == 1000 and again["loader"].index == ns["loader"].index


def test_manager_page(here: Path) -> None:
    ns = _run_page("MANAGER.md", _user())
    assert ns["start"] == 0 and _steps("ckpts") == ["step-1000", "step-500"]


def test_async(here: Path) -> None:
    ns = _run_page("guides/async.md", _user())
    assert ns["h"].wait() is not None
    ckptio.verify("ckpts/step-200")
    ckptio.verify("ckpts/step-300")


def test_compression(here: Path) -> None:
    pytest.importorskip("zstandard", reason="needs zstandard (the compress extra)")
    ns = _run_page("guides/compression.md", _user())
    assert ns["start"] == 0 and ckptio.CheckpointManager("run").steps() == [100, 101]
    assert torch.equal(ckptio.load("run/step-101")["model"]["0.weight"], ns["model"][0].weight)


def test_torch_save(here: Path) -> None:
    ns = _run_page("guides/torch-save.md", _user())
    assert ns["model"][0].weight.shape == (16, 8)


def test_convert(here: Path) -> None:
    ckptio.save({"w": torch.ones(3), "step": 4, "config": {"lr": 0.1}}, "ckpts/step-1000")
    _run_page("guides/convert.md", _user())
    assert (here / "hf" / "model.safetensors").exists()


def test_dcp(here: Path, on_s3: None, one_rank: None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    ns = _user()
    msd, osd = get_state_dict(ns["model"], ns["opt"])  # the state a DCP user saves and loads
    ns["state"] = {"model": msd, "optim": osd}
    dcp.save(ns["state"], checkpoint_id="dcp_ckpt")
    saved = {k: v.clone() for k, v in ns["model"].state_dict().items()}
    _run_page("guides/dcp.md", ns)
    assert all(torch.equal(v, ns["model"].state_dict()[k]) for k, v in saved.items())
    ckptio.verify("s3://bucket/step-100")


def test_distributed_on_one_rank(here: Path) -> None:
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)
    ns = _user()
    ns.update(get_model_state_dict=get_model_state_dict,
              get_optimizer_state_dict=get_optimizer_state_dict, stage=ns["model"])
    _run_page("guides/distributed.md", ns)
    assert _steps("ckpts") == ["step-1", "step-100"]


def test_s3(here: Path, on_s3: None) -> None:
    ns = _run_page("guides/s3.md", _user())
    assert ns["start"] is None and ckptio.CheckpointManager("s3://ckpt/run-1").steps() == [1, 2]
    again: dict[str, Any] = {}  # the try-it block run again: it restores step 2 in place
    exec(compile(marked_blocks(DOCS / "guides/s3.md")[1][0], "s3.md", "exec"), again)
    assert again["start"] == 2 and torch.equal(again["state"]["w"], ns["state"]["w"])


def test_gcs(here: Path, on_gcs: None) -> None:
    ns = _run_page("guides/gcs.md", _user())
    assert ns["start"] is None
    assert ckptio.CheckpointManager("gs://ckpt/run-1", options=ns["options"]).steps() == [1, 2]
    again: dict[str, Any] = {}  # the try-it block run again: it restores step 2 in place
    exec(compile(marked_blocks(DOCS / "guides/gcs.md")[1][0], "gcs.md", "exec"), again)
    assert again["start"] == 2 and torch.equal(again["state"]["w"], ns["state"]["w"])


def test_azure(here: Path, azurite: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    ns = _run_page("guides/azure.md", _user())
    assert torch.equal(ns["restored"]["w"], ns["state"]["w"])
    assert ckptio.CheckpointManager("az://ckpt/run-1/steps").steps() == [1, 2]


def test_tiers(here: Path, on_s3: None) -> None:
    ns = _user()
    ns["total_steps"] = 100
    _empty_s3("bucket", "run-7/")  # guides/s3.md saves a step there; this page starts afresh
    _run_page("guides/tiers.md", ns)
    assert ns["start"] == 0
    assert ckptio.CheckpointManager("s3://bucket/run-7").steps() == [100]
    assert _steps("local/ckpt") == ["step-100", "step-90"]


def _tc_names() -> dict[str, Any]:
    pytest.importorskip("torch_checkpointing", reason="needs torch-checkpointing")
    from torch_checkpointing import CheckpointManager

    from ckptio.tc_storage import CkptioStorageConfig
    _empty_s3("bucket", "run/")  # both pages save step-100 there, and it refuses to overwrite
    return {"CheckpointManager": CheckpointManager, "CkptioStorageConfig": CkptioStorageConfig}


def test_torch_checkpointing(here: Path, on_s3: None) -> None:
    ns = {**_user(), **_tc_names()}
    _run_page("guides/torch-checkpointing.md", ns)
    back = ckptio.load("s3://bucket/run/step-100")["model"]
    assert all(torch.equal(back[k], v) for k, v in ns["model"].state_dict().items())


def test_torch_checkpointing_side_by_side(here: Path, on_s3: None) -> None:
    from ckptio.testing.tc_peer import manager
    ns = {**_user(), **_tc_names()}
    tc = manager()  # buffered writes: its default O_DIRECT refuses unaligned tails here
    tc.save("ckpts/step-1000", {"model": ns["model"].state_dict(), "optim": ns["opt"].state_dict(),
                                "sched": ns["sched"].state_dict(), "step": 7})
    _run_page("BENCH_TORCH_CHECKPOINTING.md", ns)
    assert ns["state"]["step"] == 7


def test_cli_dcp_output_reads_with_dcp_alone(here: Path) -> None:
    from ckptio.cli import main
    ns = _user()
    ckptio.save({"model": ns["model"].state_dict()}, "out/step-100")
    assert main(["convert", "out/step-100", "out/step-100.dcp", "--to", "dcp"]) == 0
    ns["state"] = {"model": {k: torch.zeros_like(v) for k, v in ns["model"].state_dict().items()}}
    _run_page("CLI.md", ns)
    assert torch.equal(ns["state"]["model"]["0.weight"], ns["model"][0].weight)


def _gpt2() -> Any:
    transformers = pytest.importorskip("transformers", reason="needs transformers (hf extra)")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    return transformers, transformers.GPT2LMHeadModel(config)


def test_safetensors(here: Path) -> None:
    transformers, model = _gpt2()
    ns = _user()
    ns.update(model=model, opt=torch.optim.AdamW(model.parameters()),
              AutoModelForCausalLM=transformers.AutoModelForCausalLM)
    _run_page("guides/safetensors.md", ns)
    assert (here / "hf" / "config.json").exists()


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(i, i + 8) % 64
        return {"input_ids": ids, "labels": ids}


def test_hf_trainer(here: Path) -> None:
    transformers, model = _gpt2()
    from ckptio.hf_trainer import CkptioTrainer
    first = transformers.TrainingArguments(output_dir="out", max_steps=2, save_steps=2,
                                           report_to=[])
    CkptioTrainer(model=model, args=first, train_dataset=Tokens()).train()  # out/checkpoint-2
    ns = _run_page("guides/hf-trainer.md", {"model": model, "ds": Tokens()})
    assert ns["trainer"].state.global_step == 6  # resumed at step 2, three epochs of two steps


def test_lightning(here: Path) -> None:
    L = pytest.importorskip("lightning", reason="needs lightning (the lightning extra)")
    from torch.utils.data import DataLoader, TensorDataset

    class Regressor(L.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch: Any, _: int) -> None:
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    x = torch.randn(16, 4)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    ns = _run_page("guides/lightning.md", {"model": Regressor(), "train_loader": data,
                                           "val_loader": data})
    assert ns["trainer"].current_epoch == 10 and (here / "ckpts" / "last.ckpt").exists()
    assert ckptio.load(here / "ckpts" / "last.ckpt", allow_pickle=True)["epoch"] == 9


TESTED: dict[str, Callable[..., None]] = {
    "guides/save-load.md": test_save_load, "guides/resume.md": test_resume,
    "MANAGER.md": test_manager_page, "guides/async.md": test_async,
    "guides/compression.md": test_compression, "guides/torch-save.md": test_torch_save,
    "guides/convert.md": test_convert, "guides/dcp.md": test_dcp,
    "guides/distributed.md": test_distributed_on_one_rank, "guides/s3.md": test_s3,
    "guides/gcs.md": test_gcs,
    "guides/azure.md": test_azure,
    "guides/tiers.md": test_tiers, "guides/torch-checkpointing.md": test_torch_checkpointing,
    "BENCH_TORCH_CHECKPOINTING.md": test_torch_checkpointing_side_by_side,
    "CLI.md": test_cli_dcp_output_reads_with_dcp_alone,
    "guides/safetensors.md": test_safetensors, "guides/hf-trainer.md": test_hf_trainer,
    "guides/lightning.md": test_lightning,
}


def test_every_page_with_a_block_to_run_has_its_test() -> None:
    """A page that gains a block not marked ``not run`` needs a prelude here."""
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    runnable = {p for p in pages if any(why is None for _, why in marked_blocks(DOCS / p))}
    # run by tests/test_docs_blocks.py: getting-started's blocks, and index.md's quick start
    # (the README's, checked there to be the same block)
    elsewhere = {"getting-started.md", "index.md"}
    assert runnable - elsewhere == set(TESTED), (sorted(runnable ^ set(TESTED)), NOT_RUN)
