"""What the load-stall tests share (tests/test_rt_load_stall.py, tests/test_rt_leftovers3.py): a
load run behind the test's thread while its reads are held, and the ``ckptio`` warnings it waits
for, each within one bound."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

WARN_S = 0.2  # Options.io_stall_warn_s of these loads
BOUND_S = 10.0  # a warning, or a load once released, that takes longer is a bug


class Behind:
    """``call()`` on a thread of its own: its result or error, once it returns."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self.thread.start()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self.result = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test, which raises it
            self.error = exc

    def joined(self) -> Any:
        self.thread.join(BOUND_S)
        assert not self.thread.is_alive(), "the load did not finish once its read was released"
        if self.error is not None:
            raise self.error
        return self.result


def warned(caplog: pytest.LogCaptureFixture, words: str, count: int = 1) -> list[str]:
    """The ``ckptio`` warnings holding ``words``, once there are ``count`` (or BOUND_S passed)."""
    deadline = time.monotonic() + BOUND_S
    while True:
        said = [r.getMessage() for r in caplog.records
                if r.name == "ckptio" and words in r.getMessage()]
        if len(said) >= count or time.monotonic() > deadline:
            return said
        time.sleep(0.02)
