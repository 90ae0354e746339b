"""The reshard driver: check the destination, plan, run the rounds, commit once.

Who runs the ranks is the caller's choice (an *executor*): :class:`ThreadExecutor` runs them as
threads of this process (``raydcp reshard``), ``raydcp.runtime.shard_group.reshard_job.RayExecutor`` as the
actors of a ``ShardGroup`` across a Ray cluster (``jobs/reshard.py``). The driver itself holds
only metadata. Protocol of :func:`reshard_with`:

1. read SRC's metadata; look at DST: if it is committed as this very reshard of this very
   source (same source save id, same options, recorded in the metadata's ``extra``), stop: the
   job is done. A DST committed as something else needs ``overwrite``; a DST holding data files
   but no metadata (an earlier run that failed) is taken over;
2. plan the rounds (:func:`raydcp.reshard.plan.plan_reshard`) and open the round journal in DST:
   a rerun of a failed job resumes after its last finished round;
3. start the executor and run each remaining round (every rank: load its pieces, write them);
   journal each round's records;
4. commit the metadata once, last, over every round (:func:`raydcp.engine.rounds.commit_rounds`),
   which also removes what DST held before.

A failure anywhere before step 4 leaves DST's previous checkpoint, if any, committed and intact.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from ..engine.load import read_metadata
from ..engine.rounds import RoundJournal, RoundRecords, commit_rounds, round_save_id
from ..errors import CheckpointError
from ..storage import CheckpointStorage
from ..storage.commits import LOG_DIR
from ..transport import ThreadTransport
from .plan import ReshardOptions, ReshardPlan, plan_reshard
from .rank import RoundTask, release_round_memory, return_freed_memory, run_round

__all__ = ["ReshardResult", "RoundExecutor", "ThreadExecutor", "reshard_with", "reshard", "EXTRA_KEY"]

EXTRA_KEY = "reshard"  # the key of the destination metadata's ``extra`` that records the job
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ReshardResult:
    src: str
    dst: str
    save_id: str
    source_save_id: str
    source_world_size: int
    world_size: int
    layout: str
    tensors: int
    values: int
    dropped: int
    nbytes: int           # tensor bytes in DST
    rounds: int
    resumed_rounds: int   # rounds a rerun found done by an earlier, failed run
    seconds: float
    noop: bool            # DST already held this reshard: nothing was done
    peak_bytes: int = 0   # the plan's largest round, in tensor bytes per process
    round_seconds: float = 0.0  # spent in the rounds this run did (seconds also counts planning, startup, commit)

    def to_json(self) -> dict:
        return dict(self.__dict__)


class RoundExecutor(Protocol):
    """Runs one round on every rank (:func:`raydcp.reshard.rank.run_round`) and returns rank 0's records."""

    def run(self, task: RoundTask) -> RoundRecords: ...

    def close(self) -> None: ...


class ThreadExecutor:
    """The ranks as threads of this process (ThreadTransport): every rank's pieces in one process."""

    per_process = "sum"

    def __init__(self, world_size: int, timeout_s: float = 600.0):
        self.world_size = world_size
        self.timeout_s = timeout_s
        return_freed_memory()

    def run(self, task: RoundTask) -> RoundRecords:
        transports = ThreadTransport.group(self.world_size, timeout_s=self.timeout_s)
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException | None] = [None] * self.world_size

        def go(r: int) -> None:
            try:
                results[r] = run_round(transports[r], task)
            except BaseException as exc:  # every rank fails together; re-raised below
                errors[r] = exc

        threads = [threading.Thread(target=go, args=(r,), name=f"raydcp-reshard-{r}", daemon=True)
                   for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        release_round_memory()
        failed = [e for e in errors if e is not None]
        if failed:
            raise next((e for e in failed if not isinstance(e, CheckpointError)), failed[0])
        return results[0]

    def close(self) -> None:
        pass


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _check_destination(src_url: str, dst: CheckpointStorage, plan: ReshardPlan, overwrite: bool):
    """Step 1: the committed metadata if DST already holds this job, else None (or raise)."""
    if dst.url.rstrip("/") == src_url.rstrip("/"):
        raise CheckpointError(f"SRC and DST are the same checkpoint ({dst.url}); reshard into another path")
    if dst.is_committed():
        try:
            md = read_metadata(dst.url, dst.storage_options)
        except CheckpointError as exc:
            if overwrite:
                return None
            raise CheckpointError(f"{dst.url} holds a damaged checkpoint ({exc}); pass --overwrite to replace it") \
                from None
        job = md.extra.get(EXTRA_KEY) if isinstance(md.extra, dict) else None
        if isinstance(job, dict) and _same({k: job.get(k) for k in plan.identity()}, plan.identity()):
            return md
        if not overwrite:
            what = "another reshard" if isinstance(job, dict) else "a checkpoint"
            raise CheckpointError(
                f"{dst.url} already holds {what} (save id {md.save_id}), not this reshard of {src_url}; pass "
                "--overwrite to replace it (it stays loadable until the new one commits)")
        return None
    foreign = [f for f in dst.list_files() if not f.startswith(("data/", f"{LOG_DIR}/"))]
    if foreign and not overwrite:
        raise CheckpointError(f"{dst.url} holds files that are not part of a raydcp checkpoint ({', '.join(foreign[:3])}"
                              f"{', ...' if len(foreign) > 3 else ''}); choose an empty destination or pass --overwrite")
    return None


def reshard_with(make_executor: Callable[[], RoundExecutor], per_process: str, src: str, dst: str,
                 options: ReshardOptions, *, src_storage_options: dict | None = None,
                 dst_storage_options: dict | None = None, overwrite: bool = False,
                 progress: Progress | None = None, log: Callable[[str], None] | None = None) -> ReshardResult:
    """Reshard SRC into DST (see the module doc); ``make_executor`` is called only if there is work."""
    t0 = time.perf_counter()
    say = log or (lambda msg: None)
    src_md = read_metadata(src, src_storage_options)
    src_url = CheckpointStorage(src, src_storage_options).url
    dst_store = CheckpointStorage(dst, dst_storage_options)
    plan = plan_reshard(src_md, options, per_process=per_process)
    layout = "consolidated" if options.consolidate else options.layout

    spent = 0.0

    def result(save_id: str, resumed: int, noop: bool) -> ReshardResult:
        return ReshardResult(src_url, dst_store.url, save_id, src_md.save_id, src_md.world_size, options.world_size,
                             layout, len(plan.tensors), len(plan.values), len(plan.dropped), plan.nbytes,
                             len(plan.rounds), resumed, time.perf_counter() - t0, noop,
                             max((r.peak_bytes for r in plan.rounds), default=0), spent)

    done_md = _check_destination(src_url, dst_store, plan, overwrite)
    if done_md is not None:
        say(f"{dst_store.url} already holds this reshard of {src_url} (save id {done_md.save_id}): nothing to do")
        return result(done_md.save_id, 0, True)

    job = {**plan.identity(), "source": src_url, "memory_budget": options.memory_budget,
           "max_file_bytes": options.max_file_bytes, "compression": options.compression, "per_process": per_process}
    journal = RoundJournal(dst_store.url, job, dst_storage_options)
    total = plan.nbytes
    done_bytes = sum(journal.done[r.index].nbytes for r in plan.rounds if r.index in journal.done)
    if journal.done:
        say(f"resuming an earlier run: {len(journal.done)} of {len(plan.rounds)} rounds already written")
    say(f"reshard {src_url} ({src_md.world_size} ranks) -> {dst_store.url} ({options.world_size} ranks, {layout}): "
        f"{len(plan.tensors)} tensors, {_mib(total)}, {len(plan.rounds)} rounds of at most "
        f"{_mib(max((r.peak_bytes for r in plan.rounds), default=0))} per process")
    if progress:
        progress(done_bytes, total)
    records: dict[int, RoundRecords] = {i: r for i, r in journal.done.items() if i < len(plan.rounds)}
    todo = [r for r in plan.rounds if r.index not in records]
    if todo:
        journal.start()
        executor = make_executor()
        try:
            for rnd in todo:
                t1 = time.perf_counter()
                task = RoundTask(src_url, dst_store.url, round_save_id(journal.save_id, rnd.index), options.layout,
                                 options.world_size, rnd, options.save_options, src_storage_options,
                                 dst_storage_options)
                rec = executor.run(task)
                journal.record(rnd.index, rec)
                records[rnd.index] = rec
                done_bytes += rnd.nbytes
                dt = time.perf_counter() - t1
                spent += dt
                say(f"round {rnd.index + 1}/{len(plan.rounds)}: {len(rnd.parts)} parts, {_mib(rnd.nbytes)} in "
                    f"{dt:.2f} s ({_mib(rnd.nbytes / dt if dt > 0 else 0)}/s); {100 * done_bytes / max(total, 1):.0f}% done")
                if progress:
                    progress(done_bytes, total)
        finally:
            executor.close()
    extra = {EXTRA_KEY: {**plan.identity(), "source": src_url, "source_world_size": src_md.world_size,
                         "rounds": len(plan.rounds), "dropped": len(plan.dropped)}}
    md = commit_rounds(dst_store.url, journal.save_id, options.world_size, [records[r.index] for r in plan.rounds],
                       plan.tensors, plan.values, placement=plan.placement, extra=extra,
                       storage_options=dst_storage_options)
    say(f"committed {dst_store.url} (save id {md.save_id})")
    return result(md.save_id, len(plan.rounds) - len(todo), False)


def reshard(src: str, dst: str, options: ReshardOptions, *, src_storage_options: dict | None = None,
            dst_storage_options: dict | None = None, overwrite: bool = False, timeout_s: float = 600.0,
            progress: Progress | None = None, log: Callable[[str], None] | None = None) -> ReshardResult:
    """Reshard in this process: the ranks are threads (``options.memory_budget`` bounds their sum)."""
    return reshard_with(lambda: ThreadExecutor(options.world_size, timeout_s), ThreadExecutor.per_process, src, dst,
                        options, src_storage_options=src_storage_options, dst_storage_options=dst_storage_options,
                        overwrite=overwrite, progress=progress, log=log)


def _mib(n: float) -> str:
    """A byte count for messages: ``512 B``, ``3.0 KiB``, ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
