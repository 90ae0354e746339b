"""Pure policies of the pipeline: tiers, retention per tier, retries with backoff, load order.

Nothing here touches storage or Ray; each decision is a function of plain values.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

from ..errors import CheckpointError
from .status import STATUS_NAME

__all__ = ["Tier", "Retention", "RetryPolicy", "Candidate", "CopyInfo", "load_order", "make_tiers",
           "pipeline_file", "under_retention"]

# the files of a safetensors export (raydcp.convert.files: shard_name and INDEX_NAME)
_EXPORT_FILE = re.compile(r"^safetensors/(?:model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json)$")
_STATUS_FILE = re.compile(rf"^{re.escape(STATUS_NAME)}(?:\.tmp-[0-9a-f]{{16}})?$")

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Retention:
    """Which committed checkpoints a tier keeps; the others are pruned from that tier.

    Scope: the checkpoints directly under the tier's URL that a pipeline saved with a retention
    policy on that tier (:func:`under_retention`); one saved there without the pipeline, or by a
    pipeline without a policy there, is never pruned. A pruned copy loses
    raydcp's and the pipeline's own files only (:func:`pipeline_file`); other files stay.

    ``keep_last=3``: the 3 newest. ``keep_every=10``: those whose sequence number (the pipeline
    counts its saves 1, 2, 3, ...) is a multiple of 10. Both: the union. The newest checkpoint is
    always kept, and so is any checkpoint whose copy is still needed (a pipeline in progress, or a
    tier below the last that holds the only copy because replication failed).
    """

    keep_last: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise CheckpointError(f"Retention({name}={v!r}): it must be an integer >= 1 or None")

    @classmethod
    def of(cls, value: "Retention | Mapping[str, Any] | None") -> "Retention | None":
        if value is None or isinstance(value, Retention):
            return value
        if isinstance(value, Mapping):
            unknown = set(value) - {"keep_last", "keep_every"}
            if unknown:
                raise CheckpointError(f"unknown retention option(s) {sorted(unknown)}: use keep_last and keep_every")
            return cls(**value)
        raise CheckpointError(f"a retention policy is a Retention or a dict like {{'keep_last': 3}}, got {value!r}")

    def select(self, candidates: Sequence["Candidate"]) -> list[str]:
        """Names of the candidates to prune, oldest first."""
        if self.keep_last is None and self.keep_every is None:
            return []
        ordered = sorted(candidates, key=lambda c: (c.seq, c.name))
        newest = {c.name for c in ordered[-(self.keep_last or 1):]}
        return [c.name for c in ordered
                if c.name not in newest and not c.protected
                and not (self.keep_every and c.seq % self.keep_every == 0)]


def pipeline_file(name: str, export_dir: str) -> bool:
    """True if ``name`` (relative to a tier's copy of a checkpoint) is a file the pipeline writes
    beside raydcp's own: the status record (and the temporary file of its atomic publish), the
    shards and index of a safetensors export under ``export_dir``. Retention removes these with
    raydcp's own files (:func:`raydcp.storage.remove_checkpoint`), and nothing else."""
    if _STATUS_FILE.match(name):
        return True
    head, sep, rest = name.partition("/")
    return bool(sep) and head == export_dir and bool(_EXPORT_FILE.match(rest))


def under_retention(stages: Sequence[str], copies: Sequence[str], tier: int, copy_url: str) -> bool:
    """Whether a checkpoint's copy at ``copy_url`` on tier ``tier`` was saved under a retention
    policy of that tier, from its status record: its stage keys (``retention@<tier>``) and the
    URLs of its copies, tier by tier. Only such copies are in the tier's retention scope: one saved
    by a pipeline without a policy there (another run sharing the directory), or with this
    directory as another of its tiers, is never pruned."""
    return (0 <= tier < len(copies) and copies[tier].rstrip("/") == copy_url.rstrip("/")
            and f"retention@{tier}" in set(stages))


@dataclass(frozen=True)
class Candidate:
    """A committed checkpoint on a tier, as retention sees it."""

    name: str
    seq: int
    protected: bool = False


@dataclass(frozen=True)
class Tier:
    """A storage tier: a root directory (local path or fsspec URL) holding one copy per checkpoint."""

    url: str
    storage_options: Mapping[str, Any] | None = None
    retention: Retention | None = None
    node_local: bool = False  # a directory on each node's own disk (a "{node}" in it: the node's id)

    def __post_init__(self) -> None:
        url = os.fspath(self.url) if isinstance(self.url, os.PathLike) else self.url
        if not isinstance(url, str) or not url:
            raise CheckpointError(f"a tier is a non-empty path or fsspec URL, got {self.url!r}")
        if self.node_local and not url.startswith("raynode://"):
            if "://" in url and not url.startswith("file://"):
                raise CheckpointError(f"a node-local tier is a local directory, got {url!r}")
            url = "raynode://" + os.path.abspath(url.removeprefix("file://"))
        object.__setattr__(self, "node_local", self.node_local or url.startswith("raynode://"))
        object.__setattr__(self, "url", url.rstrip("/") or url)
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise CheckpointError(f"storage_options of tier {url} must be a dict, got {type(self.storage_options).__name__}")
        object.__setattr__(self, "retention", Retention.of(self.retention))

    @property
    def is_local(self) -> bool:
        return "://" not in self.url or self.url.startswith("file://")

    def copy_url(self, name: str) -> str:
        return f"{self.url}/{name}"

    def options(self) -> dict | None:
        return dict(self.storage_options) if self.storage_options is not None else None


def make_tiers(tiers: Sequence[Any], retention: Mapping[Any, Any] | Sequence[Any] | None,
               storage_options: Mapping[str, Any] | None) -> tuple[Tier, ...]:
    """Normalize the ``tiers``/``retention``/``storage_options`` arguments of CheckpointPipeline.

    ``tiers``: paths/URLs or :class:`Tier`. ``retention``: a dict keyed by tier index or tier URL,
    or a list aligned with ``tiers``. ``storage_options`` applies to the tiers that are not local
    directories and name none of their own.
    """
    if isinstance(tiers, (str, os.PathLike, Tier)) or not tiers:
        raise CheckpointError("tiers must be a non-empty list of paths, URLs or Tier objects, fastest first")
    out = [t if isinstance(t, Tier) else Tier(t) for t in tiers]
    if len({t.url for t in out}) != len(out):
        raise CheckpointError(f"tiers must be distinct, got {[t.url for t in out]}")
    if retention is not None:
        if isinstance(retention, Mapping):
            items = list(retention.items())
        elif isinstance(retention, (list, tuple)):
            items = list(enumerate(retention))
        else:
            raise CheckpointError("retention must be a dict keyed by tier index or URL, or a list aligned with tiers")
        urls = [t.url for t in out]
        for key, policy in items:
            if isinstance(key, int) and not isinstance(key, bool) and -len(out) <= key < len(out):
                i = key % len(out)
            elif isinstance(key, str) and key.rstrip("/") in urls:
                i = urls.index(key.rstrip("/"))
            else:
                raise CheckpointError(f"retention names tier {key!r}, which is not one of the tiers {urls}")
            out[i] = Tier(out[i].url, out[i].storage_options, Retention.of(policy), out[i].node_local)
    if storage_options is not None:
        if not isinstance(storage_options, Mapping):
            raise CheckpointError("storage_options must be a dict of fsspec options")
        out = [t if t.is_local or t.node_local or t.storage_options is not None
               else Tier(t.url, dict(storage_options), t.retention) for t in out]
    return tuple(_memory_tier(t) for t in out)


def _memory_tier(tier: Tier) -> Tier:
    """A ``raymem://`` tier keeps what the pipeline's retention says (one checkpoint unless told
    otherwise, plus any copy still being replicated): its own ``keep_last`` is turned off, as it
    would release a copy that the next tier is still reading."""
    if not tier.url.startswith("raymem://"):
        return tier
    options = dict(tier.storage_options or {})
    options.setdefault("keep_last", 0)
    return Tier(tier.url, options, tier.retention or Retention(keep_last=1), tier.node_local)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Retries with exponential backoff: ``attempts`` tries, waiting ``initial_s``, then x
    ``multiplier`` each time, at most ``max_s`` (tests use tiny delays)."""

    attempts: int = 5
    initial_s: float = 0.5
    multiplier: float = 2.0
    max_s: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise CheckpointError(f"RetryPolicy(attempts={self.attempts!r}): it must be an integer >= 1")
        if self.initial_s < 0 or self.max_s < 0 or self.multiplier < 1:
            raise CheckpointError("RetryPolicy: delays must be >= 0 and multiplier >= 1")

    def delays(self) -> Iterator[float]:
        """The waits between attempts (``attempts - 1`` of them)."""
        d = self.initial_s
        for _ in range(self.attempts - 1):
            yield min(d, self.max_s)
            d *= self.multiplier

    def call(self, fn: Callable[[], T], *, retryable: Callable[[BaseException], bool] = lambda e: True,
             wait: Callable[[float], bool] | None = None,
             on_retry: Callable[[int, BaseException, float], None] | None = None) -> T:
        """Call ``fn`` until it returns, retrying retryable exceptions after each delay.

        ``wait(seconds)`` sleeps and returns True to give up early (e.g. on shutdown).
        """
        wait = wait or (lambda s: bool(time.sleep(s)))
        delays = self.delays()
        attempt = 1
        while True:
            try:
                return fn()
            except Exception as exc:
                delay = next(delays, None)
                if delay is None or not retryable(exc):
                    raise
                if on_retry is not None:
                    on_retry(attempt, exc, delay)
                if wait(delay):
                    raise
                attempt += 1


@dataclass(frozen=True)
class CopyInfo:
    """What a loader knows of one tier's copy before reading it."""

    tier: int
    committed: bool
    known_damaged: bool = False
    note: str = field(default="", compare=False)


def load_order(copies: Sequence[CopyInfo]) -> list[int]:
    """The tiers to try, in order: committed copies fastest first, copies known to be damaged
    (a failed verification) last, uncommitted copies never."""
    good = [c.tier for c in sorted(copies, key=lambda c: c.tier) if c.committed and not c.known_damaged]
    bad = [c.tier for c in sorted(copies, key=lambda c: c.tier) if c.committed and c.known_damaged]
    return good + bad
