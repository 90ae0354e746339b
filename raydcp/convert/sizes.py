"""Sizes given on the command line and in options: ``"5GB"``, ``"512MiB"``, ``1000`` (no torch needed)."""
from __future__ import annotations

from ..errors import CheckpointError

__all__ = ["parse_size"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes from ``"5GB"`` (10**9 units, as Hugging Face uses), ``"512MiB"`` (2**20) or ``1000``."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        s = str(text).strip().lower().replace("_", "")
        num = s.rstrip("abcdefghijklmnopqrstuvwxyz").strip()
        unit = s[len(num):].strip()
        try:
            value = int(float(num) * _UNITS[unit])
        except (KeyError, ValueError):
            raise CheckpointError(
                f"invalid size {text!r}: use a number of bytes with an optional unit, e.g. 5GB, 100MB, 512MiB"
            ) from None
    if value < 1:
        raise CheckpointError(f"invalid size {text!r}: it must be at least 1 byte")
    return value
