"""Reading torch DCP's ``.metadata`` pickle without running anything it could smuggle in.

torch.distributed.checkpoint stores its metadata as a pickle, and unpickling calls whatever
global the file names. :class:`DCPMetadataUnpickler` admits only the types DCP's own metadata is
made of (``torch.distributed.checkpoint.metadata``, the filesystem writer's ``_StorageInfo``,
``torch.Size``, dtypes, layouts, paths, ``OrderedDict``) and refuses any other global with a
CheckpointError naming it, before it is ever called. :func:`read_dcp_metadata` then checks
that what came out has the shape DCP's metadata has.
"""
from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from ..errors import CheckpointError

__all__ = ["DCPMetadataUnpickler", "load_dcp_metadata", "read_dcp_metadata", "DCP_METADATA_NAME"]

DCP_METADATA_NAME = ".metadata"

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# StorageMeta.checkpoint_id may be a concrete path of the saving machine's OS, which cannot be
# instantiated on another OS: read it as the pure path of the same flavour.
_PATHS = {"Path": "PurePosixPath", "PosixPath": "PurePosixPath", "WindowsPath": "PureWindowsPath"}
_ALLOWED: dict[str, frozenset[str]] = {
    _METADATA_MODULE: frozenset({
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "_MEM_FORMAT_ENCODING", "MetadataIndex", "StorageMeta",
    }),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}),  # and every torch.dtype, see find_class
    "torch.serialization": frozenset({"_get_layout"}),  # maps a layout's name to torch.layout
    "collections": frozenset({"OrderedDict"}),
    "pathlib": frozenset({"PurePath", "PurePosixPath", "PureWindowsPath"}),  # and see _PATHS
    "builtins": frozenset({"set", "frozenset"}),
}


class DCPMetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only DCP metadata types; anything else is a CheckpointError."""

    def __init__(self, file, source: str = DCP_METADATA_NAME):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "pathlib" and name in _PATHS:
            return super().find_class(module, _PATHS[name])
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self.source}: refusing to unpickle the global {module}.{name}: a torch DCP metadata "
            "file holds only DCP's own metadata types, so this file is damaged or malicious and "
            "nothing in it was run"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.source}: unexpected persistent id in a torch DCP metadata file")


def load_dcp_metadata(data: bytes, source: str = DCP_METADATA_NAME):
    """Unpickle DCP metadata bytes with :class:`DCPMetadataUnpickler` and check their structure."""
    try:
        md = DCPMetadataUnpickler(io.BytesIO(data), source).load()
    except CheckpointError:
        raise
    except RecursionError:
        raise CheckpointError(f"{source}: nested too deeply to be torch DCP metadata") from None
    except Exception as exc:
        raise CheckpointError(
            f"{source}: not a readable torch DCP metadata file ({type(exc).__name__}: {exc})"
        ) from None
    _check_structure(md, source)
    return md


def read_dcp_metadata(storage, source: str | None = None):
    """The checked DCP metadata of the DCP checkpoint directory ``storage`` (a CheckpointStorage)."""
    source = source or storage.file_url(DCP_METADATA_NAME)
    if not storage.exists(DCP_METADATA_NAME):
        raise CheckpointError(
            f"no torch DCP checkpoint at {storage.url}: {DCP_METADATA_NAME} is missing (the save did "
            "not finish, the path is wrong, or it was saved without collectives, one metadata file per rank)"
        )
    return load_dcp_metadata(storage.read_file(DCP_METADATA_NAME), source)


def _check_structure(md: Any, source: str) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties, TensorStorageMetadata)

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{source}: malformed torch DCP metadata: {what}")

    if not isinstance(md, Metadata):
        raise bad(f"the pickle holds a {type(md).__name__}, not a Metadata")
    if not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise bad("state_dict_metadata is not a dict")
    if not isinstance(getattr(md, "storage_data", None), dict):
        raise bad("storage_data is not a dict (was it written by FileSystemWriter or FsspecWriter?)")
    for fqn, entry in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise bad(f"key {fqn!r} is not a string")
        if isinstance(entry, TensorStorageMetadata):
            if not (isinstance(entry.properties, TensorProperties) and isinstance(entry.properties.dtype, torch.dtype)):
                raise bad(f"{fqn}: tensor properties without a dtype")
            if not isinstance(entry.size, torch.Size) or not isinstance(entry.chunks, list):
                raise bad(f"{fqn}: tensor size or chunks of the wrong type")
            for ch in entry.chunks:
                if not (isinstance(ch, ChunkStorageMetadata) and _dims(ch.offsets, len(entry.size))
                        and _dims(ch.sizes, len(entry.size))):
                    raise bad(f"{fqn}: a chunk whose offsets or sizes do not match the tensor's {len(entry.size)} dims")
        elif not isinstance(entry, BytesStorageMetadata):
            raise bad(f"{fqn}: entry of type {type(entry).__name__}")
    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise bad("storage_data maps something other than MetadataIndex -> _StorageInfo")
        if not (isinstance(info.relative_path, str) and _nonneg_int(info.offset) and _nonneg_int(info.length)):
            raise bad(f"{index.fqn}: storage record with an invalid file, offset or length")


def _dims(values: Any, n: int) -> bool:
    return isinstance(values, (torch.Size, tuple, list)) and len(values) == n and all(_nonneg_int(v) for v in values)


def _nonneg_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
