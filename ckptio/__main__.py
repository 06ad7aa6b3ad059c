"""python -m ckptio: the ckptio command (see cli.py)."""

import sys

from ckptio.cli import main

__all__: list[str] = []

sys.exit(main())
