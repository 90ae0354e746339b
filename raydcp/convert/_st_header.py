"""The header of a safetensors file, checked as strictly as the safetensors library checks it.

Layout: 8 bytes (little-endian u64) giving the header's length N, N bytes of UTF-8 JSON, then the
data. The JSON is one object: ``"__metadata__"`` (optional, null or string -> string) and one
entry per tensor, ``{"dtype": NAME, "shape": [int, ...], "data_offsets": [begin, end]}`` (byte
offsets into the data; other members are ignored, as the library ignores them).

:func:`parse_header` refuses everything the library refuses (the rules of its Rust
``Metadata::validate`` and of the serde JSON reader behind it), and a little more that is
ambiguous or that no tensor could hold:

1. the header length fits the file and is at most 100,000,000 bytes;
2. the header is UTF-8 JSON as the library reads it: no lone surrogate (``"\\ud800"``), no
   ``NaN`` / ``Infinity``, at most 128 levels of nesting, and no key twice in one object (the
   library keeps the last of two tensor entries, raydcp refuses the file: it is ambiguous);
3. every dimension and offset is a JSON integer >= 0 (``4.7``, ``1e30``, ``2.0``, ``true``
   are not), ``data_offsets`` has exactly two, the dtype is one safetensors defines;
4. the tensors' byte ranges, sorted, tile the data exactly: the first begins at 0, each begins
   where the previous ends, the last ends at the file's end (no gap, no overlap, nothing after);
5. each range holds exactly the tensor's bytes, and the product of the tensor's non-zero
   dimensions times its element size is below 2**63 (numpy and torch index with int64), so a
   shape such as ``[0, 2**62]`` of float32 is refused even though it has no elements.

Every refusal is a :class:`~raydcp.errors.CheckpointDamagedError` of one line naming the file and,
where there is one, the tensor.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from ..errors import CheckpointDamagedError

__all__ = ["MAX_HEADER_BYTES", "TensorEntry", "parse_header", "strict_json"]

MAX_HEADER_BYTES = 100_000_000  # the library's limit on the header's length
_MAX_DEPTH = 128  # the library's JSON reader refuses deeper nesting
_INT64_MAX = (1 << 63) - 1

# every dtype safetensors defines, with its size in bits
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
              "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64,
              "U64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the header: its name, safetensors dtype, shape and byte range in the data."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class _Refused(ValueError):
    """A problem found while reading the JSON (turned into the file's error by the caller)."""


def _no_constant(name: str):
    raise _Refused(f"{name} is not a JSON number")


def _integer(text: str):
    # "-0" is a float to the library's reader (a negative number that is not an i64 below 0)
    return -0.0 if text == "-0" else int(text)


def _unique(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out


def strict_json(text: str):
    """``text`` read as the library's JSON reader reads it (rule 2 above); ValueError otherwise."""
    try:
        value = json.loads(text, object_pairs_hook=_unique, parse_constant=_no_constant, parse_int=_integer)
    except RecursionError:
        raise _Refused(f"nested more than {_MAX_DEPTH} levels deep") from None
    _check_tree(value)
    return value


def _check_tree(value) -> None:
    """Nesting depth and lone surrogates, walked without recursion."""
    todo = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, str):
            _check_text(item)
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth > _MAX_DEPTH:
            raise _Refused(f"nested more than {_MAX_DEPTH} levels deep")
        if isinstance(item, dict):
            for key, child in item.items():
                _check_text(key)
                todo.append((child, depth + 1))
        else:
            todo.extend((child, depth + 1) for child in item)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _Refused(f"the string {text!r} holds a lone UTF-16 surrogate, which is not Unicode text") from None


def parse_header(data, where: str) -> tuple[list[TensorEntry], dict[str, str], int]:
    """``(tensors in data order, __metadata__, offset of the data)`` of the safetensors file
    ``data`` (its whole content, bytes-like); ``where`` names the file in messages."""

    def refuse(problem: str, key: str | None = None) -> CheckpointDamagedError:
        return CheckpointDamagedError(f"{where}: damaged or not a safetensors file: {problem}", file=where, key=key)

    size = len(data)
    if size < 8:
        raise refuse(f"{size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > MAX_HEADER_BYTES:
        raise refuse(f"a header length of {n} bytes, more than the format's limit of {MAX_HEADER_BYTES}")
    if 8 + n > size:
        raise refuse(f"a header length of {n} bytes, past the end of the {size}-byte file")
    try:
        text = bytes(data[8:8 + n]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise refuse(f"the header is not UTF-8 ({exc.reason} at byte {8 + exc.start})") from None
    try:
        header = strict_json(text)
    except ValueError as exc:
        raise refuse(f"the header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise refuse(f"the header is a JSON {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise refuse("__metadata__ is not an object of strings")
    body = size - 8 - n
    entries = [_entry(key, value, refuse) for key, value in header.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    at = 0
    for e in entries:
        if e.begin != at or e.end < e.begin:
            problem = ("overlaps the tensor before it" if e.begin < at else
                       "leaves a gap after the tensor before it" if e.begin > at else "ends before it begins")
            raise refuse(f"tensor {e.name!r}: data_offsets [{e.begin}, {e.end}] {problem} (expected to begin "
                         f"at byte {at} of the data)", e.name)
        bits = DTYPE_BITS[e.dtype]
        extent = bits
        for d in e.shape:
            extent *= d or 1
        if extent > _INT64_MAX * 8:
            raise refuse(f"tensor {e.name!r}: shape {list(e.shape)} of {e.dtype} spans more than 2**63 bytes", e.name)
        nbits = bits
        for d in e.shape:
            nbits *= d
        if nbits % 8 or e.end - e.begin != nbits // 8:
            need = nbits // 8 if nbits % 8 == 0 else nbits / 8
            raise refuse(f"tensor {e.name!r}: {e.dtype}{list(e.shape)} needs {need} bytes, data_offsets "
                         f"[{e.begin}, {e.end}] hold {e.end - e.begin}", e.name)
        at = e.end
    if at != body:
        raise refuse(f"the tensors' data ends at byte {at} of the data but the file holds {body} bytes of data "
                     "after its header (truncated, or bytes no tensor covers)")
    return entries, meta, 8 + n


def _entry(key: str, value, refuse) -> TensorEntry:
    if not isinstance(value, dict):
        raise refuse(f"tensor {key!r}: its entry is a JSON {type(value).__name__}, not an object", key)
    missing = [m for m in ("dtype", "shape", "data_offsets") if m not in value]
    if missing:
        raise refuse(f"tensor {key!r}: no {' and no '.join(missing)} in its entry", key)
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise refuse(f"tensor {key!r}: unknown dtype {dtype!r} (safetensors defines {', '.join(DTYPE_BITS)})", key)
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise refuse(f"tensor {key!r}: shape {_show(shape)} is not a list of integers >= 0", key)
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise refuse(f"tensor {key!r}: data_offsets {_show(offsets)} are not two integers >= 0", key)
    return TensorEntry(key, dtype, tuple(shape), offsets[0], offsets[1])


def _is_count(x) -> bool:
    return type(x) is int and 0 <= x < (1 << 64)  # JSON integers only: not 2.0, 1e30 or true


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."
