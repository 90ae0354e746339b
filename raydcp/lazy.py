"""Read-only containers whose contents are built from arrays on first use.

Plans and metadata hold their pieces as columns; code that wants objects (a mapping of
tensor specs, a tuple of items) gets these views, which build the objects once, when first
asked, and otherwise cost nothing.
"""
from __future__ import annotations

import importlib
import sys
from abc import abstractmethod
from typing import Any, Iterator, Mapping, Sequence

__all__ = ["LazyMapping", "LazySequence", "lazy_attribute"]


class LazyMapping(Mapping):
    """A read-only mapping whose dict :meth:`_build` makes on the first lookup."""

    __slots__ = ("_dict",)
    _dict: dict | None

    @abstractmethod
    def _build(self) -> dict:
        """The mapping's contents, built once."""

    def _all(self) -> dict:
        if self._dict is None:
            self._dict = self._build()
        return self._dict

    def __getitem__(self, key) -> Any:
        return self._all()[key]

    def __iter__(self) -> Iterator:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def __contains__(self, key) -> bool:
        return key in self._all()

    def keys(self):
        return self._all().keys()

    def values(self):
        return self._all().values()

    def items(self):
        return self._all().items()

    def get(self, key, default=None):
        return self._all().get(key, default)

    def __repr__(self) -> str:
        return repr(self._all())


class LazySequence(Sequence):
    """A read-only sequence whose tuple :meth:`_build` makes on first use."""

    __slots__ = ("_objs",)
    _objs: tuple | None

    @abstractmethod
    def _build(self) -> tuple:
        """The sequence's contents, built once."""

    def _all(self) -> tuple:
        if self._objs is None:
            self._objs = self._build()
        return self._objs

    def __getitem__(self, i):
        return self._all()[i]

    def __iter__(self):
        return iter(self._all())

    def __eq__(self, other):
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return self._all() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return repr(self._all())


def lazy_attribute(package: str, table: Mapping[str, str], name: str) -> Any:
    """A package's ``__getattr__``: import the module ``table[name]`` (relative to ``package``) on
    first use, keep the name in the package (later lookups cost nothing), and return it. Keeps
    heavy imports (torch, pyarrow) out of ``import package``."""
    if name not in table:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(table[name], package), name)
    setattr(sys.modules[package], name, value)
    return value
