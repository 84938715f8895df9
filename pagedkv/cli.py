"""``python -m pagedkv.cli``: the command line (``pagedkv.app.cli``) under its first module path."""

import sys

from pagedkv.app.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
