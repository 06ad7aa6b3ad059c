"""python -m ckptio.cli: the ckptio command (the same as python -m ckptio)."""

import sys

from ckptio.cli import main

__all__: list[str] = []

sys.exit(main())
