"""Live checks of the copies of a checkpoint, and where the pipeline stands overall (for ``status``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointDamagedError, CheckpointError, CheckpointNotFoundError
from ..metadata_format import decode_metadata
from ..storage import METADATA_NAME, CheckpointStorage
from .record_files import read_record
from .status import StatusRecord, freshest

__all__ = ["CopyCheck", "check_copy", "PipelineReport", "inspect_pipeline"]


@dataclass
class CopyCheck:
    """What one copy looks like now: ``ok``, ``missing`` (not committed), ``damaged`` or ``unreachable``."""

    tier: int | None
    url: str
    recorded: str | None          # the copy state the record claims
    live: str
    problems: list[str] = field(default_factory=list)
    full: bool = False            # every checksum was read (--verify), not only sizes

    def to_dict(self) -> dict[str, Any]:
        return {"tier": self.tier, "url": self.url, "recorded": self.recorded, "live": self.live,
                "problems": list(self.problems), "full": self.full}


def check_copy(url: str, storage_options: dict | None, *, full: bool = False, tier: int | None = None,
               recorded: str | None = None) -> CopyCheck:
    """Cheap by default: the metadata decodes and every data file exists and is long enough.
    ``full`` also reads every piece and compares its CRC32C (:func:`raydcp.verify.verify_checkpoint`)."""
    out = CopyCheck(tier, url, recorded, "ok", full=full)
    try:
        storage = CheckpointStorage(url, storage_options)
        if not storage.is_committed():
            out.live = "missing"
            out.problems.append(f"no {METADATA_NAME}: the copy is not committed (deleted, pruned or lost)")
            return out
        if full:
            from ..verify import verify_checkpoint

            report = verify_checkpoint(url, storage_options)
            if not report.ok:
                out.live = "damaged"
                out.problems += [str(p) for p in report.problems]
            return out
        md = decode_metadata(storage.read_metadata_bytes(), storage.file_url(METADATA_NAME))
        need: dict[str, int] = {}
        for tm in md.tensors.values():
            for c in tm.chunks:
                need[c.file] = max(need.get(c.file, 0), c.byte_offset + c.stored_length)
        for name in sorted(need):
            size = storage.file_size(name)
            if size is None:
                out.problems.append(f"{name}: the data file is missing")
            elif size < need[name]:
                out.problems.append(f"{name}: truncated ({size} bytes, {need[name]} needed)")
    except CheckpointError as exc:
        text = " ".join(str(exc).split())
        out.live = "damaged" if isinstance(exc, (CheckpointDamagedError, CheckpointNotFoundError)) else "unreachable"
        out.problems.append(text)
        return out
    if out.problems:
        out.live = "damaged"
    return out


@dataclass
class PipelineReport:
    """The freshest record of a checkpoint, plus a live check of each copy."""

    path: str
    record: StatusRecord | None
    checks: list[CopyCheck]
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No failed stage, and every copy the record calls committed is there and intact."""
        if self.record is not None and self.record.state == "failed":
            return False
        return all(c.live == "ok" for c in self.checks if c.recorded in (None, "committed"))

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "ok": self.ok, "record": self.record.to_dict() if self.record else None,
                "checks": [c.to_dict() for c in self.checks], "notes": list(self.notes)}


def inspect_pipeline(path: str, storage_options: dict | None = None, *, full: bool = False) -> PipelineReport:
    """Read the status record at ``path`` and the other copies it names; check each copy.

    ``storage_options`` apply to the copies that are not local directories. Raises
    CheckpointError when ``path`` holds neither a status record nor a committed checkpoint.
    """
    storage = CheckpointStorage(path, storage_options)
    notes: list[str] = []
    try:
        here = read_record(storage)
    except CheckpointError as exc:
        here = None
        notes.append(" ".join(str(exc).split()))
    if here is None:
        check = check_copy(storage.url, storage_options, full=full)
        if check.live == "missing" and not notes:
            raise CheckpointError(f"{storage.url} holds neither a raydcp checkpoint nor a pipeline status record")
        if not notes:
            notes.append("no pipeline status record: the checkpoint was not saved through a CheckpointPipeline")
        return PipelineReport(storage.url, None, [check], notes)
    records = [here]
    for i, copy in enumerate(here.tiers):
        if _same(copy.url, storage.url):
            continue
        opts = None if _is_local(copy.url) else storage_options
        try:
            records.append(read_record(CheckpointStorage(copy.url, opts)))
        except CheckpointError as exc:
            notes.append(f"tier {i}: could not read its status record ({' '.join(str(exc).split())})")
    record = freshest(records)
    checks = []
    for i, copy in enumerate(record.tiers):
        opts = None if _is_local(copy.url) else storage_options
        if copy.copy == "committed":
            checks.append(check_copy(copy.url, opts, full=full, tier=i, recorded=copy.copy))
        else:
            checks.append(CopyCheck(i, copy.url, copy.copy, "-"))
    return PipelineReport(storage.url, record, checks, notes)


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _same(a: str, b: str) -> bool:
    strip = lambda u: u.removeprefix("file://").rstrip("/")  # noqa: E731
    return strip(a) == strip(b)
