"""The pipeline's configuration (validated at construction) and its runner seam."""
from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Protocol, Sequence

from ..convert.keys import KeySelection
from ..errors import CheckpointError
from .policy import RetryPolicy, Tier
from .status import StatusRecord, TierCopy, plan_stages

__all__ = ["PipelineConfig", "Runner", "ThreadRunner", "EXPORTS", "hook_name"]

EXPORTS = ("safetensors",)
EXPORT_DIR = "export"


def hook_name(hook: Any) -> str:
    fn = getattr(hook, "_function", hook)  # a Ray remote function wraps the Python one
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(hook).__name__


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """Everything the pipeline driver needs; picklable (it travels to the coordinator actor).

    ``hooks`` are callables ``hook(info: dict)`` or Ray remote functions, run after commit on the
    cluster; ``on_event(event: dict)`` is told of every stage start, end and progress step.
    ``export_keys``: the keys the export keeps, under which names, in which dtype (a
    :class:`raydcp.convert.KeySelection`, or a dict of its fields), as ``raydcp convert``'s
    ``--drop-optimizer``, ``--drop``, ``--strip-prefix``, ``--dtype`` and ``--dtype-all`` do;
    None exports every tensor as saved.
    """

    tiers: tuple[Tier, ...]
    verify: bool = True
    export: str | None = None
    export_tier: int = -1
    export_keys: KeySelection | None = None
    hooks: tuple[Any, ...] = ()
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    part_bytes: int = 64 << 20
    max_parallel: int = 8
    on_event: Callable[[dict], None] | None = None

    def __post_init__(self) -> None:
        if not self.tiers or not all(isinstance(t, Tier) for t in self.tiers):
            raise CheckpointError("PipelineConfig.tiers must be a non-empty tuple of Tier")
        if self.export is not None and self.export not in EXPORTS:
            raise CheckpointError(f"export={self.export!r} is not supported; use one of {EXPORTS} or None")
        n = len(self.tiers)
        if not isinstance(self.export_tier, int) or not -n <= self.export_tier < n:
            raise CheckpointError(f"export_tier={self.export_tier!r} is not a tier index (there are {n} tiers)")
        object.__setattr__(self, "export_tier", self.export_tier % n)
        object.__setattr__(self, "export_keys", _key_selection(self.export_keys))
        if self.export_keys is not None and self.export is None:
            raise CheckpointError("export_keys selects the keys of an export: it needs export='safetensors'")
        for h in self.hooks:
            if not callable(h) and not hasattr(h, "remote"):
                raise CheckpointError(f"a hook must be a callable or a Ray remote function, got {h!r}")
        if not isinstance(self.part_bytes, int) or self.part_bytes < 1:
            raise CheckpointError(f"part_bytes must be a positive integer, got {self.part_bytes!r}")
        if not isinstance(self.max_parallel, int) or self.max_parallel < 1:
            raise CheckpointError(f"max_parallel must be a positive integer, got {self.max_parallel!r}")
        if not isinstance(self.retry, RetryPolicy):
            raise CheckpointError("retry must be a raydcp.pipeline.RetryPolicy")

    @property
    def hook_names(self) -> tuple[str, ...]:
        names: list[str] = []
        for h in self.hooks:
            base = hook_name(h)
            name, i = base, 2
            while name in names:
                name, i = f"{base}#{i}", i + 1
            names.append(name)
        return tuple(names)

    def export_url(self, name: str) -> str | None:
        if self.export is None:
            return None
        return f"{self.tiers[self.export_tier].copy_url(name)}/{EXPORT_DIR}/{self.export}"

    def new_record(self, name: str, seq: int, *, step: int | None = None, node_id: str | None = None) -> StatusRecord:
        stages = plan_stages(
            len(self.tiers), verify=self.verify, export_tier=self.export_tier if self.export else None,
            hooks=self.hook_names, retention_tiers=[i for i, t in enumerate(self.tiers) if t.retention is not None])
        return StatusRecord(name=name, seq=seq, step=step, node_id=node_id,
                            tiers=[TierCopy(t.copy_url(name)) for t in self.tiers], stages=stages)


def _key_selection(value: Any) -> KeySelection | None:
    """``export_keys`` as a KeySelection: one as is, a dict of its fields built into one."""
    if value is None or isinstance(value, KeySelection):
        return value
    if not isinstance(value, Mapping):
        raise CheckpointError(f"export_keys must be a raydcp.convert.KeySelection, a dict of its fields or None, "
                              f"got {type(value).__name__}")
    known = [f.name for f in fields(KeySelection)]
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise CheckpointError(f"export_keys has unknown field(s) {', '.join(unknown)}; the fields are "
                              f"{', '.join(known)}")
    args = {k: tuple([v] if isinstance(v, str) else v) if k in ("drop_prefixes", "strip_prefixes") else v
            for k, v in value.items()}
    return KeySelection(**args)


class Runner(Protocol):
    """Runs the pipeline's work items in parallel; the driver calls it from its own thread.

    ``map`` calls ``fn(item)`` for every item, calls ``on_result(result)`` in the caller's
    thread as each finishes, and returns the results in order; if any call fails, the rest are
    cancelled where possible and the first error is raised. ``node_id`` asks for the items to run
    on that node (where the source copy lives), if the runner can place work.
    """

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any], on_result: Callable[[Any], None] | None = None,
            *, node_id: str | None = None) -> list: ...

    def call_hook(self, hook: Any, info: dict) -> None: ...

    def close(self) -> None: ...


class ThreadRunner:
    """The in-process runner: a thread pool (storage I/O releases the GIL)."""

    def __init__(self, max_parallel: int = 8):
        self._pool = cf.ThreadPoolExecutor(max_parallel, thread_name_prefix="raydcp-pipeline")

    def map(self, fn, items, on_result=None, *, node_id=None) -> list:
        futures = {self._pool.submit(fn, item): i for i, item in enumerate(items)}
        results: list = [None] * len(futures)
        error: BaseException | None = None
        for fut in cf.as_completed(futures):
            try:
                results[futures[fut]] = r = fut.result()
            except BaseException as exc:
                if error is None:
                    error = exc
                    for other in futures:
                        other.cancel()
                continue
            if on_result is not None and error is None:
                on_result(r)
        if error is not None:
            raise error
        return results

    def call_hook(self, hook, info) -> None:
        hook(info)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
