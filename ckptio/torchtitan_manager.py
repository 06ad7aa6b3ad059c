"""TorchTitan's checkpoints through ckptio, chosen by configuration (TorchTitan >= 0.3.0):

    from ckptio.torchtitan_manager import CkptioCheckpointManager
    config.checkpoint = CkptioCheckpointManager.Config(enable=True, interval=500,
                                                       keep_latest_k=3, async_mode="async")

Call order (TorchTitan's Trainer): build on every rank, ``load(step)`` (-1: the newest), per
step ``maybe_wait_for_staging()`` before the optimizer step and ``save(step, last_step)``,
``close()`` at the end. Each save is one ckptio checkpoint ``<folder>/step-<N>`` of TorchTitan's
flattened state (model keys at the top, ``optimizer``, ``lr_scheduler``, ``dataloader``,
``train_state``); the folder may be ``s3://bucket/prefix``. What each option does and the
limits: docs/guides/torchtitan.md.

Owns: TorchTitan's policies (interval, first and last step, model-only and Hugging Face final
saves, load_only, exclude_from_loading, initial loads) mapped onto one ckptio CheckpointManager,
and its ``async_mode`` mapped onto ckptio's eager and lazy async saves.
Does not own: the saves, loads, retention and the scan for the newest committed step
(ckptio.managing.manager), the Hugging Face files (ckptio.export), TorchTitan's Trainer.
"""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Literal

import torch
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import filesystem

from ckptio.errors import (
    CheckpointNotFoundError,
    CkptError,
    StateMismatchError,
    in_terms,
    refixed,
    restated,
)
from ckptio.export import export_hf
from ckptio.managing.manager import CheckpointManager
from ckptio.managing.restoring import fresh_start_refused_by
from ckptio.saving.handle import SaveHandle
from ckptio.format.manifest import Manifest
from ckptio.shared import checkpointer, load, save
from ckptio.storage.select import store_for
from ckptio.storage.steps import foreign

__all__ = ["CkptioCheckpointManager"]

KIND = "torchtitan"  # the metadata key saying what a step holds: "full" or "model"
# a run lease's refusal names CheckpointManager's argument; a TorchTitan job sets its option
# (TorchTitan's command line takes a bool as a flag: --checkpoint.x, --checkpoint.no_x)
_TAKE_OVER = "CheckpointManager(..., take_over=True)"
_TITAN_TAKE_OVER = "--checkpoint.take_over (CkptioCheckpointManager.Config(take_over=True))"
_TITAN_TERMS = ((_TAKE_OVER, _TITAN_TAKE_OVER),)  # errors.in_terms


class _SaveFuture(Future):
    """TorchTitan's ``save_future`` for a ckptio async save: ``result()`` waits for it."""

    def __init__(self, handle: SaveHandle) -> None:
        super().__init__()
        self.handle = handle

    def done(self) -> bool:
        return self.handle.done()

    def result(self, timeout: float | None = None) -> Any:
        return self.handle.wait(timeout)


class CkptioCheckpointManager(BaseCheckpointManager):
    """A TorchTitan checkpoint manager that saves and loads through ckptio's CheckpointManager
    (module docstring; docs/guides/torchtitan.md)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """disabled: a save returns once committed; async: once the state is copied into
        ckptio's staging pool (eager async save); async_with_pinned_mem: at once, the copy runs
        in the background until the next optimizer step (lazy async save)."""

        keep_every: int | None = None
        """Also keep every step divisible by this (ckptio's keep_every), beside keep_latest_k."""

        hf_folder: str = "hf"
        """last_save_in_hf: the Hugging Face export goes to ``<folder>/<hf_folder>/step-<N>``."""

        take_over: bool = False
        """Save into a folder another job holds (CheckpointLockedError names it): this job's
        earlier run whose processes linger; that job's next save is then refused."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            self.async_mode = self.async_mode.lower()  # type: ignore[assignment]
            if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise ValueError(f"Invalid async_mode: {self.async_mode}")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module],
                 optimizers: Any, lr_schedulers: Any, states: dict[str, Any],
                 sd_adapter: Any, base_folder: str = "") -> None:
        self.enable = config.enable
        self.save_future: Future | None = None
        if not self.enable:
            return
        self.config = config
        self.folder = filesystem.join(base_folder, config.folder)
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers,
                            DATALOADER: dataloader, LR_SCHEDULER: lr_schedulers})
        self.sd_adapter = sd_adapter
        if config.last_save_in_hf and sd_adapter is None:
            raise CkptError("checkpoint.last_save_in_hf needs the model's state-dict adapter "
                            "(sd_adapter), and this job has none: set last_save_in_hf=False")
        if config.last_save_in_hf and config.last_save_model_only and filesystem.is_remote(
                self.folder):
            raise CkptError(  # refused before training, not at its last step
                f"checkpoint.last_save_in_hf with the folder {self.folder}: the Hugging Face "
                "export (ckptio.export_hf) writes a local directory, so the last step would not "
                "be saved; set last_save_in_hf=False (the last step is then a ckptio step, "
                "exported later with ckptio.export_hf to a local folder), or use a local folder")
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self._inner_optimizers = list(getattr(optimizers, "optimizers", None) or [optimizers])
        self._staging: SaveHandle | None = None
        self._below: tuple[int, str] | None = None  # no save at or below: (step, why)
        with in_terms(_TITAN_TERMS):  # one job per folder: a second one is refused here
            self.manager = CheckpointManager(
                self.folder, keep_last=config.keep_latest_k or None,
                keep_every=config.keep_every, save_every=config.interval,
                take_over=config.take_over)

    # ------------------------------------------------------------------ saving

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.config.load_only:
            return False
        if curr_step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.config.interval == 0

    def _flattened(self, states: dict[str, Any]) -> dict[str, Any]:
        """TorchTitan's layout: the model's keys at the top, the other states by name."""
        out = {k: v for k, v in states.items() if k != MODEL}
        if MODEL in states:
            out.update(states[MODEL].state_dict())
        return out

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        with in_terms(_TITAN_TERMS):  # a folder made by the first save: its lease taken there
            return self._save_step(curr_step, last_step)

    def _save_step(self, curr_step: int, last_step: bool) -> bool:
        if self._below is not None and curr_step <= self._below[0]:
            raise CkptError(f"step {curr_step} not saved: {self._below[1]}")
        self.maybe_wait_for_saving()
        if last_step and self.config.last_save_model_only:
            self._save_model_only(curr_step)
            return True
        mode = "disabled" if last_step else self.config.async_mode
        result = self.manager.save(
            curr_step, self._flattened(self.states), force=True,
            asynchronous=mode == "async", lazy=mode == "async_with_pinned_mem",
            optimizers=self._inner_optimizers if mode == "async_with_pinned_mem" else (),
            metadata={KIND: "full"})
        if isinstance(result, SaveHandle):
            self.save_future = _SaveFuture(result)
            self._staging = result if mode == "async_with_pinned_mem" else None
        return True

    def _model_state(self) -> dict[str, Any]:
        """The model's state in ``export_dtype`` (TorchTitan's final model-only save)."""
        return {k: v.to(self.export_dtype) if isinstance(v, torch.Tensor)
                and v.is_floating_point() and v.dtype != self.export_dtype else v
                for k, v in self.states[MODEL].state_dict().items()}

    def _save_model_only(self, step: int) -> None:
        """The last step, model only: a ckptio step (resume loads the model only), or with
        last_save_in_hf a Hugging Face safetensors folder made by ckptio.export_hf."""
        state = self._model_state()
        if not self.config.last_save_in_hf:
            self.manager.save(step, state, force=True, metadata={KIND: "model"})
            return
        hf_state = self.sd_adapter.to_hf(state)
        out = filesystem.join(filesystem.join(self.folder, self.config.hf_folder), f"step-{step}")
        scratch = filesystem.join(self.folder, f".hf-step-{step}-{uuid.uuid4().hex[:8]}")
        if torch.distributed.is_initialized():  # one name on every rank
            names = [scratch]
            torch.distributed.broadcast_object_list(names, src=0)
            scratch = names[0]
        save(hf_state, scratch)
        try:
            export_hf(scratch, out, keys=None, overwrite=True)
        finally:
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                filesystem.rmtree(scratch)

    def _maybe_wait_for_staging(self) -> None:
        """async_with_pinned_mem: until the lazy save has copied the state (the optimizers'
        step pre-hooks wait for it too)."""
        handle, self._staging = self._staging, None
        while handle is not None and not (handle.staged() or handle.done()):
            time.sleep(0.001)

    def _wait_for_saving(self) -> None:
        self.save_future = None
        self._staging = None
        with in_terms(_TITAN_TERMS):
            self.manager.wait()

    def _close(self) -> None:
        self.save_future = None
        self.manager.close()

    # ------------------------------------------------------------------ loading

    def _states_to_load(self, model_only: bool) -> dict[str, Any]:
        if model_only:
            return dict(self.states[MODEL].state_dict())
        for key in self.config.exclude_from_loading:
            if key not in self.states:
                raise CkptError(f"checkpoint.exclude_from_loading: {key!r} is not a state of "
                                f"this job (it has {sorted(self.states)})")
        return self._flattened({k: v for k, v in self.states.items()
                                if k not in self.config.exclude_from_loading})

    def _not_excluded(self) -> Callable[[str], bool] | None:
        """The checkpoint's keys to load: all but those of the states in exclude_from_loading
        (the checkpoint still holds them; TorchTitan's own manager leaves them unread too)."""
        excluded = set(self.config.exclude_from_loading)  # never the model (TorchTitan's rule)
        return (lambda key: key.split(".", 1)[0] not in excluded) if excluded else None

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """The newest committed step (or ``step``) of the folder; else the initial load; else
        a fresh start, said as CheckpointManager.restore says it (a typo's "did you mean")."""
        steps = self.manager.steps()
        if step != -1 and step not in steps:
            raise CheckpointNotFoundError(
                f"--checkpoint.load_step={step}: {self.folder} has no committed step {step} "
                f"(committed: {steps or 'none'})")
        if steps:
            newest = steps[-1] if step == -1 else step
            if newest < steps[-1]:  # its saves would fall below the later steps
                path = self.manager.path(newest)
                self._below = (steps[-1], (
                    f"this job loaded {path} (--checkpoint.load_step {step}), and "
                    f"{self.folder} holds later steps {[n for n in steps if n > step]}: a "
                    f"restart would resume from step {steps[-1]}, and retention drop this "
                    "job's steps. Give the job a new --checkpoint.folder with "
                    f"--checkpoint.initial_load_path {path} "
                    "--checkpoint.no_initial_load_model_only, or remove the later steps"))
            record = self._manifest(newest)  # read once: the restore loads with it
            # async saves: their staging sized and faulted in behind the load (the first save
            # returns at copy speed); synchronous ones fault in what they stage themselves
            ahead = self.config.async_mode != "disabled" and not self.config.load_only
            try:
                states = self._restored(newest, None if step == -1 else step, record, ahead)
            except StateMismatchError as exc:
                raise refixed(exc, "Through TorchTitan: this job's model or optimizer differs "
                              "from the one that saved it; build it as saved, leave states out "
                              "with --checkpoint.exclude_from_loading, or start in a new "
                              "--checkpoint.folder") from exc
            self.states[MODEL].load_state_dict(states)
            return True
        if self.config.initial_load_path is None:
            self._refuse_foreign_steps()
        if self._initial_load():
            return True
        # a fresh start: the manager's restore logs it, and names a folder spelled alike that
        # holds committed steps (a mistyped --checkpoint.folder), or incomplete steps here
        try:
            with fresh_start_refused_by(None):  # no TorchTitan option requires a checkpoint
                self.manager.restore({}, prepare=False)
        except CheckpointNotFoundError as exc:  # it holds something else (torch.save files)
            raise restated(exc, "CkptioCheckpointManager found no step to resume and would "
                                "train from step 0 beside what its --checkpoint.folder holds "
                                "(give the job a new folder): ") from None
        return False

    def _refuse_foreign_steps(self) -> None:
        """No ckptio step, but steps of another manager (TorchTitan's own, DCP): a fresh start
        would train from step 0 silently, and its first save fail beside them."""
        found = [(n, what) for n in self.manager.incomplete()
                 if (what := foreign(store_for(self.manager.path(n)))) is not None]
        if found:
            step, what = found[-1]
            raise CkptError(
                f"{self.folder} holds no ckptio step but steps {[n for n, _ in found]} of "
                f"another manager ({self.manager.path(step)} holds {what}), which "
                "CkptioCheckpointManager does not resume from: it would train from step 0. "
                "Resume this run with TorchTitan's own CheckpointManager, or load its newest "
                f"step into a new --checkpoint.folder: --checkpoint.initial_load_path "
                f"{self.manager.path(step)} --checkpoint.no_initial_load_model_only")

    def _manifest(self, step: int) -> Manifest | None:
        """Step ``step``'s manifest, read by rank 0 and sent to the others; None where it
        cannot be read (damaged, gone): the restore then reads it, passing over a damaged step
        to the one before (saying so), or naming the damage if asked for it."""
        got: list[Manifest | None] = [None]
        many = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        if not many or torch.distributed.get_rank() == 0:
            try:
                got[0] = checkpointer().manifest(self.manager.path(step))
            except CkptError:  # damaged or gone: the restore's own read says so
                got[0] = None
        if many:
            torch.distributed.broadcast_object_list(got, src=0)
        return got[0]

    @staticmethod
    def _kind(record: Manifest | None) -> str:
        """What a step holds, by its manifest: "full", or "model" (a final model-only save)."""
        metadata = record.meta.get("metadata") if record is not None else None
        return str(metadata.get(KIND, "full")) if isinstance(metadata, dict) else "full"

    def _restored(self, newest: int, step: int | None, record: Manifest | None,
                  ahead: bool) -> dict[str, Any]:
        """The states restored from step ``newest`` (``step`` None: the newest loadable) with
        its manifest ``record`` (None: the restore reads it)."""
        given: dict[str, Any] = {} if record is None else {"record": record}
        if newest == 0 or self._kind(record) == "model":  # a seed or a final model-only step
            if newest:
                path = self.manager.path(newest)
                self._below = (newest, (
                    f"this job loaded {path}, the last step of a finished run saved model-only "
                    "(last_save_model_only), which holds no train state, so it trained again "
                    f"from step 0, and a step at or below {newest} in {self.folder} would be "
                    "dropped or passed over. To train on from those weights, give the job a new "
                    f"--checkpoint.folder with --checkpoint.initial_load_path {path}; to make a "
                    "run's last step resumable, pass --checkpoint.no_last_save_model_only"))
            states = self._states_to_load(model_only=True)
            self.manager.restore(states, step=newest, cast=True,  # export_dtype back
                                 prepare=ahead, **given)
        else:
            states = self._states_to_load(model_only=False)
            self.manager.restore(states, step=step, prepare=ahead, keys=self._not_excluded(),
                                 **given)
        return states

    def _initial_load(self) -> bool:
        """An empty folder: TorchTitan's initial_load_path (a ckptio, DCP or safetensors
        checkpoint), or the Hugging Face weights of model.hf_assets_path; else a fresh start."""
        config = self.config
        path = config.initial_load_path
        if config.initial_load_in_hf_quantized:
            raise CkptError("checkpoint.initial_load_in_hf_quantized: not supported by "
                            "CkptioCheckpointManager; use TorchTitan's CheckpointManager for it")
        if path is None and config.initial_load_in_hf:
            path = getattr(self.sd_adapter, "hf_assets_path", None)
        if path is None:
            return False
        states = self._states_to_load(model_only=config.initial_load_model_only)
        try:
            if config.initial_load_in_hf:
                hf_state = self.sd_adapter.to_hf(states)
                load(os.fspath(path), hf_state)
                states = self.sd_adapter.from_hf(hf_state)
            else:
                load(os.fspath(path), states)
        except StateMismatchError as exc:
            only = ("" if config.initial_load_model_only else ", load the model alone "
                    "(--checkpoint.initial_load_model_only) if only the optimizer or "
                    "schedule changed")
            raise refixed(exc, f"Through TorchTitan's --checkpoint.initial_load_path {path}: "
                          f"this job's states differ from that checkpoint's; build the model as "
                          f"saved{only}, or leave --checkpoint.initial_load_path out to start "
                          "from scratch") from exc
        self.states[MODEL].load_state_dict(states)
        return True
