"""The GPU benchmark's training job and the engines it checkpoints with.

Owns: a mixed-precision GPT trainer on one device (bf16 weights for forward and backward, fp32
master weights and fused AdamW moments, gradient accumulation; the forward pass is the training
benchmark's), the state it checkpoints (live references), and the savers that train_engines.py
lacks: DCP's ``async_save`` at its best on a GPU (pinned shared-memory staging, asynchronous
DefaultStager, process executor), ckptio's manager with a memory tier, and DataStates-LLM (the
seeds' lazy engine, built from its repository), plus what each one holds page-locked. Does not
own: the loop, timing and reports (gpu.py), the ckptio saver and the gloo group DCP needs
(train_engines.py).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import train_engines
from benchmarks.train import forward
from benchmarks.train_engines import Context, Pending

PARAM_BYTES = 14  # bf16 weight + fp32 master + two fp32 AdamW moments
DATASTATES_ENV = "DATASTATES_LLM_DIR"  # the built repository (its datastates/ package)


@dataclass
class Trainer:
    """bf16 model, fp32 master copies with fused AdamW, grads accumulated over ``accum``."""

    model: torch.nn.Module
    master: dict[str, torch.Tensor]
    opt: torch.optim.Optimizer
    vocab: int
    batch: int
    seq: int
    accum: int
    device: torch.device
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator(device=self.device).manual_seed(0)
        named = list(self.model.named_parameters())  # the tied head appears once
        self._params = [p for _, p in named]
        self._masters = [self.master[n] for n, _ in named]

    def forward_backward(self) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for _ in range(self.accum):
            tokens = torch.randint(self.vocab, (self.batch, self.seq + 1), device=self.device,
                                   generator=self.generator)
            logits = forward(self.model, tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            (loss / self.accum).backward()
            total += loss.detach()
        return total / self.accum

    def optimizer_step(self) -> None:
        """fp32 grads from the bf16 ones, the AdamW step on the masters, bf16 weights back."""
        with torch.no_grad():
            for m, p in zip(self._masters, self._params):
                m.grad.copy_(p.grad)
            self.opt.step()
            torch._foreach_copy_(self._params, self._masters)
            for p in self._params:
                p.grad = None

    def state(self, step: int) -> dict[str, Any]:
        """What a mixed-precision job saves: live references, no copies."""
        # plain dicts, as torch.distributed.checkpoint.state_dict.get_model_state_dict gives: a
        # module's OrderedDict (with _metadata) fails DCP's DefaultStager in torch 2.11
        return {"model": dict(self.model.state_dict()), "master": self.master,
                "optim": self.opt.state_dict(), "step": step}


def build_trainer(gb: float, device: str, seed: int, batch: int, seq: int, accum: int) -> Trainer:
    """A GPT of about ``gb`` GB of state at 14 bytes per parameter, built on the device."""
    from ckptio.tuning import state as shapes

    torch.manual_seed(seed)
    dev = torch.device(device)
    cfg = shapes.gpt_config(gb * 12 / PARAM_BYTES)  # gpt_config counts 12 bytes per parameter
    model = shapes.GPT(cfg, dev)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0 if "ln" in name else 0.0)
    model = model.to(torch.bfloat16)
    master = {}
    for name, p in model.named_parameters():
        m = p.detach().float().clone()
        m.grad = torch.zeros_like(m)
        master[name] = m
    opt = torch.optim.AdamW(list(master.values()), lr=1e-4, weight_decay=0.1,
                            fused=dev.type == "cuda", foreach=None if dev.type == "cuda" else True)
    return Trainer(model, master, opt, cfg.vocab, batch, min(seq, cfg.context - 1), accum, dev)


def sync() -> None:
    """Wait for the device's queued work (nothing to wait for without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def written_tensors(state: Any) -> list[torch.Tensor]:
    """The tensors DataStatesSaver writes, in its file's order: each storage once, none empty."""
    from ckptio.tuning.state import tensor_leaves

    out, seen = [], set()
    for _, t in tensor_leaves(state):
        if t.data_ptr() not in seen and t.numel():
            seen.add(t.data_ptr())
            out.append(t)
    return out


# ---------------------------------------------------------------- DCP at its best on a GPU


def dcp_best(ctx: Context) -> train_engines.Saver:
    """dcp.async_save with the process executor and DefaultStager(StagingOptions()) whose
    defaults are DCP's best on a GPU: pinned, shared memory, staged asynchronously with
    non-blocking copies (on CPU the pinning is left off: torch ignores it there)."""
    from torch.distributed.checkpoint.staging import StagingOptions

    on_gpu = torch.cuda.is_available()
    saver = train_engines.DcpAsyncSaver(ctx, process=True, staging=StagingOptions(
        use_pinned_memory=on_gpu, use_shared_memory=on_gpu, use_async_staging=True,
        use_non_blocking_copy=on_gpu))
    keep_stager_open(saver.stager)
    return saver


def keep_stager_open(stager: Any) -> Any:
    """torch < 2.13: DefaultStager._stage closes its StateDictStager after every stage, which
    empties its deepcopy dispatch (the next stage fails: ``KeyError: <class 'type'>``) and its
    pinned cache. torch 2.13 no longer closes it there; on older torch the same is done here
    (the process ends with the run, so nothing is leaked that matters)."""
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if (major, minor) < (2, 13):
        inner = stager._state_dict_stager
        inner.close = lambda: None
    return stager


def dcp_pinned_bytes(saver: Any) -> int:
    """Bytes DCP's stager keeps page-locked: its cached staging storages (measured)."""
    stager = getattr(getattr(saver, "stager", None), "_state_dict_stager", None)
    if stager is None or not getattr(stager, "pin_memory", False):
        return 0
    return sum(s.nbytes() for s in stager._cached_storage_mapping.values())


# ---------------------------------------------------------------- ckptio's memory tier


class TierSaver:
    """ckptio as a job checkpointing every step configures it: ``CheckpointManager(tiers=[
    Tier("shm://gpu-run", keep_last=2), Tier(<disk>, every=10, keep_last=2)])``,
    ``prepare``d with the state at startup (``wait``: until its staging and slots are
    ready), each save lazy with ``optimizers=[opt], after_step=[model]`` (the bf16 weights
    change only after the step). A save is committed in memory once its handle's wait()
    returns, which the timeline calls before the next save; the drain copies
    every 10th step to disk in the background."""

    def __init__(self, ctx: Context, model: torch.nn.Module, shm_dir: Path, disk: Path,
                 state: Any, wait: bool = False) -> None:
        import ckptio

        shm_dir.mkdir(parents=True, exist_ok=True)
        os.environ["CKPTIO_SHM_DIR"] = str(shm_dir)
        self.shm_dir, self.disk, self.optimizer, self.model = shm_dir, disk, ctx.optimizer, model
        self.checkpointer = ckptio.Checkpointer(ckptio.Options.from_env(use_profile=False))
        self.mgr = ckptio.CheckpointManager(
            tiers=[ckptio.Tier("shm://gpu-run", keep_last=2),
                   ckptio.Tier(str(disk), every=10, keep_last=2)],
            checkpointer=self.checkpointer)
        self.mgr.prepare(state, wait=wait)

    def start(self, state: Any, path: Path) -> Pending:
        step = int(path.name.rsplit("-", 1)[1])  # the timeline's step-N
        handle = self.mgr.save(step, state, lazy=True, optimizers=[self.optimizer],
                               after_step=[self.model], force=True)

        def report() -> dict[str, Any]:
            result = handle.wait()  # on the training thread, as ckptio requires
            return {f: getattr(result, f) for f in train_engines.CKPTIO_FIELDS
                    if hasattr(result, f)}

        return Pending(durable=None, report=report)

    def path_of(self, step: int) -> Path:
        return Path(self.mgr.path(step))

    def memory_bytes(self) -> int:
        """Bytes the memory tier holds now (its kept steps and ring slots, on tmpfs)."""
        return sum(p.stat().st_size for p in self.shm_dir.rglob("*") if p.is_file())

    def close(self) -> None:
        self.mgr.close()
        self.checkpointer.close()
        shutil.rmtree(self.shm_dir, ignore_errors=True)  # this run's own directories
        shutil.rmtree(self.disk, ignore_errors=True)


# ---------------------------------------------------------------- DataStates-LLM


def datastates_unavailable() -> str | None:
    root = os.environ.get(DATASTATES_ENV)
    if not torch.cuda.is_available():
        return "DataStates-LLM copies from CUDA tensors only (no GPU here)"
    if not root or not any(Path(root, "datastates", "ckpt").glob("src*.so")):
        return f"DataStates-LLM is not built (set {DATASTATES_ENV} to its built repository)"
    return None


class DataStatesSaver:
    """DataStates-LLM's CkptEngine: async_save queues each tensor's D2H copy (its own stream,
    into its pinned host cache) and file write (one thread, ofstream at an offset); wait()
    returns once the D2H copies are done and is called before each optimizer step, as the
    seeds' integration does. It never fsyncs: durable() waits until its writer has written
    the file's last byte, then fsyncs the file (DataStates' own API has no such wait)."""

    def __init__(self, ctx: Context, cache_bytes: int) -> None:
        sys.path.insert(0, os.environ[DATASTATES_ENV])
        from datastates.ckpt import CkptEngine

        self.cache_bytes = cache_bytes
        self.engine = CkptEngine(host_cache_size=cache_bytes, gpu_device_id=0, rank=0)
        self.version = 0
        self.hook = ctx.optimizer.register_step_pre_hook(lambda *_a: self.engine.wait())

    def start(self, state: Any, path: Path) -> Pending:
        self.version += 1
        path.mkdir(parents=True)
        target = str(path / "rank0.bin")
        jobs, offset = [], 0
        for t in written_tensors(state):
            jobs.append((self.version, t, offset, target))
            offset += t.numel() * t.element_size()
        self.engine.async_save(jobs)
        return Pending(durable=lambda: self._durable(target, offset))

    def _durable(self, target: str, nbytes: int) -> None:
        self.engine.wait()
        while not os.path.exists(target) or os.path.getsize(target) < nbytes:
            time.sleep(0.001)  # its writer is FIFO: the last tensor queued is written last
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.hook.remove()
        self.engine.wait()


def ckptio_pinned_bytes(saver: Any) -> int:
    """The staging pool's page-locked bytes (a memory tier's own mapped pages not counted)."""
    pool = saver.checkpointer.staging_nbytes
    return pool if torch.cuda.is_available() else 0
