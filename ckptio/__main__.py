"""python -m ckptio: the ckptio command (see cli.py)."""

import sys

from .cli import main

sys.exit(main())
