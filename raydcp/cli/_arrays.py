"""A checkpoint's tensors as numpy arrays, for ``raydcp diff``: read without torch.

:class:`ArraySource` reads whole tensors a bounded group at a time, straight from the stored
pieces (each piece's CRC32C checked, compressed pieces decompressed) into one byte array per
tensor: shape ``(*shape, itemsize)`` of uint8, so every stored dtype (bfloat16, float8 kinds,
complex32 too) is handled the same way and compared bit for bit. :func:`numeric` turns such an
array into numbers numpy computes with, for comparisons within a tolerance.
"""
from __future__ import annotations

import math
from typing import Callable, Iterator, Sequence

import numpy as np

from ..codec import checksum, decompress, itemsize
from ..errors import CheckpointDamagedError, CheckpointError
from ..metadata_format import decode_metadata
from ..planner.tiling import piece_problems
from ..storage import METADATA_NAME, CheckpointStorage

__all__ = ["ArraySource", "numeric", "compare_arrays"]

_BATCH = 64 << 20  # bytes read per storage call


class ArraySource:
    """The committed checkpoint at ``path``: its metadata, and its tensors as byte arrays."""

    def __init__(self, path: str, storage_options: dict | None, budget_bytes: int):
        self.storage = CheckpointStorage(path, storage_options)
        self.url = self.storage.url
        self.metadata = decode_metadata(self.storage.read_metadata_bytes(), self.storage.file_url(METADATA_NAME))
        self.budget = budget_bytes

    def nbytes(self, key: str) -> int:
        t = self.metadata.tensors[key]
        return math.prod(t.shape) * itemsize(t.dtype)

    def groups(self, keys: Sequence[str]) -> list[list[str]]:
        """``keys`` in order, cut into consecutive groups of at most the budget's bytes (a larger
        tensor alone)."""
        out: list[list[str]] = []
        size = 0
        for key in keys:
            n = self.nbytes(key)
            if not out or size + n > self.budget:
                out.append([])
                size = 0
            out[-1].append(key)
            size += n
        return out

    def read(self, keys: Sequence[str]) -> dict[str, np.ndarray]:
        """The tensors ``keys``, each a fresh uint8 array of shape ``(*shape, itemsize)``."""
        tensors = self.metadata.tensors
        out: dict[str, np.ndarray] = {}
        by_file: dict[str, list] = {}
        for key in keys:
            t = tensors[key]
            gaps = piece_problems(key, tuple(t.shape), [(tuple(c.offsets), tuple(c.sizes)) for c in t.chunks])
            if gaps:
                raise CheckpointDamagedError(f"{self.url}: the metadata's pieces do not form whole tensors "
                                             f"(run `raydcp verify`): {'; '.join(gaps[:5])}", key=key)
            out[key] = np.empty((*t.shape, itemsize(t.dtype)), np.uint8)
            for c in t.chunks:
                if c.nbytes:
                    by_file.setdefault(c.file, []).append((key, c))
        for name, pieces in by_file.items():
            pieces.sort(key=lambda p: p[1].byte_offset)
            start = 0
            while start < len(pieces):  # batches of about _BATCH bytes per storage call
                end, size = start, 0
                while end < len(pieces) and (end == start or size + pieces[end][1].stored_length <= _BATCH):
                    size += pieces[end][1].stored_length
                    end += 1
                batch = pieces[start:end]
                views = self.storage.read_ranges(name, [(c.byte_offset, c.byte_offset + c.stored_length)
                                                        for _, c in batch])
                for (key, c), view in zip(batch, views):
                    self._place(out[key], key, name, c, view)
                start = end
        return out

    def _place(self, dest: np.ndarray, key: str, name: str, c, view) -> None:
        where = (c.byte_offset, c.byte_offset + c.stored_length)
        if checksum(view) != c.checksum:
            raise CheckpointDamagedError(f"{self.storage.file_url(name)}: the piece of {key} at {list(c.offsets)} "
                                         "fails its checksum; the data is damaged (run `raydcp verify`)",
                                         file=name, key=key, byte_range=where)
        if c.compression is not None:
            try:
                view = decompress(c.compression, view, c.nbytes)
            except ValueError as exc:
                raise CheckpointDamagedError(f"{self.storage.file_url(name)}: the piece of {key} at {list(c.offsets)} "
                                             f"does not decompress ({exc})", file=name, key=key,
                                             byte_range=where) from None
        box = tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))
        dest[box] = np.frombuffer(view, np.uint8).reshape(*c.sizes, dest.shape[-1])

    def iter_arrays(self, keys: Sequence[str],
                    progress: Callable[[int, int], None] | None = None) -> Iterator[tuple[str, np.ndarray]]:
        """``(key, byte array)`` in ``keys`` order, one group in memory at a time."""
        total, done = sum(self.nbytes(k) for k in keys), 0
        if progress:
            progress(0, total)
        for group in self.groups(keys):
            arrays = self.read(group)
            for key in group:
                yield key, arrays.pop(key)
                done += self.nbytes(key)
                if progress:
                    progress(done, total)


# ---- numbers from bytes ---------------------------------------------------------------------

_NUMPY = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "complex128": np.complex128,
          "complex64": np.complex64, "int64": np.int64, "int32": np.int32, "int16": np.int16, "int8": np.int8,
          "uint64": np.uint64, "uint32": np.uint32, "uint16": np.uint16, "uint8": np.uint8, "bool": np.bool_}


def _float8_table(exp_bits: int, bias: int, finite_nan: int | None, ieee: bool) -> np.ndarray:
    """The float32 value of each of the 256 bytes of a float8 format with a sign bit:
    ``ieee`` (inf and NaN at the top exponent, as float8_e5m2), else NaN only at the byte
    ``finite_nan`` masked by the sign (e4m3fn: 0x7f / 0xff), or at 0x80 alone (the ``fnuz`` kinds,
    ``finite_nan`` None: no negative zero)."""
    man_bits = 7 - exp_bits
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> man_bits) & ((1 << exp_bits) - 1)
    m = b & ((1 << man_bits) - 1)
    frac = m / (1 << man_bits)
    value = sign * np.where(e == 0, frac * 2.0 ** (1 - bias), (1 + frac) * 2.0 ** (e - bias))
    if ieee:
        top = e == (1 << exp_bits) - 1
        value = np.where(top & (m == 0), sign * np.inf, value)
        value = np.where(top & (m != 0), np.nan, value)
    elif finite_nan is not None:
        value = np.where((b & 0x7F) == finite_nan, np.nan, value)
    else:
        value = np.where(b == 0x80, np.nan, value)
    return value.astype(np.float32)


_FLOAT8 = {
    "float8_e5m2": _float8_table(5, 15, None, ieee=True),
    "float8_e4m3fn": _float8_table(4, 7, 0x7F, ieee=False),
    "float8_e4m3fnuz": _float8_table(4, 8, None, ieee=False),
    "float8_e5m2fnuz": _float8_table(5, 16, None, ieee=False),
}
# float8_e8m0fnu: an unsigned exponent, 2**(b - 127); 0xff is NaN
_FLOAT8["float8_e8m0fnu"] = np.where(np.arange(256) == 255, np.nan,
                                     2.0 ** (np.arange(256) - 127.0)).astype(np.float32)


def numeric(data: np.ndarray, dtype: str) -> np.ndarray:
    """The values of a byte array from :meth:`ArraySource.read` in a dtype numpy subtracts and
    compares without losing precision, as ``raydcp diff`` compares them: float64 and complex128
    unchanged, other floats as float32 (bfloat16, float8 kinds) or their own numpy type widened to
    float32, complex kinds as complex128, integers and bool as float64."""
    flat = np.ascontiguousarray(data).reshape(-1)
    shape = data.shape[:-1]
    if dtype == "bfloat16":
        values = (flat.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif dtype in _FLOAT8:
        values = _FLOAT8[dtype][flat]
    elif dtype == "complex32":
        pairs = flat.view(np.float16).astype(np.float32)
        values = pairs[0::2] + 1j * pairs[1::2].astype(np.complex64)
    elif dtype in _NUMPY:
        values = flat.view(_NUMPY[dtype])
    else:
        raise CheckpointError(f"cannot compare tensors of dtype {dtype!r} within a tolerance")
    values = values.reshape(shape)
    if np.iscomplexobj(values):
        return values.astype(np.complex128)
    if values.dtype == np.float64:
        return values
    if np.issubdtype(values.dtype, np.floating):
        return values.astype(np.float32)
    return values.astype(np.float64)


def compare_arrays(a: np.ndarray, b: np.ndarray, dtype: str, rtol: float, atol: float) -> tuple[bool, float]:
    """(equal within tolerance, largest absolute difference; inf where only one side is NaN) of two
    byte arrays of one dtype and shape. Without tolerances they must be bit-identical (NaNs with the
    same bits are equal; -0.0 and 0.0 are not); with them ``|b - a| <= atol + rtol * |a|``."""
    if a.size == 0:
        return True, 0.0
    exact = rtol == 0 and atol == 0
    if exact and np.array_equal(a, b):
        return True, 0.0
    x, y = numeric(a, dtype), numeric(b, dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(x - y)
        if np.issubdtype(diff.dtype, np.floating):
            x_nan, y_nan = np.isnan(x), np.isnan(y)
            diff = np.where(x_nan & y_nan, 0.0, diff)
            diff = np.where(x_nan ^ y_nan, np.inf, diff)
            diff = np.where(np.isinf(x) & np.isinf(y) & (x == y), 0.0, diff)
        max_diff = float(diff.max())
        if exact:  # the bits differ, even where the values compare equal (-0.0 and 0.0, NaN payloads)
            return False, max_diff
        return bool(np.isclose(y, x, rtol=rtol, atol=atol, equal_nan=True).all()), max_diff
