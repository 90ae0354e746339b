"""Gather every rank's outcome of a collective operation run as one Ray task per rank.

Used by ``raydcp.ShardGroup`` (each operation of its actors) and by the reshard job (each round):

1. the driver starts one task per rank and calls :func:`gather_outcomes` with them;
2. it waits for every rank without a limit while all goes well: a collective operation bounds its
   own waits (the group's ``timeout_s``), so a healthy slow rank is never cut off;
3. once a rank failed (a CheckpointError returned or raised) or its actor died, the others are
   failing too (they wait for it in the collective) and only need time to say why: the driver
   waits at most ``grace_s`` longer, then calls the ranks still running *stuck*;
4. :meth:`Outcomes.error` builds the one CheckpointError that names the failed ranks (grouped by
   message), the dead ones and the stuck ones, with ``failures`` for each.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import ray
from ray import exceptions as rex

from ..errors import CheckpointError, RanksTimedOutError

__all__ = ["Outcomes", "gather_outcomes", "combined_error"]


@dataclass
class Outcomes:
    """What :func:`gather_outcomes` found, per rank."""

    results: dict[int, Any] = field(default_factory=dict)         # rank -> the task's return value
    errors: dict[int, CheckpointError] = field(default_factory=dict)
    dead: list[int] = field(default_factory=list)                 # ranks whose actor died
    pending: dict[Any, int] = field(default_factory=dict)         # ref -> rank, still running (stuck)

    @property
    def stuck(self) -> list[int]:
        return sorted(self.pending.values())

    @property
    def ok(self) -> bool:
        return not (self.errors or self.dead or self.pending)

    def error(self, headline: str, *, note: str = "", then: str = "", sep: str = "\n  ") -> CheckpointError:
        """The CheckpointError ``<headline> failed <what failed where>`` (see :func:`combined_error`)."""
        return combined_error(headline, self.errors, self.dead, self.stuck, note=note, then=then, sep=sep)


def gather_outcomes(refs: Mapping[int, Any], *, grace_s: float, errors: Mapping[int, Any] | None = None,
                    stop_on_dead: bool = False) -> Outcomes:
    """Wait for the tasks ``refs`` (rank -> ObjectRef) and sort each rank's outcome.

    A task that returns or raises a CheckpointError failed; a dead actor (``RayActorError``) is
    *dead*; any other Ray error is a failure named as unexpected. ``errors`` are failures known
    before (a rank run by the driver itself). Once anything failed, the driver waits at most
    ``grace_s`` more for the others; with ``stop_on_dead`` it stops at the first dead actor
    (when the others cannot finish without it).
    """
    out = Outcomes(errors={r: e for r, e in (errors or {}).items() if e is not None})
    out.pending = {ref: r for r, ref in refs.items()}
    deadline = time.monotonic() + grace_s if out.errors else None
    while out.pending:
        wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait(list(out.pending), num_returns=1, timeout=wait_s)
        if not ready:
            break
        for ref in ready:
            r = out.pending.pop(ref)
            try:
                value = ray.get(ref)
            except rex.RayActorError:
                out.dead.append(r)
                continue
            except rex.RayError as exc:  # a bug, not a CheckpointError: still name the rank
                value = CheckpointError(f"unexpected {type(exc).__name__} on rank {r}: {exc}")
            if isinstance(value, CheckpointError):
                out.errors[r] = value
            else:
                out.results[r] = value
        if out.dead and stop_on_dead:
            break
        if (out.errors or out.dead) and deadline is None:
            deadline = time.monotonic() + grace_s
    out.dead.sort()
    return out


def combined_error(headline: str, errors: Mapping[int, CheckpointError], dead: list[int], stuck: list[int], *,
                   note: str = "", then: str = "", sep: str = "\n  ") -> CheckpointError:
    """One CheckpointError for a collective operation that failed on some ranks.

    Ranks that failed with the same message are named together. ``failures`` holds each rank's
    own failures (those the error it raised gathered, else the error itself), the dead ranks and
    the stuck ones. The error is of the type of the lowest failed rank's error; with only stuck
    ranks, a :class:`RanksTimedOutError`. ``note`` is said in parentheses after the headline, ``then`` at the end (what to do).
    """
    by_message: dict[str, list[int]] = {}
    failures: dict[int, Any] = {}
    for r in sorted(errors):
        by_message.setdefault(str(errors[r]), []).append(r)
        failures.update(getattr(errors[r], "failures", None) or {r: errors[r]})
    parts = [f"on ranks {ranks}: {msg}" for msg, ranks in by_message.items()]
    if dead:
        parts.append(f"the actors of ranks {dead} died")
        failures.update({r: "its actor died" for r in dead})
    if stuck:
        parts.append(f"ranks {stuck} did not finish")
        failures.update({r: failures.get(r, "did not finish") for r in stuck})
    where = f" ({note})" if note else ""
    if len(parts) == 1:
        msg = f"{headline} failed {parts[0]}{where}"
    elif sep.startswith("\n"):
        msg = f"{headline} failed{where}:{sep}" + sep.join(parts)
    else:
        msg = f"{headline} failed {sep.join(parts)}{where}"
    if errors:  # of the type of the lowest failed rank's error, so callers can branch on it
        return errors[min(errors)].copy(msg + then, failures)
    if stuck and not dead:
        return RanksTimedOutError(msg + then, missing_ranks=stuck, failures=failures)
    return CheckpointError(msg + then, failures)
