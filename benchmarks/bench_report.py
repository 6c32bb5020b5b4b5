"""The JSON report of a benchmark script, rewritten atomically after every row, so a time limit or a crash
never loses what ran."""

from __future__ import annotations

import json
import os
from collections.abc import Callable


class Report:
    """`header` plus the rows added so far under `key`, written to `path` at every `add` (and at once)."""

    def __init__(self, path: str, header: dict, key: str = "results", echo: Callable[[dict], None] | None = None) -> None:
        self.path, self.key, self.echo = path, key, echo
        self.data = {**header, key: []}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._write()

    @property
    def rows(self) -> list[dict]:
        return self.data[self.key]

    def add(self, row: dict) -> None:
        self.rows.append(row)
        if self.echo is not None:
            self.echo(row)
        self._write()

    def _write(self) -> None:
        partial = f"{self.path}.partial"
        with open(partial, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(partial, self.path)
