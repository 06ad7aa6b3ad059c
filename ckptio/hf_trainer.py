"""Hugging Face ``transformers.Trainer`` checkpoints saved and resumed through ckptio.

    from ckptio.hf_trainer import CkptioTrainer
    trainer = CkptioTrainer(model=model, args=args, train_dataset=ds)   # as transformers.Trainer
    trainer.train(resume_from_checkpoint=True)   # or a path: "out/checkpoint-500"

    class MySFT(CkptioTrainerMixin, trl.SFTTrainer): ...   # another Trainer subclass, the same way

Call order (transformers' own hooks): ``train`` resolves ``resume_from_checkpoint=True``
(``last_checkpoint``) and refuses what is unsupported; a save runs ``_save_checkpoint`` ->
``save_model`` (the one ckptio checkpoint, committed) -> the other ``_save_*`` hooks (already
saved) -> transformers' trainer_state.json; a resume runs ``_load_from_checkpoint`` ->
``_load_optimizer_and_scheduler`` -> ``_load_scaler`` -> ``_load_rng_state`` (after the data
skip). Importing the module checks that transformers still has every hook. The route, the
checkpoint-N layout, when one is complete and what is refused: docs/BEHAVIOUR.md,
"ckptio.hf_trainer".

Owns: where a Trainer checkpoint's training state goes (one ckptio checkpoint inside
``checkpoint-N``), reading it back at the moments transformers reads its own files, and the
trainer's Checkpointer (its staging pool and I/O threads, freed when ``train()`` ends). Does not
own: which ``checkpoint-N`` can be resumed and which one ``resume_from_checkpoint=True`` picks
(hf_checkpoints.py; checkpoint_problem and last_checkpoint are importable here), the checkpoint
format, its commit or its checks (``Checkpointer.save``/``load``), the generators' capture
(ckptio.rng), when transformers saves, trainer_state.json, or the rotation
``save_total_limit`` does (all transformers' own, unchanged).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

try:
    import transformers
    from transformers.trainer_utils import HubStrategy
except ImportError as exc:  # an optional integration: say which extra brings it
    raise ImportError("ckptio.hf_trainer needs transformers and accelerate: "
                      "pip install transformers accelerate (the hf-trainer extra: "
                      "pip install -e '.[hf-trainer]' in a checkout)") from exc

from ckptio.api import Checkpointer
from ckptio.distributed.dist import current_group, over_torch
from ckptio.errors import (
    CheckpointLockedError,
    CkptError,
    StateMismatchError,
    UnsupportedPathError,
    UnsupportedStateError,
)
from ckptio.format.types import Manifest
from ckptio.hf_checkpoints import (
    CKPTIO_DIR,
    checked,
    checkpoint_problem,
    last_checkpoint,
    saved_argument,
)
from ckptio.options import Options
from ckptio.rng import RNGState
from ckptio.storage.local import runlease

__all__ = ["CKPTIO_DIR", "CkptioTrainer", "CkptioTrainerMixin", "checkpoint_problem",
           "last_checkpoint"]

_HOOKS = ("train", "save_model", "_save_checkpoint", "_save_optimizer_and_scheduler",
          "_save_scaler", "_save_rng_state", "_load_from_checkpoint",
          "_load_optimizer_and_scheduler", "_load_scaler", "_load_rng_state", "_load_best_model")
_MISSING = [name for name in _HOOKS if not callable(getattr(transformers.Trainer, name, None))]
if _MISSING:
    raise ImportError(f"ckptio.hf_trainer overrides transformers.Trainer's {', '.join(_MISSING)}, "
                      f"which transformers {transformers.__version__} does not have: install "
                      "a transformers 5 release this ckptio was tested with (5.23)")


class CkptioTrainerMixin:
    """transformers.Trainer's checkpoint hooks, through ckptio (docs/BEHAVIOUR.md).
    Put it before the Trainer class: ``class T(CkptioTrainerMixin, transformers.Trainer)``.

    ckptio_options: ckptio.Options for the saves and loads (default: the defaults and the
    CKPTIO_* environment). allow_pickle: also resume from a checkpoint-N that transformers' own
    Trainer wrote (switching a run over), read by transformers' own loaders: its optimizer.pt,
    scheduler.pt and rng_state.pth are torch.save pickles (loaded with weights_only=True).
    Saves are ckptio checkpoints either way."""

    def __init__(self, *args: Any, ckptio_options: Options | None = None,
                 allow_pickle: bool = False, **kwargs: Any) -> None:
        self.ckptio_options = ckptio_options
        self.ckptio_allow_pickle = allow_pickle
        self._ckptio_in_checkpoint = False
        self._ckptio: Checkpointer | None = None
        self._ckptio_lease: runlease.RunLease | None = None
        # the manifest of the ckptio checkpoint a resume reads (its path, the record): read
        # once by its first hook, used by the others; let go by a save and when train() ends
        self._ckptio_opened: tuple[str, Manifest] | None = None
        super().__init__(*args, **kwargs)

    # -- resume ---------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        self._ckptio_refuse_unsupported()
        self._ckptio_take_run()
        try:
            return self._ckptio_train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._ckptio_close()

    def _ckptio_train(self, resume_from_checkpoint: str | bool | None, *args: Any,
                      **kwargs: Any) -> Any:
        t: Any = self
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_checkpoint(t.args.output_dir,
                                                     allow_pickle=self.ckptio_allow_pickle)
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            resume_from_checkpoint = os.fspath(resume_from_checkpoint)
            checked(resume_from_checkpoint, self.ckptio_allow_pickle)
        return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]

    def _ckptio_take_run(self) -> None:
        """The run lease of output_dir (storage/local/runlease.py), on the job's first process
        (with save_on_each_node, not every node's: their output_dir may be one shared folder):
        a second job started there is refused before it trains, naming the one that holds it
        (two jobs would write the same checkpoint-N), on every process of it."""
        t: Any = self
        first, group, error = t.is_world_process_zero(), current_group(), None
        if first:
            output_dir = os.fspath(t.args.output_dir)
            os.makedirs(output_dir, exist_ok=True)
            try:
                self._ckptio_lease = runlease.take(output_dir, False, create=True, refusal=(
                    "this CkptioTrainer did not train",
                    "remove that lease file once no process of that job is left"))
            except CheckpointLockedError as exc:
                error = exc
        if group is not None:  # every process raises the refusal, none trains alone
            said = over_torch(group, self.ckptio_options).broadcast(
                (str(error) if error else "").encode() if first else None)
            if error is None and said:
                error = CheckpointLockedError(f"rank 0: {said.decode(errors='replace')}")
        if error is not None:
            raise error

    def _ckptio_checkpointer(self) -> Checkpointer:
        """This trainer's Checkpointer, made on first use in a ``train()``: its staging pool
        and I/O threads are freed when ``train()`` returns (or raises)."""
        if self._ckptio is None:
            options = self.ckptio_options
            self._ckptio = Checkpointer(options if options is not None else Options.from_env())
        return self._ckptio

    def _ckptio_close(self) -> None:
        self._ckptio_opened = None
        checkpointer, self._ckptio = self._ckptio, None
        lease, self._ckptio_lease = self._ckptio_lease, None
        try:
            if checkpointer is not None:
                checkpointer.close()
        finally:
            if lease is not None:
                lease.release()

    def _ckptio_refuse_unsupported(self) -> None:
        t: Any = self
        for what, on in (("DeepSpeed", t.is_deepspeed_enabled), ("FSDP", t.is_fsdp_enabled),
                         ("XLA FSDP", getattr(t, "is_fsdp_xla_enabled", False))):
            if on:
                raise UnsupportedStateError(
                    f"CkptioTrainer saves one process's or DDP's training; {what} is not "
                    "supported yet: use transformers.Trainer for this run")
        output_dir = os.fspath(t.args.output_dir or "")
        if "://" in output_dir:
            raise UnsupportedPathError(
                f"CkptioTrainer: output_dir={output_dir!r} is a URL, but transformers writes "
                "trainer_state.json, rotates checkpoint-N (save_total_limit) and finds the last "
                "one with local file calls: they would go to a local folder named "
                f"{output_dir.split('://')[0]}: while the ckptio checkpoints went elsewhere, and "
                "the run could not resume. Use a local or mounted directory (for host memory, "
                "a folder under /dev/shm)")
        strategy = HubStrategy(t.args.hub_strategy)
        if t.args.push_to_hub and strategy != HubStrategy.END:
            raise UnsupportedStateError(
                f"CkptioTrainer: push_to_hub with hub_strategy={strategy.value!r} would push "
                "checkpoints without weights (they are in checkpoint-N/ckptio/, which the Hub "
                "push does not copy); use hub_strategy='end' (trainer.save_model() pushes the "
                "final model in transformers' format)")

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        t: Any = self
        inner = checked(resume_from_checkpoint, self.ckptio_allow_pickle)
        if inner is None:  # transformers' own files (allow_pickle)
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
            return
        self._ckptio_opened = None  # a resume's first hook: its manifest read afresh
        self._ckptio_load(inner, {"model": t.model if model is None else model})

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._ckptio_load_parts(checkpoint, ("optimizer", "scheduler")):
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self._ckptio_load_parts(checkpoint, ("scaler",)):
            super()._load_scaler(checkpoint)  # type: ignore[misc]

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if self._ckptio_load_parts(checkpoint, ("rng",)):
            super()._load_rng_state(checkpoint)  # type: ignore[misc]

    def _load_best_model(self) -> None:
        t: Any = self
        best = t.state.best_model_checkpoint
        if not os.path.isdir(os.path.join(best, CKPTIO_DIR)):
            super()._load_best_model()  # type: ignore[misc]
            return
        where = checked(best, False)
        assert where is not None  # internal: best holds a ckptio checkpoint (checked above)
        self._ckptio_opened = None
        self._ckptio_load(where, {"model": t.model})

    def _ckptio_load_parts(self, checkpoint: str | None, wanted: tuple[str, ...]) -> bool:
        """Load those of ``wanted`` the checkpoint holds and this trainer has (as transformers
        skips a file that is not there: a save_only_model checkpoint, no GradScaler).
        -> whether ``checkpoint`` is in transformers' own format (allow_pickle), for it to read."""
        if checkpoint is None:
            return False
        inner = checked(checkpoint, self.ckptio_allow_pickle)
        if inner is None:
            return True
        held = self._ckptio_checkpointer().load(inner, keys=["parts"],
                                                record=self._ckptio_record(inner))["parts"]
        have = self._ckptio_objects()
        absent = sorted(k for k in have if k not in held and k != "model")
        if absent and "optimizer" in wanted:  # said once, at the first of the three loads
            warnings.warn(
                f"ckptio: {checkpoint} holds no {', '.join(absent)} (saved with "
                "save_only_model=True, or without a GradScaler): this run goes on with them as "
                "they are now, so it does not continue the saved run bitwise; resume from a "
                "checkpoint saved without save_only_model for that", stacklevel=3)
        objects = {k: v for k, v in have.items() if k in wanted and k in held}
        if "scheduler" in objects:
            self._ckptio_check_schedule(checkpoint)
        if objects:  # the model beside them, not loaded: it names the optimizer's parameters
            self._ckptio_load(inner, objects, beside={"model": have["model"]})
        return False

    def _ckptio_load(self, inner: str, objects: dict[str, Any],
                     beside: dict[str, Any] | None = None) -> None:
        """Load ``objects`` from the ckptio checkpoint ``inner``, strictly (``beside``: in the
        state, not loaded: the model, whose names let the load check that the optimizer's
        parameters are those it saved, param_check.py); a mismatch is said in the Trainer's
        terms (the load's own hints, strict=False and cast=True, are no options through it)."""
        try:
            self._ckptio_checkpointer().load(inner, {**(beside or {}), **objects},
                                             keys=list(objects), record=self._ckptio_record(inner))
        except StateMismatchError as exc:
            what = exc.problem  # without load's own strict= and cast= hints
            raise StateMismatchError(
                f"cannot resume from {os.path.dirname(inner)}: this trainer's "
                f"{' / '.join(sorted(objects))} differ from what the checkpoint saved ({what}). "
                "CkptioTrainer resumes a run with the model and TrainingArguments (optim, "
                "lr_scheduler_type, ...) that saved it: restore those, or start this "
                "configuration as a new run (another output_dir, no resume_from_checkpoint); "
                "strict=False is not available through the Trainer") from exc

    def _ckptio_check_schedule(self, checkpoint: str) -> None:
        """Refuse another lr_scheduler_type than the run that saved ``checkpoint``: most of
        transformers' schedules are a LambdaLR whose state is the same (linear, cosine, ...)."""
        t: Any = self
        saved = saved_argument(checkpoint, "lr_scheduler_type")
        kind = t.args.lr_scheduler_type
        now = getattr(kind, "value", kind)
        if saved is None or saved == now:
            return
        raise StateMismatchError(
            f"cannot resume from {checkpoint}: this trainer's lr_scheduler_type {now!r} differs "
            f"from the {saved!r} of the run that saved it ({checkpoint}/training_args.json; a "
            "scheduler's saved state does not tell most schedules apart). CkptioTrainer "
            "resumes a run with the TrainingArguments that saved it: restore "
            f"lr_scheduler_type={saved!r}, or start this configuration as a new run (another "
            "output_dir, no resume_from_checkpoint)")

    def _ckptio_record(self, inner: str) -> Manifest:
        """The manifest of ``inner``, read once for a resume's hooks (each loads a part)."""
        if self._ckptio_opened is None or self._ckptio_opened[0] != inner:
            self._ckptio_opened = (inner, self._ckptio_checkpointer().manifest(inner))
        return self._ckptio_opened[1]

    # -- save -----------------------------------------------------------------------------------

    def _ckptio_objects(self) -> dict[str, Any]:
        """The parts of the training state this trainer has now, by name."""
        t: Any = self
        objects: dict[str, Any] = {"model": t.model, "optimizer": t.optimizer,
                                   "scheduler": t.lr_scheduler,
                                   "scaler": getattr(t.accelerator, "scaler", None),
                                   "rng": RNGState()}
        return {k: v for k, v in objects.items() if v is not None}

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        self._ckptio_in_checkpoint = True  # save_model below writes the ckptio checkpoint
        try:
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
        finally:
            self._ckptio_in_checkpoint = False

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not self._ckptio_in_checkpoint:  # the user's (or the final) save: transformers' own
            super().save_model(output_dir, _internal_call)  # type: ignore[misc]
            return
        if output_dir is None:
            raise CkptError("CkptioTrainer: a checkpoint save without a directory")
        self._ckptio_save(output_dir)

    def _ckptio_save(self, output_dir: str) -> None:
        """The whole checkpoint of ``_save_checkpoint``: one ckptio save of everything it will
        hold (the optimizer, scaler and RNG hooks that follow have nothing left to write), then
        transformers' config and tokenizer files and the arguments as JSON."""
        t: Any = self
        self._ckptio_opened = None  # a resume's manifest no longer stands for what is there
        objects = self._ckptio_objects()
        if t.args.save_only_model:
            objects = {"model": objects["model"]}
        state = {**objects, "parts": sorted(objects)}
        os.makedirs(output_dir, exist_ok=True)
        # with DDP every process saves, together: the replicated model and optimizer are
        # stored once, each process's generators as its own (per-rank values)
        self._ckptio_checkpointer().save(state, os.path.join(output_dir, CKPTIO_DIR))
        if not t.args.should_save:  # the files below: the main process's, as transformers'
            return
        unwrapped = t.accelerator.unwrap_model(t.model, keep_torch_compile=False)
        if isinstance(unwrapped, transformers.PreTrainedModel):
            unwrapped.config.save_pretrained(output_dir)
            if unwrapped.can_generate() and unwrapped.generation_config is not None:
                unwrapped.generation_config.save_pretrained(output_dir)
        if t.processing_class is not None:
            t.processing_class.save_pretrained(output_dir)
        with open(os.path.join(output_dir, "training_args.json"), "w", encoding="utf-8") as f:
            f.write(t.args.to_json_string())

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """In the ckptio checkpoint already (save_model, the first hook of the checkpoint)."""

    def _save_scaler(self, output_dir: str) -> None:
        """In the ckptio checkpoint already."""

    def _save_rng_state(self, output_dir: str) -> None:
        """In the ckptio checkpoint already (ckptio.RNGState: no pickle)."""


class CkptioTrainer(CkptioTrainerMixin, transformers.Trainer):
    """transformers.Trainer whose checkpoints are ckptio checkpoints (docs/BEHAVIOUR.md); takes
    Trainer's arguments plus ``ckptio_options`` and ``allow_pickle`` (CkptioTrainerMixin)."""
