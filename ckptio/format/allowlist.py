"""The allow-list unpickler every torch-free reader of a pickle decodes with.

A pickle may name any Python global and run it. ``AllowListUnpickler`` resolves only the
globals a reader's allow-list maps to stand-ins (never the real classes or functions) and
refuses every other global and every persistent id with a PickleRefusedError naming the file.
``DType`` is the stand-in every allow-list gives for a torch dtype, so that what is decoded
names a dtype without importing torch.

Call order: a reader (dcpmeta.py, torchzip.py, torchsave.py, loading/tcdir.py) builds its
allow-list, subclasses or calls ``AllowListUnpickler`` and catches ``PICKLE_ERRORS``, what a
hostile pickle can make it raise; its callers check the stand-ins it returns.

Owns: that refusal, the errors a broken pickle raises, ``NO_ALLOW_PICKLE`` (the words of a
refusal that allow_pickle does not lift, which says its own fix: tcdir.py's; the CLI then adds
none), and ``DType``. Pure: never imports
torch (a test checks it). Does not own: which globals a reader allows, nor checking what
the stand-ins hold (each reader).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptio.errors import PickleRefusedError
from ckptio.format.types import show

__all__ = ["NO_ALLOW_PICKLE", "PICKLE_ERRORS", "AllowListUnpickler", "DType"]

NO_ALLOW_PICKLE = "allow_pickle=True does not change that"  # a refusal saying its own fix

# What a hostile pickle can make pickle.Unpickler raise besides our own CkptErrors.
PICKLE_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
                 IndexError, KeyError, OverflowError, RecursionError, MemoryError)


@dataclass(frozen=True)
class DType:
    """A torch dtype, by its name in types.DTYPE_ITEMSIZE."""

    name: str


class AllowListUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals in ``allowed`` (to stand-ins, never the real
    classes or functions) and refuses every other global and every persistent id with a
    PickleRefusedError; ``refusal(module, name)`` says why, naming the file."""

    def __init__(self, data: bytes, where: str, allowed: dict[tuple[str, str], Any],
                 refusal: Callable[[str, str], str]) -> None:
        super().__init__(io.BytesIO(data))
        self.where, self.allowed, self.refusal = where, allowed, refusal

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:
            raise PickleRefusedError(self.refusal(module, name))
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise PickleRefusedError(f"{self.where} holds a pickle persistent id ({show(pid)}), which "
                                 "DCP metadata never does; refused, nothing was loaded")

