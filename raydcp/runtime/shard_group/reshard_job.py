"""Reshard jobs on a Ray cluster: the ranks of each round are the actors of a ``raydcp.ShardGroup``.

``jobs/reshard.py`` (``ray job submit -- python jobs/reshard.py SRC DST --world-size M``) calls
:func:`main`. The work is the one of :mod:`raydcp.reshard` (plan, rounds, one commit); this module
only supplies the executor:

1. :class:`RayExecutor` starts ``ShardGroup(M)`` -- only once the driver knows there is work to
   do. Its actors reserve one CPU each by default (a reshard moves bytes: it needs CPUs, memory
   and network, not GPUs); ``--num-gpus-per-actor 1`` places one per GPU instead;
2. for each round, every actor runs :func:`raydcp.reshard.run_round` (through ``apply``) over
   the job's ``raydcp.Group`` (one operation, so one coordinator actor, for all rounds): its
   pieces are loaded from storage (each source byte read by one actor; pieces move through the
   object store) and written as the round's files; the driver gathers every actor's outcome and
   raises one CheckpointError naming failed or dead ranks (a failed round is not retried here:
   a rerun of the job resumes after the last finished round);
3. ``close`` records each actor's peak resident memory (and how much of it is object-store
   pages, shared by the node), then shuts the group down.

The driver (the job's entrypoint) holds only metadata; tensor data lives in the actors, at most
``--memory-budget`` bytes of it in each at a time.
"""
from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import time
import uuid
from typing import Any, Sequence

import ray

from ...engine.rounds import RoundRecords
from ...errors import CheckpointError
from ...group import Group
from ...reshard import ReshardOptions, ReshardResult, RoundTask, reshard_with, run_round
from ...reshard.rank import release_round_memory, return_freed_memory
from ...reshard.args import add_reshard_arguments, options_from_args, storage_options_from_args
from ..outcomes import gather_outcomes
from ..ray_transport import open_transport
from .group import ShardGroup

__all__ = ["RayExecutor", "reshard_on_ray", "build_parser", "main"]

log = logging.getLogger(__name__)

_GRACE_S = 30.0  # once a rank failed, how long the driver waits for the others' outcomes


# Per actor process: the open transport of each running job. One Group operation (one
# coordinator actor) serves every round of a job, rather than starting a coordinator per round.
_TRANSPORTS: dict[str, Any] = {}


def _rank_round(state: dict, name: str, rank: int, world_size: int, timeout_s: float, task: RoundTask):
    """Runs in actor ``rank`` (``ShardActor.apply``): one round; a CheckpointError is returned, not raised."""
    transport = _TRANSPORTS.get(name)
    if transport is None:
        return_freed_memory()
        transport = _TRANSPORTS[name] = open_transport(Group(name, rank, world_size, timeout_s=timeout_s))
    try:
        return run_round(transport, task)
    except CheckpointError as exc:  # the operation failed on every rank: it cannot go on
        _close_job(state, name)
        return exc
    finally:
        release_round_memory()


def _close_job(state: dict, name: str) -> None:
    transport = _TRANSPORTS.pop(name, None)
    if transport is not None:
        transport.close()


def _memory(state: dict) -> tuple[int, int]:
    """Runs in an actor: ``(peak RSS, shared-memory RSS now)`` in bytes, from /proc/self/status.

    VmHWM, unlike getrusage's figure, does not start from the high-water mark of the process that
    forked this one. The shared part is mostly object-store pages this actor touched: node-wide
    memory, bounded by the object store's size, not the actor's own.
    """
    peak = shared = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
                elif line.startswith("RssShmem:"):
                    shared = int(line.split()[1]) * 1024
    except OSError:
        pass
    return peak or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, shared


class RayExecutor:
    """The ranks of every round are the actors of one ShardGroup (see the module doc)."""

    per_process = "max"

    def __init__(self, world_size: int, *, num_gpus_per_actor: float = 0, num_cpus_per_actor: float = 1,
                 timeout_s: float = 600.0):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.group = ShardGroup(world_size, num_gpus_per_actor=num_gpus_per_actor,
                                num_cpus_per_actor=num_cpus_per_actor, timeout_s=timeout_s)
        try:
            self.group.info  # wait until every actor is up, so that the rounds' times are the work's
        except BaseException:
            self.group.shutdown()
            raise
        self.peak_rss: list[int] = []    # per actor, filled by close()
        self.shared_rss: list[int] = []  # the part of it in shared memory (object-store pages)
        self._name = f"reshard-{uuid.uuid4().hex[:12]}"

    def run(self, task: RoundTask) -> RoundRecords:
        refs = {r: a.apply.remote(_rank_round, self._name, r, self.world_size, self.timeout_s, task)
                for r, a in enumerate(self.group.actors)}
        # a dead actor: the round cannot finish, the others would only wait for it to time out
        out = gather_outcomes(refs, grace_s=_GRACE_S, stop_on_dead=True)
        if not out.ok or len(out.results) < self.world_size:
            raise out.error(f"reshard round {task.round.index + 1}", sep="; ",
                            then="; nothing was committed, rerun the job to resume after the last finished round")
        return out.results[0]

    def close(self) -> None:
        try:
            refs = [a.apply.remote(_close_job, self._name) for a in self.group.actors]
            ray.wait(refs, num_returns=len(refs), timeout=30)
            refs = [a.apply.remote(_memory) for a in self.group.actors]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10)
            figures = [ray.get(r) for r in ready]
            self.peak_rss = [p for p, _ in figures]
            self.shared_rss = [s for _, s in figures]
        except Exception:  # a dead actor: no figure, still shut down
            pass
        self.group.shutdown()


def reshard_on_ray(src: str, dst: str, options: ReshardOptions, *, num_gpus_per_actor: float = 0,
                   num_cpus_per_actor: float = 1, timeout_s: float = 600.0, src_storage_options: dict | None = None,
                   dst_storage_options: dict | None = None, overwrite: bool = False,
                   progress=None, log=None, address: str | None = None) -> tuple[ReshardResult, list[int]]:
    """Reshard on a Ray cluster; returns the result and each actor's peak RSS (bytes).

    Connects to Ray (``address``, default RAY_ADDRESS or a new local instance) only if there is
    work: a destination that already holds the result, or a bad source, never touches Ray.
    """
    executors: list[RayExecutor] = []

    def make() -> RayExecutor:
        if not ray.is_initialized():
            ray.init(address=address, logging_level=logging.WARNING)
        executors.append(RayExecutor(options.world_size, num_gpus_per_actor=num_gpus_per_actor,
                                     num_cpus_per_actor=num_cpus_per_actor, timeout_s=timeout_s))
        return executors[0]

    result = reshard_with(make, RayExecutor.per_process, src, dst, options, src_storage_options=src_storage_options,
                          dst_storage_options=dst_storage_options, overwrite=overwrite, progress=progress, log=log)
    if executors and log and executors[0].peak_rss:
        log("peak resident memory per actor: " + ", ".join(
            f"{p / (1 << 20):.0f} MiB" for p in executors[0].peak_rss)
            + f" (of which object-store pages, shared by the node: up to "
              f"{max(executors[0].shared_rss) / (1 << 20):.0f} MiB)")
    return result, (executors[0].peak_rss if executors else [])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jobs/reshard.py",
        description="Reshard a raydcp checkpoint on a Ray cluster, streaming in rounds that fit --memory-budget "
                    "per actor. Idempotent: a rerun after a failure resumes it; a rerun after success does nothing. "
                    "Submit with: ray job submit --working-dir . -- python jobs/reshard.py SRC DST --world-size M",
    )
    add_reshard_arguments(parser)
    parser.add_argument("--num-cpus-per-actor", type=float, default=1.0, metavar="C",
                        help="CPUs reserved per actor (default 1): a reshard moves bytes, it needs CPUs, memory "
                             "and network rather than GPUs")
    parser.add_argument("--num-gpus-per-actor", type=float, default=0.0, metavar="G",
                        help="GPUs reserved per actor (default 0); 1 places one actor per GPU, as training does "
                             "(tensors stay in host memory either way)")
    parser.add_argument("--address", default=None,
                        help="the Ray cluster to connect to (default: RAY_ADDRESS, as `ray job submit` sets it, "
                             "or a new local instance)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line at the end")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The job's entrypoint; returns the exit status (0 done, 2 a CheckpointError, shown on one line)."""
    args = build_parser().parse_args(argv)

    def say(msg: str) -> None:
        print(f"[raydcp reshard {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    try:
        options = options_from_args(args)
        src_opts, dst_opts = storage_options_from_args(args)
        result, peaks = reshard_on_ray(args.src, args.dst, options, num_gpus_per_actor=args.num_gpus_per_actor,
                                       num_cpus_per_actor=args.num_cpus_per_actor, timeout_s=args.timeout, src_storage_options=src_opts,
                                       dst_storage_options=dst_opts, overwrite=args.overwrite, log=say,
                                       address=args.address)
    except CheckpointError as exc:
        msg = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"raydcp reshard: error: {msg}", file=sys.stderr, flush=True)
        return 2
    if not result.noop:
        say(f"done: {result.tensors} tensors, {result.nbytes / (1 << 20):.1f} MiB in {result.rounds} rounds "
            f"({result.resumed_rounds} resumed), {result.seconds:.2f} s")
    if args.json:
        print(json.dumps({**result.to_json(), "peak_rss_per_actor": peaks}), flush=True)
    return 0
