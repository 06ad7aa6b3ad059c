"""The state the staging-pool sizing tests save and restore (tests/test_first_save_prepare.py,
tests/test_restore_pool_size.py): four float32 tensors of ``STATE_NBYTES`` in all, a small one
and a plain value, seeded so two calls with one seed are bitwise equal.
"""

from __future__ import annotations

from typing import Any

import torch

MiB = 1 << 20
STATE_NBYTES = 8 * MiB


def pool_state(seed: int = 0) -> dict[str, Any]:
    """A fresh state of about ``STATE_NBYTES`` (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    n = STATE_NBYTES // 4 // 4
    return {"w": {f"t{i}": torch.randn(n, generator=g) for i in range(4)},
            "small": torch.arange(7.0), "step": 3}
