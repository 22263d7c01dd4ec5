"""`python -m adaserve.distill ...`: the same as `adaserve distill ...`."""

from __future__ import annotations

import sys

from adaserve.distill.cli import main

sys.exit(main())
