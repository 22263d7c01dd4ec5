"""`python -m adaserve.bench`: the same as `adaserve bench`."""

from __future__ import annotations

import sys

from adaserve.bench.command import main

if __name__ == "__main__":
    sys.exit(main())
