"""Which ``checkpoint-N`` directories of a Trainer run can be resumed, and why not.

Call order: ckptio.hf_trainer imports this module once its own check that transformers is
there passed; ``CkptioTrainer.train(resume_from_checkpoint=True)`` asks last_checkpoint for the
newest one that can be resumed (warning for each newer one passed over), and every hook that
reads a checkpoint back asks checked() first. A ``checkpoint-N`` can be resumed when its ckptio
checkpoint (``CKPTIO_DIR``) committed, or, with ``allow_pickle``, transformers' own weight files
are there, and its trainer_state.json is readable and names step N. checkpoint_problem and
last_checkpoint are public, through ckptio.hf_trainer.

Owns: those rules and their messages. Does not own: the trainer's hooks and its Checkpointer
(hf_trainer.py), when a checkpoint commits (storage/local/local_root.py is_committed), the
``checkpoint-N`` names and rotation (transformers' own).
"""

from __future__ import annotations

import json
import os
import re
import warnings

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

from ckptio.errors import (
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from ckptio.storage.local.local_root import is_committed

__all__ = ["CKPTIO_DIR", "TRAINER_STATE", "checked", "checkpoint_problem", "last_checkpoint",
           "saved_argument"]

CKPTIO_DIR = "ckptio"  # the ckptio checkpoint's directory inside checkpoint-N
TRAINER_STATE = "trainer_state.json"
_STEP_DIR = re.compile(rf"^{re.escape(PREFIX_CHECKPOINT_DIR)}-(\d+)$")
_TRANSFORMERS_WEIGHTS = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME,
                         WEIGHTS_INDEX_NAME)


def checkpoint_problem(path: str, *, allow_pickle: bool = False) -> str | None:
    """Why the Trainer checkpoint directory ``path`` cannot be resumed, or None when it can:
    its ckptio checkpoint committed (or, with ``allow_pickle``, transformers' own files there)
    and its trainer_state.json readable, naming its step."""
    found = _problem(path, allow_pickle)
    return None if found is None else found[1]


def _problem(path: str, allow_pickle: bool) -> tuple[type[CkptError], str] | None:
    """checkpoint_problem, with the CkptError subclass that says it."""
    inner = os.path.join(path, CKPTIO_DIR)
    if not os.path.isdir(path):
        return CheckpointNotFoundError, "is not a directory"
    if os.path.isdir(inner):
        if not is_committed(inner):
            return IncompleteCheckpointError, (
                f"has a ckptio checkpoint ({CKPTIO_DIR}/) that never committed: a save cut short")
    elif not (allow_pickle and _has_transformers_weights(path)):
        return CheckpointNotFoundError, (
            f"holds no ckptio checkpoint ({CKPTIO_DIR}/): not written by a CkptioTrainer "
            "(allow_pickle=True resumes one that transformers' own Trainer wrote, reading its "
            "torch.save files)")
    state_file = os.path.join(path, TRAINER_STATE)
    try:
        with open(state_file, encoding="utf-8") as f:
            step = json.load(f).get("global_step")
    except FileNotFoundError:
        return CorruptCheckpointError, (
            f"has no {TRAINER_STATE}: the save stopped before transformers wrote it")
    except (OSError, ValueError, AttributeError) as exc:
        return (CorruptCheckpointError,
                f"has a {TRAINER_STATE} that cannot be read ({type(exc).__name__}: {exc})")
    named = _step_of(os.path.basename(os.path.normpath(path)))
    if named >= 0 and step != named:
        return CorruptCheckpointError, f"has a {TRAINER_STATE} naming step {step}, not {named}"
    return None


def _has_transformers_weights(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, name)) for name in _TRANSFORMERS_WEIGHTS)


def _step_of(name: str) -> int:
    found = _STEP_DIR.match(name)
    return -1 if found is None else int(found.group(1))


def last_checkpoint(output_dir: str, *, allow_pickle: bool = False) -> str:
    """The newest ``checkpoint-N`` in ``output_dir`` that can be resumed (checkpoint_problem),
    warning once for each newer one passed over and why. CheckpointNotFoundError when there is
    none at all, IncompleteCheckpointError when none of those there can be resumed."""
    try:
        names = [n for n in os.listdir(output_dir) if _STEP_DIR.match(n)]
    except OSError as exc:
        raise CheckpointNotFoundError(
            f"cannot list {output_dir} for resume_from_checkpoint=True ({exc.strerror or exc}); "
            "check args.output_dir, or start without resume_from_checkpoint") from None
    steps = sorted(names, key=_step_of, reverse=True)
    passed: list[str] = []
    for name in steps:
        path = os.path.join(output_dir, name)
        problem = checkpoint_problem(path, allow_pickle=allow_pickle)
        if problem is None:
            return path
        warnings.warn(f"ckptio: resume_from_checkpoint=True passes over {path}: it {problem}",
                      stacklevel=3)
        passed.append(f"{name}: {problem}")
    if not passed:
        raise CheckpointNotFoundError(
            f"resume_from_checkpoint=True: {output_dir} holds no {PREFIX_CHECKPOINT_DIR}-N "
            "directory; start without resume_from_checkpoint, or point args.output_dir at the run")
    raise IncompleteCheckpointError(
        f"resume_from_checkpoint=True: no checkpoint in {output_dir} can be resumed ("
        + "; ".join(passed) + "); pass one explicitly or start without resume_from_checkpoint")


def checked(path: str, allow_pickle: bool) -> str | None:
    """``path``'s ckptio checkpoint (None: transformers' own files, allowed by ``allow_pickle``),
    or the CkptError saying why it cannot be resumed."""
    found = _problem(path, allow_pickle)
    if found is not None:
        error, problem = found
        raise error(f"cannot resume from {path}: it {problem}; pick another checkpoint-N "
                    "(resume_from_checkpoint=True takes the newest complete one)")
    inner = os.path.join(path, CKPTIO_DIR)
    return inner if os.path.isdir(inner) else None


def saved_argument(checkpoint: str, name: str) -> object:
    """The TrainingArguments value ``name`` of the run that saved ``checkpoint`` (its
    training_args.json), or None where that file is missing or unreadable (a checkpoint of
    transformers' own Trainer holds training_args.bin) or lacks ``name``."""
    try:
        with open(os.path.join(checkpoint, "training_args.json"), encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    return saved.get(name) if isinstance(saved, dict) else None
