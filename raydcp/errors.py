"""The one exception type raydcp raises, and the per-rank failure record.

Every error a user can see is a :class:`CheckpointError`. Errors raised on one
rank travel to every other rank of the operation as :class:`RankFailure`
records, so all ranks fail together with the same message instead of hanging.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass

__all__ = ["CheckpointError", "RankFailure"]


class CheckpointError(Exception):
    """Base class of every error raydcp raises.

    ``failures`` maps rank -> message when the error gathers failures from
    several ranks of a collective save or load (empty otherwise).
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})

    def __reduce__(self):  # picklable across Ray actors with its failures
        return (type(self), (str(self), self.failures))


@dataclass(frozen=True)
class RankFailure:
    """What a rank sends instead of its local result when its local step failed."""

    rank: int
    message: str

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> "RankFailure":
        if isinstance(exc, CheckpointError):
            return cls(rank, str(exc))
        tb = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return cls(rank, f"{tb} (unexpected; please report with the traceback from rank {rank}'s log)")


def raise_failures(step: str, failures: list[RankFailure]) -> None:
    """Raise one CheckpointError naming every failed rank (no-op when empty)."""
    if not failures:
        return
    failures = sorted(failures, key=lambda f: f.rank)
    if len(failures) == 1:
        f = failures[0]
        raise CheckpointError(f"{step} failed on rank {f.rank}: {f.message}", {f.rank: f.message})
    lines = "\n".join(f"  rank {f.rank}: {f.message}" for f in failures)
    raise CheckpointError(
        f"{step} failed on {len(failures)} ranks:\n{lines}",
        {f.rank: f.message for f in failures},
    )
