"""Buffered JSON-lines files: what the scheduler records while it serves (verified trees,
iterations) without a write per record."""

from __future__ import annotations

import atexit
import json
from pathlib import Path
from typing import Any

# Lines are written in batches: a record per iteration must not cost a syscall each.
FLUSH_EVERY = 256


class JsonLines:
    """Appends JSON lines to a file (buffered; `close` flushes, also at interpreter exit)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")  # noqa: SIM115 - closed by close()
        self._pending: list[str] = []
        self.num_lines = 0
        atexit.register(self.close)  # a server stopped by a signal still writes its tail

    def append(self, row: dict[str, Any]) -> None:
        self._pending.append(json.dumps(row, separators=(",", ":")))
        self.num_lines += 1
        if len(self._pending) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self._file.write("\n".join(self._pending) + "\n")
            self._file.flush()
            self._pending.clear()

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()
