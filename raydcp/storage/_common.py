"""Shared helpers of the storage layer: opening a filesystem, naming, and error translation.

Every exception that escapes the storage layer is a :class:`CheckpointError` whose message names
the file or directory and says what to do next; the helpers here turn fsspec, OS and cloud-client
exceptions into such messages in one place.
"""
from __future__ import annotations

import datetime as _dt
import errno
import os
from contextlib import contextmanager
from typing import Any, Iterator

from fsspec.implementations.local import LocalFileSystem

from ..errors import CheckpointDamagedError, CheckpointError, StorageError
from .paths import has_protocol, location_to_fs

METADATA_NAME = "raydcp.meta"

_CHECK_ACCESS = (
    "check that the path is right, that the storage is reachable and that storage_options "
    "carry valid credentials"
)


def open_fs(location: str | os.PathLike, storage_options: dict | None, what: str):
    """Resolve ``location`` to ``(fs, path, url)``.

    ``url`` is the normalized form shown in messages and returned to callers: an absolute local
    path when ``location`` was a plain local path, otherwise ``protocol://path``. Either form can
    be passed back in as a location.
    """
    if isinstance(location, os.PathLike):
        location = os.fspath(location)
    if not isinstance(location, str) or not location:
        raise CheckpointError(f"{what} must be a non-empty path or fsspec URL, got {location!r}")
    if storage_options is not None and not isinstance(storage_options, dict):
        raise CheckpointError(
            f"storage_options for {location} must be a dict of fsspec filesystem options, "
            f"got {type(storage_options).__name__}"
        )
    try:
        fs, path = location_to_fs(location, storage_options)
    except ImportError as exc:
        raise CheckpointError(
            f"cannot open {location}: {exc}. Install the fsspec backend for this protocol "
            "(for s3:// that is `pip install raydcp[s3]`)"
        ) from exc
    except Exception as exc:
        raise CheckpointError(
            f"cannot open {location}: {describe(exc)}; check the URL's protocol and storage_options "
            "(a local path with '://' in it: start it with ./ or /)"
        ) from exc
    path = path.rstrip("/") or path
    return fs, path, to_url(fs, path, plain_local=is_plain_local(location, fs))


def is_local(fs) -> bool:
    return isinstance(fs, LocalFileSystem)


def is_plain_local(location: str, fs) -> bool:
    return is_local(fs) and not has_protocol(location)


def to_url(fs, path: str, *, plain_local: bool) -> str:
    if plain_local:
        return os.path.normpath(path)
    return fs.unstrip_protocol(path)


def check_name(name: str, url: str) -> str:
    """Validate a file name relative to a checkpoint directory (``data/<save_id>/r0-f0.bin``)."""
    if isinstance(name, str) and name and not name.startswith("/") and "\\" not in name:
        if all(part not in ("", ".", "..") for part in name.split("/")):
            return name
    raise CheckpointDamagedError(
        f"invalid file name {name!r} in checkpoint {url}: names are relative paths such as "
        "'data/<save_id>/r00000-f000.bin', without empty parts, '.', '..' or backslashes"
    )


def forget(fs, path: str) -> None:
    """Drop cached listings of ``path``, its parents and everything under it.

    Checkpoint directories are written by many processes, so a listing cached by this process
    (s3fs, gcsfs keep one per filesystem instance) may miss files another process wrote since.
    """
    fs.invalidate_cache(path)
    cache = getattr(fs, "dircache", None)
    if cache:
        prefix = path.rstrip("/") + "/"
        for key in [k for k in list(cache) if isinstance(k, str) and k.startswith(prefix)]:
            cache.pop(key, None)


def describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_TRANSIENT_ERRNOS = {errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED,
                     errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EBUSY}
_TRANSIENT_WORDS = ("timeout", "timed out", "throttl", "slowdown", "slow down", "connection", "temporarily",
                    "serviceunavailable", "service unavailable", "internalerror", "too many requests")


def is_transient(exc: BaseException) -> bool:
    """Whether a storage failure may go away by itself (network, throttling), so that retrying helps."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno in _TRANSIENT_ERRNOS
    text = f"{type(exc).__name__} {exc}".lower()
    return any(w in text for w in _TRANSIENT_WORDS)


@contextmanager
def translating(action: str, target: str) -> Iterator[None]:
    """Turn any non-raydcp exception raised inside into a CheckpointError about ``target``."""
    try:
        yield
    except CheckpointError:
        raise
    except FileNotFoundError as exc:
        raise StorageError(f"could not {action} {target}: it does not exist ({describe(exc)})", path=target) from exc
    except PermissionError as exc:
        raise StorageError(
            f"could not {action} {target}: permission denied ({describe(exc)}); check the "
            "permissions of the directory or the credentials in storage_options", path=target
        ) from exc
    except Exception as exc:
        raise StorageError(f"could not {action} {target}: {describe(exc)}; {_CHECK_ACCESS}",
                           retriable=is_transient(exc), path=target) from exc


def missing_file_error(file_url: str, checkpoint_url: str) -> CheckpointError:
    return CheckpointDamagedError(
        f"checkpoint file {file_url} is missing: the checkpoint at {checkpoint_url} is damaged or "
        "was partly deleted; restore the file from a copy or load another checkpoint", file=file_url
    )


def truncated_file_error(file_url: str, size: int, needed_end: int, checkpoint_url: str) -> CheckpointError:
    return CheckpointDamagedError(
        f"checkpoint file {file_url} is truncated: it holds {size} bytes but bytes up to "
        f"{needed_end} are needed; the checkpoint at {checkpoint_url} is damaged (an interrupted "
        "copy or upload?); restore the file from a copy or load another checkpoint",
        file=file_url, byte_range=(max(size, 0), needed_end)
    )


_TIME_KEYS = ("mtime", "LastModified", "last_modified", "created", "updated", "timeCreated", "ctime")


def info_timestamp(info: dict[str, Any]) -> float | None:
    """Seconds since the epoch at which a file was last written, from an fsspec ``info`` dict.

    Local files report ``mtime``, s3 ``LastModified``, memory ``created``, gcs ``updated``.
    """
    for key in _TIME_KEYS:
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, _dt.datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=_dt.timezone.utc)
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                parsed = _dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
            if parsed.tzinfo is None:
                parsed = parsed.replace(tzinfo=_dt.timezone.utc)
            return parsed.timestamp()
    return None
