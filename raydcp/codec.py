"""Tensor <-> bytes, checksums, compression of pieces and plain-value encoding.

Tensors are stored as their raw little-endian element bytes in row-major order
(``tensor.contiguous().view(torch.uint8)``): no header, no pickle, so any dtype
torch can view as bytes (bfloat16, float8 kinds, complex, bool) round-trips
bit-exactly. A piece may instead be stored compressed (:func:`compress`, one
self-contained frame per piece, through pyarrow's library codecs: ``zstd``, or
``lz4`` in the LZ4 frame format). Plain values are encoded as tagged JSON.
"""
from __future__ import annotations

import base64
import functools
import math
import sys
import warnings
from typing import TYPE_CHECKING, Any, Sequence

import crc32c as _crc32c
import numpy as np

from .errors import CheckpointError
from .metadata import COMPRESSIONS

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPES",  # noqa: F822 (made by the module's __getattr__, with torch, on first use)
    "dtype_name", "dtype_from_name", "itemsize", "tensor_bytes", "tensor_from_bytes",
    "checksum", "block_checksums", "checksums", "crc32c_combine", "combine_block_checksums",
    "COMPRESSIONS", "check_compression", "compress", "decompress",
    "encode_value", "decode_value", "is_plain_value",
]

# torch is imported when a tensor is made or named, not with this module: reading metadata,
# checking checksums and planning (`raydcp inspect`, `verify`, `ls`) work on names and bytes.
# The element sizes of the stored dtypes are part of the format (docs/FORMAT.md).
_ITEMSIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
}
_TABLES: tuple[dict, dict] | None = None  # (name -> torch.dtype, torch.dtype -> name), built on first use


def _tables() -> tuple[dict, dict]:
    global _TABLES
    if _TABLES is None:
        import torch

        dtypes = {name: getattr(torch, name) for name in _ITEMSIZES if hasattr(torch, name)}
        _TABLES = (dtypes, {dt: name for name, dt in dtypes.items()})
    return _TABLES


def __getattr__(name: str):
    if name == "DTYPES":  # name -> torch.dtype of every dtype this torch has (imports torch)
        return _tables()[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch.Tensor, without importing torch (no tensor exists before it is)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _tables()[1][dtype]
    except KeyError:
        raise CheckpointError(f"dtype {dtype} cannot be stored; supported: {', '.join(_tables()[0])}") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _tables()[0][name]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata (written by a newer raydcp?)") from None


def itemsize(name: str) -> int:
    """Bytes per element of the stored dtype ``name`` (no torch needed)."""
    size = _ITEMSIZES.get(name)
    if size is None:
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata (written by a newer raydcp?)")
    return size


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 CPU view of ``t``'s element bytes (copies only if ``t`` is not contiguous or on a device)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def tensor_from_bytes(buf: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor viewing ``buf`` (bytes-like or uint8 tensor) as ``dtype`` with ``shape`` (no copy)."""
    import torch

    if isinstance(buf, torch.Tensor):
        raw = buf
    else:
        view = memoryview(buf)
        if len(view) == 0:
            raw = torch.empty(0, dtype=torch.uint8)
        else:
            with warnings.catch_warnings():  # read-only buffers (object store) are only read from here
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(np.frombuffer(view, dtype=np.uint8))
    return raw.view(dtype_from_name(dtype)).reshape(shape)


def checksum(data: Any) -> int:
    """CRC32C (hardware accelerated where the CPU has it) of a bytes-like or uint8 tensor."""
    if _is_tensor(data):
        data = data.numpy() if data.numel() else b""
    return _crc32c.crc32c(data)


def block_checksums(data: Any, block: int) -> tuple[int, ...]:
    """CRC32C of each ``block``-byte block of a buffer larger than one block (empty otherwise)."""
    if _is_tensor(data):
        data = data.numpy()
    view = memoryview(data).cast("B")
    if len(view) <= block:
        return ()
    return tuple(_crc32c.crc32c(view[i:i + block]) for i in range(0, len(view), block))


def checksums(data: Any, block: int) -> tuple[int, tuple[int, ...]]:
    """``(checksum(data), block_checksums(data, block))`` in one pass over the bytes.

    The block CRCs are computed first and the whole buffer's CRC is combined from them
    (:func:`combine_block_checksums`), so each byte is read once.
    """
    blocks = block_checksums(data, block)
    if not blocks:
        return checksum(data), ()
    n = data.numel() if _is_tensor(data) else memoryview(data).nbytes
    return combine_block_checksums(blocks, n, block), blocks


# ---- CRC combination -------------------------------------------------------------------------
# CRC32C is linear over GF(2): crc(A || B) = crc(A) * x^(8 |B|) mod P  xor  crc(B), with the
# pre- and post-inversion of the standard CRC cancelling out (the method of zlib's crc32_combine).
# Polynomials are kept bit-reflected, as the CRC itself is.

_POLY = 0x82F63B78  # Castagnoli, reflected


def _multmodp(a: int, b: int) -> int:
    """a * b mod P (reflected: bit 31 is x^0)."""
    m, p = 1 << 31, 0
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table  # table[k] = x^(2^k) mod P


_X2N = _x2n_table()


@functools.lru_cache(maxsize=64)
def _shift_operator(nbytes: int) -> int:
    """x^(8 * nbytes) mod P: multiplying a CRC by it appends ``nbytes`` bytes' worth of zeros."""
    p, k, n = 1 << 31, 3, nbytes  # 1 = x^0; 8 * nbytes = nbytes << 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32C of ``A + B`` from ``crc1`` of A, ``crc2`` of B and B's length."""
    if len2 <= 0:
        return crc1
    return _multmodp(_shift_operator(len2), crc1) ^ crc2


def combine_block_checksums(blocks: Sequence[int], nbytes: int, block: int) -> int:
    """The CRC32C of a whole buffer of ``nbytes`` from the CRCs of its ``block``-byte blocks (the last shorter)."""
    if not blocks:
        return _crc32c.crc32c(b"")
    last = nbytes - (len(blocks) - 1) * block
    if not 0 < last <= block:
        raise ValueError(f"{len(blocks)} blocks of {block} bytes do not make {nbytes} bytes")
    op = _shift_operator(block)
    crc = blocks[0]
    for b in blocks[1:-1]:
        crc = _multmodp(op, crc) ^ b
    return crc if len(blocks) == 1 else crc32c_combine(crc, blocks[-1], last)


# ---- compression of pieces (the codecs: raydcp.metadata.COMPRESSIONS) --------------------------
@functools.lru_cache(maxsize=None)
def _codec(name: str):
    import pyarrow as pa  # here, not at import: `raydcp --help` and uncompressed paths do not need it

    return pa.Codec(name)


def check_compression(name: Any) -> None:
    """Raise CheckpointError unless ``name`` is None or a codec this raydcp can write and read."""
    if name is None:
        return
    if name not in COMPRESSIONS:
        raise CheckpointError(f"compression {name!r} is not one of {', '.join(map(repr, COMPRESSIONS))} (or None)")
    import pyarrow as pa

    if not pa.Codec.is_available(name):
        raise CheckpointError(f"compression {name!r} is not available in this pyarrow build ({pa.__version__}); "
                              "choose another codec or None")


def compress(name: str, data: Any) -> memoryview:
    """``data`` (a bytes-like or uint8 tensor) compressed with codec ``name``, as one frame that
    :func:`decompress` reads back alone. Releases the GIL while it compresses."""
    if _is_tensor(data):
        data = data.numpy()
    return _bytes_of(_codec(name).compress(data))


def _bytes_of(buf) -> memoryview:
    """A flat unsigned-byte view of exactly a pyarrow Buffer's ``size`` bytes (the Buffer's own
    memoryview may report its capacity as its length)."""
    return memoryview(np.frombuffer(buf, np.uint8, count=buf.size))


def decompress(name: str, data: Any, nbytes: int) -> memoryview:
    """The ``nbytes`` bytes a frame of codec ``name`` holds. Raises ValueError if ``data`` is not
    such a frame or does not hold exactly ``nbytes`` bytes (the caller names the piece)."""
    try:
        out = _bytes_of(_codec(name).decompress(data, decompressed_size=nbytes))
    except (OSError, ValueError) as exc:  # pyarrow reports a corrupt frame as an OSError
        raise ValueError(" ".join(str(exc).split()) or type(exc).__name__) from None
    if out.nbytes != nbytes:
        raise ValueError(f"it holds {out.nbytes} bytes")
    return out


# ---- plain values: tagged JSON, never pickle -------------------------------------------------

_PLAIN_SCALARS = (type(None), bool, int, float, str, bytes)


def is_plain_value(v: Any) -> bool:
    if isinstance(v, _PLAIN_SCALARS):
        return True
    if isinstance(v, (list, tuple)):
        return all(is_plain_value(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, (str, int, bool, type(None), float)) and is_plain_value(x) for k, x in v.items())
    return False


def encode_value(v: Any) -> Any:
    """A JSON-compatible form of a plain value that :func:`decode_value` inverts exactly."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"__float__": repr(v)}
    if isinstance(v, bytes):
        return {"__bytes__": base64.b64encode(v).decode("ascii")}
    if isinstance(v, tuple):
        return {"__tuple__": [encode_value(x) for x in v]}
    if isinstance(v, list):
        return [encode_value(x) for x in v]
    if isinstance(v, dict):
        return {"__dict__": [[encode_value(k), encode_value(x)] for k, x in v.items()]}
    raise CheckpointError(f"value of type {type(v).__name__} is not a plain value")


def decode_value(v: Any) -> Any:
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    if isinstance(v, dict):
        if len(v) != 1:
            raise CheckpointError(f"malformed plain value in metadata: {str(v)[:80]}")
        (tag, body), = v.items()
        if tag == "__float__":
            return float(body)
        if tag == "__bytes__":
            return base64.b64decode(body)
        if tag == "__tuple__":
            return tuple(decode_value(x) for x in body)
        if tag == "__dict__":
            return {decode_value(k): decode_value(x) for k, x in body}
        raise CheckpointError(f"malformed plain value in metadata: unknown tag {tag!r}")
    return v
