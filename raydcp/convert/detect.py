"""Recognise the checkpoint formats next to raydcp's, where a raydcp checkpoint was expected.

Pure over fsspec (no torch): it lists a directory and reads at most a few hundred bytes of one
file. :func:`foreign_format` says what a path holds when it is not a raydcp checkpoint:

- ``torch-dcp``: a torch.distributed.checkpoint directory (``.metadata`` and ``__R_I.distcp`` files);
- ``safetensors``: a ``.safetensors`` file, or a directory of them (with or without
  ``model.safetensors.index.json``, as Hugging Face writes them);
- ``torch-save``: a ``torch.save`` file (zip archive with a ``data.pkl``, or the legacy pickle);
- ``raydcp-root``: a directory whose subdirectories are committed raydcp checkpoints.

:func:`foreign_format_hint` turns that into the sentence the "no raydcp checkpoint here" error
carries: what the path is and the command that converts it. Detection never raises.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["ForeignFormat", "foreign_format", "foreign_format_hint", "hint_for_url", "sniff_file", "with_format_hint"]

_METADATA = "raydcp.meta"
_DCP_METADATA = ".metadata"
_ST_INDEX = "model.safetensors.index.json"
_TORCH_LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")  # torch.serialization's MAGIC_NUMBER
_HEAD = 512


@dataclass(frozen=True)
class ForeignFormat:
    kind: str    # "torch-dcp", "safetensors", "torch-save" or "raydcp-root"
    detail: str  # what was seen, e.g. ".metadata and 4 .distcp files"


def _name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _head(fs, path: str, n: int = _HEAD) -> bytes:
    with fs.open(path, "rb") as f:
        return f.read(n)


def sniff_file(fs, path: str) -> str | None:
    """``"safetensors"``, ``"torch-save"`` or None, from the first bytes of the file ``path``."""
    try:
        head = _head(fs, path)
    except Exception:
        return None
    if len(head) >= 10:
        (n,) = struct.unpack("<Q", head[:8])
        if 2 <= n <= 100 << 20 and head[8:9] == b"{":  # an 8-byte header length, then a JSON header
            return "safetensors"
    if head.startswith(b"PK\x03\x04") and b"data.pkl" in head:  # torch.save's zip: <name>/data.pkl first
        return "torch-save"
    if head[:1] == b"\x80" and _TORCH_LEGACY_MAGIC in head[:32]:  # torch.save(_use_new_zipfile_serialization=False)
        return "torch-save"
    return None


def _directory(fs, path: str) -> ForeignFormat | None:
    entries = fs.ls(path, detail=True)
    names = {_name(e["name"]): e for e in entries}
    distcp = [n for n in names if n.endswith(".distcp")]
    if _DCP_METADATA in names or distcp:
        seen = " and ".join(x for x in ((_DCP_METADATA if _DCP_METADATA in names else ""),
                                        (f"{len(distcp)} .distcp file{'s' if len(distcp) != 1 else ''}"
                                         if distcp else "")) if x)
        return ForeignFormat("torch-dcp", seen)
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    if _ST_INDEX in names or shards:
        seen = f"{len(shards)} .safetensors file{'s' if len(shards) != 1 else ''}"
        return ForeignFormat("safetensors", seen + (f" and {_ST_INDEX}" if _ST_INDEX in names else ""))
    files = sorted(n for n, e in names.items() if e.get("type") == "file")
    for n in files:
        if n.endswith((".pt", ".pth", ".bin", ".ckpt")) and sniff_file(fs, names[n]["name"]) == "torch-save":
            return ForeignFormat("torch-save", f"the torch.save file {n}")
    subdirs = [e["name"] for e in entries if e.get("type") == "directory"]
    committed = [_name(d) for d in subdirs[:1000] if fs.exists(f"{d.rstrip('/')}/{_METADATA}")]
    if committed:
        return ForeignFormat("raydcp-root", f"{len(committed)} committed checkpoint(s), e.g. {sorted(committed)[0]}")
    return None


def foreign_format(fs, path: str) -> ForeignFormat | None:
    """What ``path`` on ``fs`` holds, when it is one of the formats above; None otherwise or on any error."""
    try:
        if fs.isfile(path):
            kind = sniff_file(fs, path)
            return ForeignFormat(kind, f"the file {_name(path)}") if kind else None
        if fs.isdir(path):
            return _directory(fs, path)
    except Exception:  # detection only adds a hint to an error already being raised
        return None
    return None


def foreign_format_hint(fs, path: str, url: str) -> str | None:
    """The error message for a path that holds another format instead of a raydcp checkpoint, or None."""
    found = foreign_format(fs, path)
    if found is None:
        return None
    if found.kind == "torch-dcp":
        return (f"{url} is a torch.distributed.checkpoint (DCP) checkpoint ({found.detail}), not a raydcp "
                f"checkpoint: convert it with `raydcp convert {url} DST --from torch-dcp`")
    if found.kind == "safetensors":
        what = "file" if found.detail.startswith("the file ") else "folder"
        return (f"{url} is a safetensors {what} ({found.detail}), not a raydcp checkpoint: convert it with "
                f"`raydcp convert {url} DST --from safetensors`")
    if found.kind == "torch-save":
        if found.detail.startswith("the file "):
            return (f"{url} is a torch.save file, not a raydcp checkpoint: convert it with "
                    f"`raydcp convert {url} DST --from torch-save`")
        name = found.detail.rsplit(" ", 1)[-1]
        return (f"{url} holds a torch.save file ({name}), not a raydcp checkpoint: convert it with "
                f"`raydcp convert {url.rstrip('/')}/{name} DST --from torch-save`")
    return (f"{url} is a directory of checkpoints ({found.detail}), not one checkpoint: pass one of them "
            f"(`raydcp ls {url}` lists them)")



def hint_for_url(url, storage_options: dict | None = None) -> str | None:
    """:func:`foreign_format_hint` for a local path or fsspec URL (None where it cannot be opened)."""
    import os

    from ..storage.paths import location_to_fs

    try:
        fs, path = location_to_fs(url, storage_options)
    except Exception:
        return None
    return foreign_format_hint(fs, path, os.fspath(url))


# The reasons storage gives for a path without a raydcp checkpoint where another format may be there.
_MAYBE_FOREIGN = ("file", "empty")


def with_format_hint(exc: BaseException, storage_options: dict | None = None) -> BaseException:
    """``exc``, or where it is a :class:`~raydcp.errors.CheckpointNotFoundError` for a path that holds
    another format (torch DCP, safetensors, torch.save), the same error saying what the path is and
    the command that converts it (``reason="other-format"``).

    The storage layer knows only raydcp's own files; the layers that open checkpoints for a user
    (the public calls, the CLI) name the formats next to raydcp's with this."""
    from ..errors import CheckpointNotFoundError

    if not isinstance(exc, CheckpointNotFoundError) or exc.reason not in _MAYBE_FOREIGN or not exc.path:
        return exc
    hint = hint_for_url(exc.path, storage_options)
    return exc if hint is None else exc.copy(hint, reason="other-format")
