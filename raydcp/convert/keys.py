"""Which keys an export or a reshard keeps, under which names, in which dtype (pure, no torch).

One implementation shared by ``raydcp reshard`` (:class:`raydcp.reshard.plan.ReshardOptions`)
and ``raydcp convert`` (the exports and ``--from safetensors``):

- ``drop_optimizer`` leaves out every key under :data:`OPTIMIZER_PREFIXES`;
- ``drop_prefixes`` leave out each of these keys and the keys under it (dotted FQNs);
- ``strip_prefixes`` remove a leading ``PREFIX.`` from the keys that have it (``model.`` gives a
  Hugging Face model's own keys); two keys that end up with one name are an error;
- ``dtype`` casts the floating tensors of the model (every key not under an optimizer prefix);
  with ``dtype_all`` also the optimizer's. A tensor named ``step`` (optimizer step counters,
  which are floats holding integers) is never cast.

:func:`add_key_arguments` and :func:`key_selection_from_args` are the command-line side.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Iterable

from ..errors import CheckpointError

__all__ = ["OPTIMIZER_PREFIXES", "DTYPE_ALIASES", "KeySelection", "add_key_arguments",
           "key_selection_from_args", "dtype_alias", "under"]

OPTIMIZER_PREFIXES = ("optim", "optimizer", "optimizers", "optim_state", "optimizer_state")
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
                 "fp64": "float64", "double": "float64", "fp8": "float8_e4m3fn"}
_NEVER_CAST = ("step",)  # last FQN component of optimizer step counters


def under(key: str, prefix: str) -> bool:
    """``key`` is ``prefix`` or a key below it (``model.w`` is under ``model``, ``model2`` is not)."""
    return key == prefix or key.startswith(prefix + ".")


def dtype_alias(name: str) -> str:
    """A floating dtype name as raydcp stores it (``bf16`` -> ``bfloat16``)."""
    from ..codec import DTYPES

    full = DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if full not in DTYPES or not DTYPES[full].is_floating_point:
        floats = [n for n, d in DTYPES.items() if d.is_floating_point]
        raise CheckpointError(f"--dtype {name!r} is not a floating dtype; choose one of {', '.join(floats)} "
                              f"(or {', '.join(DTYPE_ALIASES)})")
    return full


def _prefixes(values: Iterable[str], flag: str) -> tuple[str, ...]:
    values = tuple(values)
    if any(not isinstance(p, str) or not p.strip(". ") for p in values):
        raise CheckpointError(f"{flag} prefixes must be non-empty key prefixes, got {list(values)}")
    return tuple(sorted({p.strip(".") for p in values}))


@dataclass(frozen=True, kw_only=True)
class KeySelection:
    """What to keep, rename and cast (validated at construction)."""

    drop_optimizer: bool = False
    drop_prefixes: tuple[str, ...] = ()
    strip_prefixes: tuple[str, ...] = ()
    dtype: str | None = None
    dtype_all: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "drop_prefixes", _prefixes(self.drop_prefixes, "--drop"))
        # longest first: with "model" and "model.inner", model.inner.w loses model.inner.
        strip = _prefixes(self.strip_prefixes, "--strip-prefix")
        object.__setattr__(self, "strip_prefixes", tuple(sorted(strip, key=lambda p: (-len(p), p))))
        if self.dtype is not None:
            object.__setattr__(self, "dtype", dtype_alias(self.dtype))
        if self.dtype_all and self.dtype is None:
            raise CheckpointError("--dtype-all needs --dtype")

    @property
    def identity(self) -> bool:
        """True when nothing is dropped, renamed or cast."""
        return not (self.drop_optimizer or self.drop_prefixes or self.strip_prefixes or self.dtype)

    def dropped(self, key: str) -> bool:
        prefixes = self.drop_prefixes + (OPTIMIZER_PREFIXES if self.drop_optimizer else ())
        return any(under(key, p) for p in prefixes)

    def rename(self, key: str) -> str:
        for p in self.strip_prefixes:
            if key.startswith(p + "."):
                return key[len(p) + 1:]
        return key

    def is_optimizer(self, key: str) -> bool:
        return any(under(key, p) for p in OPTIMIZER_PREFIXES)

    def cast(self, key: str, dtype: str) -> str:
        """The dtype the tensor ``key`` (stored as ``dtype``) is written in."""
        from ..codec import dtype_from_name

        if self.dtype is None or not dtype_from_name(dtype).is_floating_point:
            return dtype
        if key.rsplit(".", 1)[-1] in _NEVER_CAST:
            return dtype
        if self.is_optimizer(key) and not self.dtype_all:
            return dtype
        return self.dtype

    def names(self, keys: Iterable[str]) -> dict[str, str]:
        """``{source key: destination key}`` for the keys kept; CheckpointError when two collide."""
        out: dict[str, str] = {}
        seen: dict[str, str] = {}
        for key in sorted(keys):
            if self.dropped(key):
                continue
            new = self.rename(key)
            if not new and key:  # an empty name the source already had is kept as it is
                raise CheckpointError(f"--strip-prefix would leave {key!r} without a name")
            if new in seen:
                raise CheckpointError(f"--strip-prefix maps both {seen[new]!r} and {key!r} to {new!r}; drop one of "
                                      "them (--drop PREFIX) or strip a longer prefix")
            seen[new] = key
            out[key] = new
        return out


def add_key_arguments(parser: argparse.ArgumentParser, *, dtype_help: str | None = None) -> None:
    """The options of :class:`KeySelection` (``--drop-optimizer --drop --strip-prefix --dtype --dtype-all``)."""
    parser.add_argument("--drop-optimizer", action="store_true",
                        help=f"leave out optimizer state (keys under {', '.join(OPTIMIZER_PREFIXES)})")
    parser.add_argument("--drop", action="append", default=[], metavar="PREFIX",
                        help="leave out this key and the keys under it (repeatable), e.g. --drop model.lm_head")
    parser.add_argument("--strip-prefix", action="append", default=[], metavar="PREFIX",
                        help="remove PREFIX. from the keys that start with it (repeatable), e.g. --strip-prefix "
                             "model gives a Hugging Face model's keys")
    parser.add_argument("--dtype", default=None, metavar="DTYPE",
                        help=dtype_help or "cast the model's floating tensors to DTYPE (bf16, fp16, fp32, ...); "
                                           "optimizer state, integer and bool tensors are copied unchanged")
    parser.add_argument("--dtype-all", action="store_true",
                        help="with --dtype, cast the optimizer's floating tensors too (never its step counters)")


def key_selection_from_args(args: argparse.Namespace) -> KeySelection:
    return KeySelection(drop_optimizer=args.drop_optimizer, drop_prefixes=tuple(args.drop),
                        strip_prefixes=tuple(args.strip_prefix), dtype=args.dtype, dtype_all=args.dtype_all)
