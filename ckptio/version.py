"""ckptio's version, in one place every module may import (ckptio/__init__ re-exports it)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
