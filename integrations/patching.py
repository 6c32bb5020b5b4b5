"""Replace a function everywhere it is bound (its defining module and every `from x import f` copy in
`sys.modules`), remember what was replaced, and undo it. Shared by the verl and vLLM adapters."""

from __future__ import annotations

import sys
from collections.abc import Callable


class PatchSet:
    """The (module, attribute, original) triples one adapter replaced."""

    def __init__(self) -> None:
        self._patched: list[tuple[object, str, object]] = []

    def replace_everywhere(self, original: Callable, replacement: Callable) -> int:
        """Point every module attribute that is `original` at `replacement`; returns how many."""
        count = 0
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for attr, value in list(namespace.items()):
                if value is original:
                    setattr(module, attr, replacement)
                    self._patched.append((module, attr, original))
                    count += 1
        return count

    def revert(self) -> None:
        for module, attr, original in reversed(self._patched):
            setattr(module, attr, original)
        self._patched.clear()

    def __bool__(self) -> bool:
        return bool(self._patched)
