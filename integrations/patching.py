"""Replace functions and attributes, remember exactly what was there, and undo it. Shared by the verl and
vLLM adapters.

- `replace_everywhere(original, replacement)`: every module attribute in `sys.modules` that is `original`
  (the vLLM adapter's use).
- `replace_in_modules(original, replacement, prefixes)`: the same, limited to modules whose name is one of
  `prefixes` or lies under one (the verl adapter: verl's and Megatron's modules, never a user's).
- `set_attr(owner, name, value, restore=...)`: one attribute of a class or an instance (an engine that
  captured a function when it was built); revert puts back the very object (or `restore` where the
  caller says what was there is itself a product of the patch), or removes the attribute if `owner` did
  not hold one itself.
- `original_of(obj)`: the original a recorded replacement stands for, or None.
- `revert()`: undo in reverse order, then point any module under the recorded prefixes that picked up a
  replacement later (a `from x import f` after the patch) back at the original.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any

_MISSING = object()
KEEP = _MISSING  # `set_attr(..., restore=KEEP)`: revert puts back what the owner held


def _module_matches(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _owner_ref(owner: object) -> Callable[[], Any]:
    """A weak reference where the owner allows one (engines stay collectable), else a strong one."""
    try:
        return weakref.ref(owner)
    except TypeError:
        return lambda: owner


class PatchSet:
    """The (owner, attribute, original) triples one adapter replaced."""

    def __init__(self) -> None:
        self._patched: list[tuple[Callable[[], Any], str, object]] = []
        self._replacements: dict[int, tuple[object, object]] = {}
        self._prefixes: set[str] = set()

    def replace_everywhere(self, original: Callable, replacement: Callable) -> int:
        """Point every module attribute that is `original` at `replacement`; returns how many."""
        return self._replace(original, replacement, list(sys.modules.values()))

    def replace_in_modules(self, original: Callable, replacement: Callable, prefixes: Iterable[str]) -> int:
        """Like `replace_everywhere`, only in modules named by (or under) `prefixes`; returns how many."""
        prefixes = tuple(prefixes)
        self._prefixes.update(prefixes)
        modules = [m for name, m in list(sys.modules.items()) if _module_matches(name, prefixes)]
        return self._replace(original, replacement, modules)

    def set_attr(self, owner: object, name: str, value: object, restore: object = KEEP) -> None:
        """Set `owner.name = value`, remembering what `owner` itself held (or that it held nothing), or
        `restore` as what revert puts back."""
        own = vars(owner).get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name, _MISSING)
        setattr(owner, name, value)
        self._patched.append((_owner_ref(owner), name, own if restore is KEEP else restore))

    def original_of(self, obj: object) -> object | None:
        """The original that `obj` replaced, when `obj` is one of this set's replacements; else None."""
        pair = self._replacements.get(id(obj))
        return pair[1] if pair is not None and pair[0] is obj else None

    def revert(self) -> None:
        for ref, attr, original in reversed(self._patched):
            owner = ref()
            if owner is None:
                continue  # an instance that has been collected
            if original is _MISSING:
                if attr in getattr(owner, "__dict__", {}):
                    delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        self._sweep()
        self._patched.clear()
        self._replacements.clear()
        self._prefixes.clear()

    def _replace(self, original: object, replacement: object, modules: list) -> int:
        self._replacements[id(replacement)] = (replacement, original)
        count = 0
        for module in modules:
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for attr, value in list(namespace.items()):
                if value is original:
                    setattr(module, attr, replacement)
                    self._patched.append((_owner_ref(module), attr, original))
                    count += 1
        return count

    def _sweep(self) -> None:
        """Modules under the recorded prefixes imported after the patch hold a replacement: restore."""
        if not self._prefixes:
            return
        prefixes = tuple(self._prefixes)
        for name, module in list(sys.modules.items()):
            if not _module_matches(name, prefixes):
                continue
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for attr, value in list(namespace.items()):
                pair = self._replacements.get(id(value))
                if pair is not None and pair[0] is value:
                    setattr(module, attr, pair[1])

    def __bool__(self) -> bool:
        return bool(self._patched)
