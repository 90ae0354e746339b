"""Tuning options, read once at the API edge, and the ``RAYDCP_*`` environment overrides.

Options are frozen, keyword-only dataclasses validated when built (a bad value is a
:class:`~raydcp.errors.CheckpointError` naming the option). The environment variables below are
documented overrides, parsed here and nowhere else; an explicit keyword argument wins over them:

- ``RAYDCP_STAGING`` (``private`` | ``shm``): where ``async_save`` without a group stages
  (:class:`AsyncOptions.staging`);
- ``RAYDCP_MAX_STAGING_BYTES``: the staging cap per rank (:class:`AsyncOptions.max_staging_bytes`);
- ``RAYDCP_PERSIST_NICE``: how far the persisting process lowers its CPU priority
  (:class:`AsyncOptions.persist_nice`; 0 leaves it).

The options of one call, given to the public functions as ``options=`` (every rank of a group
passes the same):

- :class:`SaveOptions` (``raydcp.save``, ``raydcp.async_save``, ``ShardGroup.save``, the
  pipeline, ``raydcp reshard``, ``raydcp convert --from``): the largest data file a rank writes,
  the compression of the pieces and the write path's :class:`IOOptions`;
- :class:`LoadOptions` (``raydcp.load``): the read path's :class:`IOOptions`, and whether a load
  that fails leaves the state as it was (``atomic``).

:class:`IOOptions` holds the write and read path's sizes and thread counts (the defaults,
:data:`DEFAULT_IO`, suit most storage). The API layer (:mod:`raydcp.api`) reads them once per
call and the engine passes them down as parameters; nothing below reads a module constant.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Mapping

from .errors import CheckpointError
from .metadata import BLOCK_BYTES, COMPRESSIONS
from .planner.save import ALIGN

__all__ = ["AsyncOptions", "IOOptions", "SaveOptions", "LoadOptions", "DEFAULT_IO", "DEFAULT_SAVE", "DEFAULT_LOAD",
           "STAGING_ENV", "MAX_STAGING_BYTES_ENV", "PERSIST_NICE_ENV", "STAGING_MODES", "MAX_FILE_BYTES"]

STAGING_ENV = "RAYDCP_STAGING"
MAX_STAGING_BYTES_ENV = "RAYDCP_MAX_STAGING_BYTES"
PERSIST_NICE_ENV = "RAYDCP_PERSIST_NICE"
STAGING_MODES = ("shm", "private")
MIN_STAGING_BYTES = 1 << 10


@dataclass(frozen=True, kw_only=True)
class AsyncOptions:
    """How ``async_save`` stages and persists.

    ``staging``: ``"private"`` (the trainer's own memory, read by the helper process),
    ``"shm"`` (shared memory), or None: private where this process allows it, else shm.
    ``max_staging_bytes``: cap on one rank's staging memory (None: unlimited); above it the
    state is staged and written in batches of whole files. ``persist_nice``: the nice value
    step the persisting process takes (19: lowest priority; 0: none).
    """

    staging: str | None = None
    max_staging_bytes: int | None = None
    persist_nice: int = 19

    def __post_init__(self) -> None:
        if self.staging is not None and self.staging not in STAGING_MODES:
            raise CheckpointError(f"{STAGING_ENV}={self.staging!r} is not one of {', '.join(STAGING_MODES)} (or unset)")
        cap = self.max_staging_bytes
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < MIN_STAGING_BYTES):
            raise CheckpointError(f"max_staging_bytes must be at least 1 KiB, got {cap}")
        if isinstance(self.persist_nice, bool) or not isinstance(self.persist_nice, int):
            raise CheckpointError(f"persist_nice must be an int, got {self.persist_nice!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **explicit) -> "AsyncOptions":
        """The options for one call: ``explicit`` keyword arguments (None: not given), else the
        ``RAYDCP_*`` overrides, else the defaults."""
        env = os.environ if env is None else env
        values: dict = {}
        staging = env.get(STAGING_ENV, "").strip().lower()
        if staging:
            values["staging"] = staging
        cap = env.get(MAX_STAGING_BYTES_ENV)
        if cap is not None and cap.strip():
            try:
                values["max_staging_bytes"] = int(cap)
            except ValueError:
                raise CheckpointError(f"{MAX_STAGING_BYTES_ENV}={cap!r} is not a number of bytes") from None
        nice = env.get(PERSIST_NICE_ENV)
        if nice is not None:
            try:
                values["persist_nice"] = int(nice)
            except ValueError:  # as before: an unreadable value keeps the default
                pass
        values.update({k: v for k, v in explicit.items() if v is not None})
        if "max_staging_bytes" in values and values["max_staging_bytes"] is not None:
            try:
                values["max_staging_bytes"] = int(values["max_staging_bytes"])
            except (TypeError, ValueError):
                raise CheckpointError(
                    f"max_staging_bytes must be a number of bytes, got {values['max_staging_bytes']!r}") from None
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class IOOptions:
    """Sizes and threads of the write and read paths (tuning; the defaults suit most storage).

    Writes: host pieces up to ``pack_max`` bytes are copied into shared buffers of up to
    ``pack_bytes`` (one write, no per-piece buffer); larger pieces are checksummed and written
    ``write_bytes`` at a time; ``write_threads`` files are written at once. Reads: chunks from
    ``read_pool_min`` bytes on are read and verified in ``read_threads`` threads,
    ``read_task_bytes`` per task; smaller chunks of one file are read in batches of up to
    ``read_batch_bytes``. From storage where each request is a round trip (S3 and the like),
    chunks under ``read_task_bytes`` are batched too (touching ones in one range request).
    """

    pack_max: int = 64 << 10
    pack_bytes: int = 4 << 20
    write_bytes: int = 4 * BLOCK_BYTES
    write_threads: int = 8
    read_pool_min: int = 256 << 10
    read_task_bytes: int = 8 << 20
    read_threads: int = 4
    read_batch_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        for name in ("pack_max", "pack_bytes", "write_bytes", "write_threads", "read_pool_min", "read_task_bytes",
                     "read_threads", "read_batch_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise CheckpointError(f"IOOptions.{name} must be an int >= 1, got {v!r}")
        for name in ("write_bytes", "read_task_bytes"):
            if getattr(self, name) % BLOCK_BYTES:
                raise CheckpointError(f"IOOptions.{name} must be a multiple of the checksum block "
                                      f"({BLOCK_BYTES} bytes), got {getattr(self, name)}")
        if self.pack_max > self.pack_bytes:
            raise CheckpointError(f"IOOptions.pack_max ({self.pack_max}) must not exceed pack_bytes ({self.pack_bytes})")

    def replace(self, **changes) -> "IOOptions":
        return replace(self, **changes)


DEFAULT_IO = IOOptions()


MAX_FILE_BYTES = 256 << 20
"""The default cap on one data file (:attr:`SaveOptions.max_file_bytes`)."""


def _check_size(owner: str, name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CheckpointError(f"{owner}.{name} must be an int >= {minimum}, got {value!r}")


def _check_io(owner: str, io) -> None:
    if not isinstance(io, IOOptions):
        raise CheckpointError(f"{owner}.io must be a raydcp.options.IOOptions, got {type(io).__name__}")


def _leaving(leaving, survivors: bool) -> dict[str, tuple[int, ...]]:
    """SaveOptions.leaving as ``{node id: sorted ranks}``, checked."""
    if not survivors:
        raise CheckpointError("SaveOptions.leaving names ranks a survivors save goes on without: it needs "
                              "survivors=True")
    if not isinstance(leaving, Mapping):
        raise CheckpointError(f"SaveOptions.leaving must map node ids to lists of ranks (a preemption notice's "
                              f"preempted_node_to_ranks), got {type(leaving).__name__}")
    out = {}
    for node, ranks in leaving.items():
        try:
            ranks = sorted({int(r) for r in ranks if not isinstance(r, bool) and int(r) == r and r >= 0})
            bad = len(ranks) != len(set(leaving[node]))
        except (TypeError, ValueError):
            bad = True
        if bad:
            raise CheckpointError(f"SaveOptions.leaving[{node!r}] must be a list of ranks (ints >= 0), "
                                  f"got {leaving[node]!r}")
        out[str(node)] = tuple(ranks)
    return out


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """How a save lays out and writes its data (every rank of a group passes the same).

    ``max_file_bytes``: a rank's pieces are coalesced into data files of up to this many bytes
    of raw data (a piece larger than that gets a file of its own). ``compression``: None (the
    pieces' raw bytes), ``"zstd"`` or ``"lz4"``: each piece is compressed on its own with that
    library codec (pyarrow's), where that makes it smaller, and a load reads a compressed piece
    whole (docs/FORMAT.md). ``io``: the write path's sizes and threads (:class:`IOOptions`).
    ``survivors``: the save commits without ranks that die before or during it (their process,
    actor or node gone), provided the surviving ranks hold every piece of the state (replicas);
    the metadata records the lost ranks (``Metadata.extra["lost_ranks"]``). Otherwise nothing is
    committed and every survivor raises one :class:`~raydcp.errors.StateNotCoveredError` naming
    the keys and ranks. Synchronous saves of a Ray group only (``raydcp.save``).
    ``leaving`` (with ``survivors``): the ranks announced to go, by node (a preemption notice's
    ``{node id: [ranks]}``). Where the other ranks hold every piece these ranks hold, the plan gives
    them nothing to write and the commit does not wait for them, so their death at any moment
    changes nothing; a leaving rank whose node is gone is left out at once, called or not.

    ``base``: a delta save (docs/delta.md). A committed checkpoint's path, or ``"previous"``: the
    newest checkpoint this writer (the Group's name, else this process) committed with a base
    option in the same parent directory (none: a full save). The pieces whose bytes equal the
    base's (decided by a content hash of every piece) are not written again: the new checkpoint
    references the base's files, and loads, reshards, converts and verifies like a full one.
    """

    max_file_bytes: int = MAX_FILE_BYTES
    compression: str | None = None
    io: IOOptions = DEFAULT_IO
    survivors: bool = False
    leaving: Mapping[str, tuple[int, ...]] | None = None
    base: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        _check_size("SaveOptions", "max_file_bytes", self.max_file_bytes, ALIGN)
        if self.compression is not None:
            if self.compression not in COMPRESSIONS:
                raise CheckpointError(f"SaveOptions.compression must be None or one of "
                                      f"{', '.join(map(repr, COMPRESSIONS))}, got {self.compression!r}")
            import pyarrow as pa  # the codecs are pyarrow's; imported only when one is asked for

            if not pa.Codec.is_available(self.compression):
                raise CheckpointError(f"SaveOptions.compression={self.compression!r} is not available in this "
                                      f"pyarrow build ({pa.__version__}); choose another codec or None")
        _check_io("SaveOptions", self.io)
        if not isinstance(self.survivors, bool):
            raise CheckpointError(f"SaveOptions.survivors must be True or False, got {self.survivors!r}")
        if self.leaving is not None:
            object.__setattr__(self, "leaving", _leaving(self.leaving, self.survivors))
        if self.base is not None and not isinstance(self.base, (str, os.PathLike)):
            raise CheckpointError(f"SaveOptions.base must be a checkpoint path or 'previous', got {self.base!r}")
        if isinstance(self.base, os.PathLike):
            object.__setattr__(self, "base", os.fspath(self.base))

    def replace(self, **changes) -> "SaveOptions":
        return replace(self, **changes)


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How a load reads and what it leaves when it fails.

    ``io``: the read path's sizes and threads (:class:`IOOptions`). ``atomic`` (default True): a
    load that raises leaves the state dict as it was (tensors, plain values, Stateful objects,
    Modules and optimizers), on every rank of the group; it keeps a host copy of the tensors it
    fills until it returns (extra host memory equal to the bytes this rank loads), except from
    the memory tier (``raymem://``), which verifies every piece before writing any and needs no
    copy unless a Stateful, Module or optimizer is handed state back (docs/loading.md).
    ``atomic=False`` saves that memory: a failed load may leave some tensors filled, and its
    error names them (``written_keys``).
    """

    io: IOOptions = DEFAULT_IO
    atomic: bool = True

    def __post_init__(self) -> None:
        _check_io("LoadOptions", self.io)
        if not isinstance(self.atomic, bool):
            raise CheckpointError(f"LoadOptions.atomic must be True or False, got {self.atomic!r}")


DEFAULT_SAVE = SaveOptions()
DEFAULT_LOAD = LoadOptions()
