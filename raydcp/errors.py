"""The errors raydcp raises, and the per-rank failure record.

Every error a user can see is a :class:`CheckpointError`; its subclasses say what
went wrong, so callers branch on the type, never on the message text:

- :class:`CheckpointNotFoundError` -- nothing committed at the path.
- :class:`CheckpointDamagedError` -- a file of the checkpoint is missing, short or
  fails its checksum, or the metadata is malformed (``file``, ``key``, ``byte_range``).
- :class:`CheckpointReplacedError` -- a newer save committed to the path while a
  load was reading it; loading again reads the new checkpoint.
- :class:`StateMismatchError` -- the state dict and the checkpoint (or the ranks
  among themselves) disagree on keys, shapes or dtypes.
- :class:`RanksTimedOutError` -- ranks did not arrive within the group's timeout.
- :class:`RankFailedError` -- code running on a rank raised something that is not a
  raydcp error: the user's own code, or a bug in raydcp (``origin`` says which).
- :class:`CoordinatorLostError` -- the coordinator of a collective operation died.
- :class:`StorageError` -- the storage refused or failed an operation (``retriable``).
- :class:`RanksLostError` -- ranks died (their process or node went) during a collective
  operation; :class:`StateNotCoveredError` -- a survivors save could not commit because
  some of the state was held only by the lost ranks (``keys``, ``lost_ranks``).

Errors raised on one rank travel to every other rank of the operation as
:class:`RankFailure` records, so all ranks fail together with the same error
instead of hanging. ``CheckpointError.failures`` maps each failed rank to its
exception. Every error pickles with its attributes (Ray carries them between actors).
"""
from __future__ import annotations

import os
import pickle
import sysconfig
import traceback as _tb
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Mapping, TypeVar

__all__ = ["CheckpointError", "CheckpointNotFoundError", "CheckpointDamagedError", "CheckpointReplacedError",
           "ConcurrentSaveError", "StateMismatchError", "RanksTimedOutError", "RankFailedError", "CoordinatorLostError", "StorageError",
           "RemoteException", "RankFailure", "user_code", "RanksLostError", "StateNotCoveredError", "RankLost"]


_E = TypeVar("_E", bound=BaseException)


def _rebuild(cls: type[_E], args: tuple, state: dict) -> _E:
    """An error of type ``cls`` with ``args`` and attributes ``state``, without calling ``cls.__init__``."""
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


def _failure_map(failures: Mapping[int, BaseException | str] | None) -> dict[int, BaseException]:
    out: dict[int, BaseException] = {}
    for rank, exc in (failures or {}).items():
        out[int(rank)] = exc if isinstance(exc, BaseException) else CheckpointError(str(exc))
    return out


class CheckpointError(Exception):
    """Base class of every error raydcp raises.

    ``failures`` maps rank -> that rank's exception when the error gathers failures
    from several ranks of a collective save or load (empty otherwise); ``str()`` of
    each says what happened on that rank.
    """

    def __init__(self, message: str = "", failures: Mapping[int, BaseException | str] | None = None):
        super().__init__(message)
        self.failures: dict[int, BaseException] = _failure_map(failures)

    def __reduce__(self):  # picklable across Ray actors with every attribute, for every subclass
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))

    def copy(self, message: str | None = None, failures: Mapping | None = None, **attrs) -> "CheckpointError":
        """The same error (type and attributes) as a new object, optionally with another message,
        failures or attributes (``key=...``). Raise a copy, not a shared object, where several ranks
        of one process raise the same error."""
        state = dict(self.__dict__)
        if failures is not None:
            state["failures"] = _failure_map(failures)
        state.update(attrs)
        return _rebuild(type(self), self.args if message is None else (message,), state)


class CheckpointNotFoundError(CheckpointError):
    """No committed checkpoint at ``path``: a wrong path, or a save that has not committed (yet).

    ``reason`` says which, where it is known: ``"missing"`` (no such path), ``"file"`` (a file,
    not a directory), ``"checkpoints-below"`` (a directory of checkpoints; ``below`` lists their
    paths relative to ``path``), ``"uncommitted"`` (a save there has not committed),
    ``"uncommitted-below"``, ``"removed-base"`` (a removed checkpoint whose files delta checkpoints
    still reference), ``"other-format"`` (torch DCP, safetensors, torch.save) or ``"empty"``.
    """

    def __init__(self, message: str, *, path: str | None = None, reason: str | None = None,
                 below: tuple[str, ...] = (), failures=None):
        super().__init__(message, failures)
        self.path = path
        self.reason = reason
        self.below = tuple(below)


class CheckpointDamagedError(CheckpointError):
    """Part of a committed checkpoint is missing, truncated, fails its checksum, or is malformed.

    ``file`` (the damaged file: its URL, or its name within the checkpoint; or None), ``key`` (the
    tensor concerned, or None) and ``byte_range`` (``(start, end)`` within ``file``, or None) say where.
    """

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None,
                 byte_range: tuple[int, int] | None = None, failures=None):
        super().__init__(message, failures)
        self.file = file
        self.key = key
        self.byte_range = None if byte_range is None else (int(byte_range[0]), int(byte_range[1]))


class CheckpointReplacedError(CheckpointError):
    """A newer save committed to ``path`` while a load was reading it, removing the files it read.

    Nothing is damaged: loading again reads the new checkpoint. ``read_save`` and
    ``committed_save`` are the ids of the save being read and of the one now committed.
    """

    retriable = True

    def __init__(self, message: str, *, path: str | None = None, read_save: str | None = None,
                 committed_save: str | None = None, failures=None):
        super().__init__(message, failures)
        self.path = path
        self.read_save = read_save
        self.committed_save = committed_save


class ConcurrentSaveError(CheckpointError):
    """Another save committed to ``path`` while this one was running: this save lost and committed
    nothing (its files are removed); the checkpoint at ``path`` is the other save's, complete and
    loadable. ``save_id`` is this save's id, ``generation`` the commit it was based on. Saving
    again (after the other save) succeeds; give concurrent writers different paths.
    """

    retriable = True

    def __init__(self, message: str, *, path: str | None = None, save_id: str | None = None,
                 generation: int | None = None, failures=None):
        super().__init__(message, failures)
        self.path = path
        self.save_id = save_id
        self.generation = generation


class StateMismatchError(CheckpointError):
    """The state dict does not fit the checkpoint, or the ranks disagree about the state.

    ``missing_keys`` (wanted, not stored), ``unexpected_keys`` (stored, not wanted), ``shapes``
    and ``dtypes`` (key -> the shapes or dtypes that differ: ``(in the checkpoint, wanted)`` on
    load, one per variant among the ranks on save); ``keys`` is every offending key named.
    """

    def __init__(self, message: str, *, missing_keys=(), unexpected_keys=(), shapes: Mapping | None = None,
                 dtypes: Mapping | None = None, failures=None):
        super().__init__(message, failures)
        self.missing_keys = tuple(missing_keys)
        self.unexpected_keys = tuple(unexpected_keys)
        self.shapes = dict(shapes or {})
        self.dtypes = dict(dtypes or {})

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(sorted({*self.missing_keys, *self.unexpected_keys, *self.shapes, *self.dtypes}))


class RanksTimedOutError(CheckpointError):
    """``missing_ranks`` did not reach a step of a collective operation within ``timeout_s``."""

    def __init__(self, message: str, *, missing_ranks=(), timeout_s: float | None = None, failures=None):
        super().__init__(message, failures)
        self.missing_ranks = tuple(sorted(int(r) for r in missing_ranks))
        self.timeout_s = timeout_s


class CoordinatorLostError(CheckpointError):
    """The coordinator of a collective operation (or a helper actor or process) died before it ended.

    ``dead_rank`` is the rank whose death took it down, where known.
    """

    def __init__(self, message: str, *, dead_rank: int | None = None, failures=None):
        super().__init__(message, failures)
        self.dead_rank = dead_rank


class RanksLostError(CheckpointError):
    """``lost_ranks`` died (their process, actor or node is gone) during a collective operation.

    A survivors save (``SaveOptions(survivors=True)``) goes on without them; ``required`` is
    what the operation had planned to save before they went (tensor and value keys), so that
    the survivors' next plan is checked against it.
    """

    def __init__(self, message: str, *, lost_ranks=(), required=(), failures=None):
        super().__init__(message, failures)
        self.lost_ranks = tuple(sorted(int(r) for r in lost_ranks))
        self.required = tuple(required)


class StateNotCoveredError(RanksLostError):
    """A survivors save could not commit: ``keys`` (tensors or values) were held, whole or in
    part, only by the ``lost_ranks``; nothing was committed."""

    def __init__(self, message: str, *, keys=(), lost_ranks=(), failures=None):
        super().__init__(message, lost_ranks=lost_ranks, failures=failures)
        self.keys = tuple(keys)


class StorageError(CheckpointError):
    """The storage failed an operation. ``retriable``: the same call may succeed later (a network
    error, a throttled request), as opposed to a refusal that needs a change (permissions, a full
    disk, a wrong URL). ``path`` is the file or directory concerned."""

    def __init__(self, message: str, *, retriable: bool = False, path: str | None = None, failures=None):
        super().__init__(message, failures)
        self.retriable = bool(retriable)
        self.path = path


class RemoteException(Exception):
    """Stands in for a rank's exception that cannot be pickled: its type's name and message."""

    def __init__(self, type_name: str, message: str):
        super().__init__(type_name, message)
        self.type_name = type_name
        self.message = message

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}" if self.message else self.type_name


class RankFailedError(CheckpointError):
    """Code running on ``rank`` (None: the coordinator) raised ``exception``, which is not a raydcp error.

    ``origin`` says whose code raised it: ``"user"`` (the user's own code, e.g. a
    Stateful's ``state_dict()``; fix it there), ``"raydcp"`` (a bug in raydcp; report
    it with ``traceback``) or ``"environment"`` (out of memory, an operating-system error).
    ``exception`` is the rank's exception itself, with its type and message (a
    :class:`RemoteException` where it cannot be pickled); ``traceback`` its text.
    """

    def __init__(self, message: str, *, rank: int | None, exception: BaseException | None, origin: str = "raydcp",
                 traceback: str = "", failures=None):
        super().__init__(message, failures if failures is not None or rank is None
                         else {rank: exception if exception is not None else message})
        self.rank = None if rank is None else int(rank)
        self.exception = exception
        self.origin = origin
        self.traceback = traceback


# ----------------------------------------------------------------------------- whose fault

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARY_DIRS = tuple(sorted({os.path.abspath(p) + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib")
                              if (p := sysconfig.get_paths().get(key))}))
_USER_CODE_ATTR = "__raydcp_user_code__"


def _is_raydcp(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE_DIR)


def _is_library(filename: str) -> bool:
    """Python itself or an installed package (torch, numpy, ...), as opposed to the user's code."""
    if filename.startswith("<"):
        return filename.startswith("<frozen")
    path = os.path.abspath(filename)
    return path.startswith(_LIBRARY_DIRS) or f"{os.sep}site-packages{os.sep}" in path or \
        f"{os.sep}dist-packages{os.sep}" in path


def _frame(f: _tb.FrameSummary) -> str:
    return f"{f.name} at {f.filename}:{f.lineno}"


def classify(exc: BaseException) -> tuple[str, str]:
    """``(origin, where)`` of a non-raydcp exception: whose code raised it, and in which frame.

    ``"user"`` when it was raised inside :func:`user_code` or by a frame of the user's own code
    that raydcp called, ``"environment"`` for memory and operating-system errors raised by raydcp
    or a library, ``"raydcp"`` otherwise (raised by raydcp, or by a library raydcp called).
    """
    frames = _tb.extract_tb(exc.__traceback__)
    tagged = getattr(exc, _USER_CODE_ATTR, None)
    if tagged:
        user = [f for f in frames if not _is_raydcp(f.filename) and not _is_library(f.filename)]
        return "user", f"{tagged}" + (f"; {_frame(user[-1])}" if user else "")
    last = max((i for i, f in enumerate(frames) if _is_raydcp(f.filename)), default=-1)
    user = [f for f in frames[last + 1:] if not _is_raydcp(f.filename) and not _is_library(f.filename)]
    if user:
        return "user", _frame(user[-1])
    where = _frame(frames[last]) if last >= 0 else (_frame(frames[-1]) if frames else "unknown frame")
    if isinstance(exc, (MemoryError, OSError)):
        return "environment", where
    return "raydcp", where


def describe_failure(rank: int | None, exc: BaseException, origin: str, where: str) -> str:
    """What a rank's non-raydcp exception means and what to do about it, in one message."""
    what = "".join(_tb.format_exception_only(type(exc), exc)).strip()
    if origin == "user":
        return (f"{what} -- raised by your code on {_who(rank)} ({where}), not by raydcp; fix it there and "
                f"call again (the error's .traceback shows where)")
    if origin == "environment":
        return (f"{what} -- on {_who(rank)} ({where}): the machine ran out of a resource (memory, disk, file "
                f"handles) or the operating system refused; free it and call again")
    return (f"{what} -- an internal error in raydcp on {_who(rank)} ({where}); please report it with the "
            f"error's .traceback")


def _who(rank: int | None) -> str:
    return "the coordinator" if rank is None else f"rank {rank}"


@contextmanager
def user_code(what: str) -> Iterator[None]:
    """Mark the user's code called inside (``what``: e.g. ``"optim: Scheduler.state_dict()"``) so that an
    exception it raises is reported as the user's, not as a raydcp bug. The exception passes unchanged."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:
        try:
            setattr(exc, _USER_CODE_ATTR, what)
        except Exception:  # an exception type without a __dict__: the frames still tell
            pass
        raise


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives a pickle round trip (it will cross processes), else a RemoteException."""
    try:
        back = pickle.loads(pickle.dumps(exc))
        if type(back) is type(exc) and str(back) == str(exc):
            return exc
    except Exception:
        pass
    return RemoteException(f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc))


# ----------------------------------------------------------------------------- failures of ranks

@dataclass(frozen=True)
class RankFailure:
    """What a rank sends instead of its local result when its local step failed.

    ``error`` is the rank's exception (a raydcp error, or the original exception of user
    code or of a bug, picklable); ``origin`` and ``traceback`` are set for the latter.
    """

    rank: int
    message: str
    error: BaseException | None = field(default=None, compare=False)
    origin: str = ""
    traceback: str = field(default="", compare=False)

    def __post_init__(self):
        if self.error is None:
            object.__setattr__(self, "error", CheckpointError(self.message))

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> "RankFailure":
        if isinstance(exc, CheckpointError):
            return cls(rank, str(exc), exc)
        origin, where = classify(exc)
        text = "".join(_tb.format_exception(type(exc), exc, exc.__traceback__))
        return cls(rank, describe_failure(rank, exc, origin, where), _portable(exc), origin, text)


@dataclass(frozen=True)
class RankLost:
    """What a survivors operation's coordinator hands its reduction in place of a rank that died
    (``reason`` says how it was found gone): the reduction goes on without the rank."""

    rank: int
    reason: str = "its process is gone"


def failures_error(step: str, failures: list[RankFailure]) -> CheckpointError:
    """One error for the failed ranks of a step: of the type of the lowest failed rank's error
    (a :class:`RankFailedError` where that is not a raydcp error), ``failures`` naming every rank."""
    failures = sorted(failures, key=lambda f: f.rank)
    by_rank = {f.rank: f.error for f in failures}
    first = failures[0]
    if len(failures) == 1:
        message = f"{step} failed on rank {first.rank}: {first.message}"
    else:
        lines = "\n".join(f"  rank {f.rank}: {f.message}" for f in failures)
        message = f"{step} failed on {len(failures)} ranks:\n{lines}"
    if isinstance(first.error, CheckpointError):
        return first.error.copy(message, by_rank)
    return RankFailedError(message, rank=first.rank, exception=first.error, origin=first.origin or "raydcp",
                           traceback=first.traceback, failures=by_rank)


def coordinator_error(step: str, exc: BaseException) -> RankFailedError:
    """The error every rank raises when the coordinator's reduction of ``step`` raised ``exc`` (not a raydcp error)."""
    origin, where = classify(exc)
    text = "".join(_tb.format_exception(type(exc), exc, exc.__traceback__))
    return RankFailedError(f"{step} failed in the coordinator: {describe_failure(None, exc, origin, where)}",
                           rank=None, exception=_portable(exc), origin=origin, traceback=text)


def as_checkpoint_error(exc: BaseException, step: str, rank: int = 0) -> CheckpointError:
    """``exc`` where it is a raydcp error, else the :class:`RankFailedError` of ``rank`` raising it in ``step``."""
    if isinstance(exc, CheckpointError):
        return exc
    return failures_error(step, [RankFailure.from_exception(rank, exc)])


def raise_failures(step: str, failures: list[RankFailure]) -> None:
    """Raise one CheckpointError naming every failed rank (no-op when empty): see :func:`failures_error`."""
    if failures:
        raise failures_error(step, failures)
