"""A loaded state's tensors moved to the device a framework's ``map_location`` names, for the
plugins that hand a fresh load to a framework (ckptio.lightning, ckptio.deepspeed_reads).

Owns: ``moved``, the walk over dicts, lists and tuples that keeps each container's type (an
OrderedDict, a defaultdict's factory, a namedtuple). Does not own: which device a
``map_location`` names (each plugin's own rule), the load.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["moved"]


def moved(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it moved to ``device`` (containers copied, others kept)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        out = copy.copy(value)  # its type, order and a defaultdict's factory
        for key, item in value.items():
            out[key] = moved(item, device)
        return out
    if isinstance(value, list):
        return [moved(item, device) for item in value]
    if isinstance(value, tuple):
        items = [moved(item, device) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value
