"""Which strings are local paths and which are fsspec URLs, and the filesystem each one names.

The rules (every place raydcp takes a path goes through :func:`location_to_fs`):

1. A string that does not start with a protocol is a plain local path, and every character of it
   is literal: ``/ckpts/run::v2``, ``run#3``, ``a?b``, ``100%``, spaces and any unicode are the
   directory's name. ``~`` is expanded and a relative path is taken from the working directory.
2. A string starts with a protocol when it starts with ``NAME://`` (``s3://bucket/x``,
   ``file:///ckpts/x``, ``memory://x``), or with ``NAME::`` where NAME is a protocol fsspec knows
   (``simplecache::s3://bucket/x``).
3. ``::`` chains filesystems (fsspec's URL chaining) only after a filesystem that wraps another
   (the caches, ``dir``, ``zip``, ``tar``, ``reference``: ``simplecache::s3://bucket/x``). After
   any other protocol it is a character of the path, as in a plain path: ``file:///ckpts/run::v2``
   is the directory ``/ckpts/run::v2``, ``s3://bucket/run::v2`` the key prefix ``run::v2``. (fsspec
   itself would read those as a chain and silently drop everything after the ``::``.)

Protocols are fsspec's: ``#`` and ``?`` in a URL mean what its filesystem says (s3fs reads
``?versionId=``), and nothing is percent-decoded.
"""
from __future__ import annotations

import inspect
import os
import re
from typing import Any

import fsspec
from fsspec.implementations.local import make_path_posix

try:  # the marker class of the filesystems that wrap another (fsspec 2025.x and later)
    from fsspec.implementations.chained import ChainedFileSystem as _Chained
except ImportError:
    _Chained = None

__all__ = ["has_protocol", "location_to_fs"]

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-_]+://")  # two letters at least: "C://" is a Windows drive


def has_protocol(location: str) -> bool:
    """Whether ``location`` is a URL (rule 2 above) rather than a plain local path."""
    if _URL.match(location):
        return True
    head, sep, _ = location.partition("::")
    return bool(sep) and head in fsspec.available_protocols()


def location_to_fs(location: str | os.PathLike, storage_options: dict | None = None) -> tuple[Any, str]:
    """``(filesystem, path on it)`` for a local path or fsspec URL, by the rules above.

    Raises what fsspec raises for a URL it cannot open (unknown protocol, missing backend, bad
    options); callers turn that into a message naming the location.
    """
    location = os.fspath(location)
    options = dict(storage_options or {})
    if not has_protocol(location):
        return fsspec.filesystem("file", **options), make_path_posix(location)
    if "::" not in location:
        return fsspec.core.url_to_fs(location, **options)
    head = location.split("::", 1)[0]
    protocol = head if head in fsspec.available_protocols() else fsspec.core.split_protocol(head)[0]
    cls = fsspec.get_filesystem_class(protocol)
    if _wraps_another(cls):
        return fsspec.core.url_to_fs(location, **options)
    # one filesystem, '::' literal: what fsspec.core.url_to_fs does for a URL without a chain
    kwargs = options.pop(protocol, {})
    kwargs.update(options)
    kwargs = {**cls._get_kwargs_from_urls(location), **kwargs}
    path = cls._strip_protocol(location)
    if cls.root_marker and not path.startswith(cls.root_marker):
        path = cls.root_marker + path  # memory:// leaves it off where a path holds '::'
    return fsspec.filesystem(protocol, **kwargs), path


def _wraps_another(cls) -> bool:
    """Whether a filesystem class is one a chain can put over another (it takes a target)."""
    if _Chained is not None and issubclass(cls, _Chained):
        return True
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False
    return "target_protocol" in params
