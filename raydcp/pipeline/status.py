"""The status record of a checkpoint: which stages it reached on which tier, durably, as JSON.

A pipeline checkpoint ``NAME`` has one copy per storage tier (``<tier root>/NAME``). Each copy
holds, beside ``raydcp.meta``, the file ``raydcp.status.json`` (STATUS_NAME): a JSON document
(never a pickle) describing the whole pipeline of that checkpoint -- every tier, every stage::

    {"format": "raydcp.status", "version": [1, 0], "name": "step-30", "seq": 3, "step": 30,
     "save_id": "...", "revision": 14, "created_at": ..., "updated_at": ..., "bytes": ...,
     "files": 2, "node_id": "...",
     "tiers":  [{"url": "/nvme/ckpt/step-30", "copy": "committed"}, {"url": "s3://b/step-30", ...}],
     "stages": [{"stage": "staged", "tier": 0, "state": "done", "started_at": ..., "finished_at": ...,
                 "seconds": 0.01, "bytes": 1048576, "attempts": 1, "error": null, "detail": null}, ...]}

Copies of the record on different tiers may lag one another (a tier that was unreachable, a
copy pruned); ``revision`` grows by one at every write, and readers take the copy with the
highest revision (:func:`freshest`).

Stages run in the record's order; each waits for its dependencies (:func:`dependencies`). States::

    pending -> running -> done                 (done is final: a done stage never runs again)
                       -> failed -> running    (after retry())
    pending -> blocked -> pending | running    (a dependency failed; retry() unblocks it)
    running -> running                         (the driver stopped mid-stage; a new one reruns it)
    pending -> skipped                         (not wanted, e.g. an earlier save superseded this one)
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

from ..errors import CheckpointDamagedError, CheckpointError

__all__ = ["STATUS_NAME", "STATUS_VERSION", "STAGES", "STATES", "COPY_STATES", "StageEntry", "TierCopy",
           "StatusRecord", "plan_stages", "dependencies", "encode_status", "decode_status", "freshest"]

STATUS_NAME = "raydcp.status.json"
STATUS_VERSION = (1, 0)
FORMAT = "raydcp.status"

STAGES = ("staged", "persisted", "committed", "verified", "replicated", "exported", "hook", "retention")
STATES = ("pending", "running", "done", "failed", "blocked", "skipped")
COPY_STATES = ("absent", "committed", "pruned", "failed")
TERMINAL = frozenset({"done", "failed", "blocked", "skipped"})

_TRANSITIONS = {
    "pending": {"running", "done", "blocked", "skipped"},
    "running": {"running", "done", "failed", "pending", "blocked", "skipped"},
    "failed": {"running", "pending"},
    "blocked": {"pending", "running", "blocked", "skipped"},
    "skipped": set(),
    "done": set(),
}


@dataclass
class StageEntry:
    """One stage of one checkpoint on one tier (``tier`` None for hooks)."""

    stage: str
    tier: int | None
    state: str = "pending"
    started_at: float | None = None    # wall clock (time.time()) of the last start
    finished_at: float | None = None
    seconds: float | None = None       # duration of the last attempt that finished
    bytes: int = 0
    attempts: int = 0
    error: str | None = None
    detail: str | None = None          # the hook's name, the export's URL, the source tier, ...

    @property
    def key(self) -> str:
        if self.stage == "hook":
            return f"hook:{self.detail}"
        return f"{self.stage}@{self.tier}"

    @property
    def throughput(self) -> float | None:
        """Bytes per second of the last finished attempt, where both are known."""
        if self.state != "done" or not self.bytes or not self.seconds:
            return None
        return self.bytes / self.seconds


@dataclass
class TierCopy:
    """The copy of a checkpoint on one tier: its URL and what the pipeline did with it."""

    url: str
    copy: str = "absent"


@dataclass
class StatusRecord:
    """The pipeline state of one checkpoint (see the module docstring for the JSON form)."""

    name: str
    seq: int
    tiers: list[TierCopy]
    stages: list[StageEntry]
    save_id: str | None = None
    step: int | None = None
    revision: int = 0
    created_at: float = field(default_factory=time.time)
    updated_at: float | None = None
    bytes: int = 0
    files: int = 0
    node_id: str | None = None
    version: tuple[int, int] = STATUS_VERSION

    # ------------------------------------------------------------- queries

    def entry(self, key: str) -> StageEntry:
        for e in self.stages:
            if e.key == key:
                return e
        raise KeyError(f"checkpoint {self.name!r} has no stage {key!r} (stages: {[e.key for e in self.stages]})")

    def has(self, key: str) -> bool:
        return any(e.key == key for e in self.stages)

    @property
    def state(self) -> str:
        """``running`` while a stage is pending or running; else ``failed`` if one failed or is
        blocked (the copies that committed are still usable); else ``complete``."""
        states = {e.state for e in self.stages}
        if states & {"pending", "running"}:
            return "running"
        if states & {"failed", "blocked"}:
            return "failed"
        return "complete"

    @property
    def finished(self) -> bool:
        return self.state != "running"

    def committed_tiers(self) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t.copy == "committed"]

    def failures(self) -> list[StageEntry]:
        return [e for e in self.stages if e.state in ("failed", "blocked")]

    # ------------------------------------------------------------- the state machine

    def transition(self, key: str, state: str, *, now: float | None = None, seconds: float | None = None,
                   nbytes: int | None = None, error: str | None = None, detail: str | None = None) -> StageEntry:
        """Move stage ``key`` to ``state`` (checked against the allowed transitions) and stamp it."""
        if state not in STATES:
            raise CheckpointError(f"unknown stage state {state!r}; states are {', '.join(STATES)}")
        e = self.entry(key)
        if state not in _TRANSITIONS[e.state]:
            raise CheckpointError(
                f"checkpoint {self.name!r}: stage {key} cannot go from {e.state} to {state}")
        now = time.time() if now is None else now
        if state == "running":
            e.started_at, e.finished_at, e.error = now, None, None
            e.attempts += 1
        elif state in TERMINAL:
            e.finished_at = now
        if seconds is not None:
            e.seconds = seconds
        if nbytes is not None:
            e.bytes = int(nbytes)
        if state in ("failed", "blocked"):
            e.error = error or e.error or "failed"
        elif state in ("done", "pending"):
            e.error = None
        if detail is not None:
            e.detail = detail
        e.state = state
        return e

    def blockers(self, key: str) -> list[StageEntry]:
        """The dependencies of ``key`` that are not done."""
        return [d for d in (self.entry(k) for k in dependencies(self.entry(key), self) if self.has(k))
                if d.state != "done"]

    def next_stage(self) -> StageEntry | None:
        """The first stage to run (pending, or running when a previous driver was interrupted)."""
        for e in self.stages:
            if e.state in ("pending", "running"):
                return e
        return None

    def reset_failed(self) -> list[str]:
        """Put failed and blocked stages back to pending (``retry``); returns their keys."""
        keys = []
        for e in self.stages:
            if e.state in ("failed", "blocked"):
                e.state, e.error = "pending", None
                keys.append(e.key)
        for i, t in enumerate(self.tiers):
            if t.copy == "failed":
                t.copy = "absent"
        return keys

    # ------------------------------------------------------------- reporting

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": list(self.version),
            "name": self.name,
            "seq": self.seq,
            "step": self.step,
            "save_id": self.save_id,
            "revision": self.revision,
            "state": self.state,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "bytes": self.bytes,
            "files": self.files,
            "node_id": self.node_id,
            "tiers": [asdict(t) for t in self.tiers],
            "stages": [asdict(e) for e in self.stages],
        }

    def metrics(self, prefix: str = "raydcp/") -> dict[str, float]:
        """Flat numbers for experiment trackers (e.g. a Ray Train report): seconds and bytes per stage."""
        out: dict[str, float] = {f"{prefix}seq": float(self.seq), f"{prefix}bytes": float(self.bytes)}
        for e in self.stages:
            if e.state == "done" and e.seconds is not None:
                out[f"{prefix}{e.key}/seconds"] = float(e.seconds)
                if e.throughput:
                    out[f"{prefix}{e.key}/bytes_per_s"] = float(e.throughput)
        return out


def plan_stages(n_tiers: int, *, verify: bool, export_tier: int | None, hooks: Sequence[str],
                retention_tiers: Iterable[int]) -> list[StageEntry]:
    """The stages of one checkpoint, in the order they run.

    staged, persisted, committed on tier 0; verified on tier 0 (before anything is copied from it);
    for each further tier: replicated, committed, verified; exported; hooks; retention per tier.
    """
    if n_tiers < 1:
        raise CheckpointError("a pipeline needs at least one storage tier")
    out = [StageEntry("staged", 0), StageEntry("persisted", 0), StageEntry("committed", 0)]
    if verify:
        out.append(StageEntry("verified", 0))
    for k in range(1, n_tiers):
        out += [StageEntry("replicated", k), StageEntry("committed", k)]
        if verify:
            out.append(StageEntry("verified", k))
    if export_tier is not None:
        out.append(StageEntry("exported", export_tier))
    if len(set(hooks)) != len(hooks):
        raise CheckpointError(f"hook names must be unique, got {list(hooks)}")
    out += [StageEntry("hook", None, detail=h) for h in hooks]
    out += [StageEntry("retention", k) for k in sorted(set(retention_tiers))]
    return out


def dependencies(entry: StageEntry, record: StatusRecord) -> list[str]:
    """Keys of the stages that must be done before ``entry`` runs.

    Every further tier is filled from the fastest committed copy (normally tier 0), so tiers do
    not wait for one another: an unreachable tier blocks only its own stages.
    """
    s, k = entry.stage, entry.tier
    if s == "staged" or s == "retention":
        return []
    if s == "persisted":
        return ["staged@0"]
    if s == "committed":
        return ["persisted@0"] if k == 0 else [f"replicated@{k}"]
    if s in ("verified", "replicated"):
        return [f"committed@{k if s == 'verified' else 0}"]
    if s == "exported":
        deps = [f"committed@{k}"]
        return deps + ([f"verified@{k}"] if record.has(f"verified@{k}") else [])
    if s == "hook":
        return ["committed@0"]
    return []


# ----------------------------------------------------------------------- encoding


def encode_status(record: StatusRecord) -> bytes:
    """The record as UTF-8 JSON."""
    return (json.dumps(record.to_dict(), indent=1, allow_nan=False) + "\n").encode()


def decode_status(data: bytes | str, source: str = STATUS_NAME) -> StatusRecord:
    """Parse and validate a status record; any problem is a CheckpointError naming ``source``."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointDamagedError(f"{source}: not a valid status record (not JSON: {exc}); the file is damaged",
                                     file=source) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{source}: not a raydcp status record (format is not {FORMAT!r})")
    version = doc.get("version")
    if not (isinstance(version, list) and len(version) == 2 and all(isinstance(v, int) for v in version)):
        raise CheckpointError(f"{source}: status record without a valid version")
    if version[0] != STATUS_VERSION[0]:
        raise CheckpointError(
            f"{source}: status record version {version[0]}.{version[1]} is not supported by this raydcp "
            f"(reads {STATUS_VERSION[0]}.x); upgrade raydcp to read it")
    try:
        tiers = [TierCopy(str(t["url"]), _choice(t["copy"], COPY_STATES, "copy state")) for t in doc["tiers"]]
        stages = [_stage(s, len(tiers)) for s in doc["stages"]]
        record = StatusRecord(
            name=_typed(doc["name"], str, "name"), seq=_typed(doc["seq"], int, "seq"), tiers=tiers,
            stages=stages, save_id=_opt(doc.get("save_id"), str, "save_id"), step=_opt(doc.get("step"), int, "step"),
            revision=_typed(doc["revision"], int, "revision"), created_at=float(doc["created_at"]),
            updated_at=_opt(doc.get("updated_at"), (int, float), "updated_at"), bytes=_typed(doc.get("bytes", 0), int, "bytes"),
            files=_typed(doc.get("files", 0), int, "files"), node_id=_opt(doc.get("node_id"), str, "node_id"),
            version=(version[0], version[1]),
        )
    except CheckpointError as exc:
        raise CheckpointDamagedError(f"{source}: malformed status record: {exc}", file=source) from None
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointDamagedError(f"{source}: malformed status record ({type(exc).__name__}: {exc})",
                                     file=source) from None
    keys = [e.key for e in record.stages]
    if len(set(keys)) != len(keys):
        raise CheckpointError(f"{source}: malformed status record: a stage is listed twice")
    return record


def _stage(doc: dict, n_tiers: int) -> StageEntry:
    stage = _typed(doc["stage"], str, "stage")
    tier = _opt(doc.get("tier"), int, "tier")
    if tier is not None and not 0 <= tier < n_tiers:
        raise CheckpointError(f"stage {stage} names tier {tier}, but the record has {n_tiers} tiers")
    return StageEntry(
        stage=stage, tier=tier, state=_choice(doc["state"], STATES, "stage state"),
        started_at=_opt(doc.get("started_at"), (int, float), "started_at"),
        finished_at=_opt(doc.get("finished_at"), (int, float), "finished_at"),
        seconds=_opt(doc.get("seconds"), (int, float), "seconds"),
        bytes=_typed(doc.get("bytes", 0), int, "bytes"), attempts=_typed(doc.get("attempts", 0), int, "attempts"),
        error=_opt(doc.get("error"), str, "error"), detail=_opt(doc.get("detail"), str, "detail"),
    )


def _typed(v: Any, t, what: str):
    if isinstance(v, bool) or not isinstance(v, t):
        raise CheckpointError(f"{what} has the wrong type ({type(v).__name__})")
    return v


def _opt(v: Any, t, what: str):
    return None if v is None else _typed(v, t, what)


def _choice(v: Any, allowed: Sequence[str], what: str) -> str:
    if v not in allowed:
        raise CheckpointError(f"unknown {what} {v!r}")
    return v


def freshest(records: Iterable[StatusRecord | None]) -> StatusRecord | None:
    """The record with the highest revision (copies on several tiers may lag one another)."""
    best = None
    for r in records:
        if r is not None and (best is None or r.revision > best.revision):
            best = r
    return best
