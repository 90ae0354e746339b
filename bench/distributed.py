"""Distributed save and load: raydcp on Ray actors against torch DCP on gloo processes, same data, same run.

Data, FSDP-style: every global tensor is split along dimension 0 and rank r holds ``torch.chunk``
piece r of each (a DTensor with Shard(0) for DCP, a ``raydcp.Shard`` for raydcp):
  large  --mib MiB (default 512) in 64 float32 tensors, 4 ranks
  small  --small (default 4096) float32 tensors of 4 x 64 elements: 64 floats per rank, 4 ranks

Scenarios (each library, every repeat):
  (1) save        4 ranks save the large set
  (2) load 4->4   the same 4 ranks load it back (same sharding)
  (3) load 4->3   the first 3 ranks load it, each holding chunk r of 3 (resharded on load)
  (4) reshard 4->6  raydcp: ShardGroup(4) holding the state -> .reshard(6), in memory; the new
                  group keeps the 4 actors and adds 2, started ahead with ``prepare_reshard(6)``,
                  which also has every actor allocate its new pieces (untimed, as DCP's processes
                  and their tensors are): "(prepared) object store" moves the pieces through Ray's
                  object store, "(prepared) RDT" by Ray Direct Transport (gloo between these CPU
                  actors; its collective group made by prepare_reshard too); "+start": the object
                  store one with the call starting the 2 added actors and allocating the pieces
                  itself (timed); DCP: save by the 4 ranks + resharded load onto 6 ranks (the save
                  of (1), then a load)
  (5) small       4 ranks save and load the small set
  (6) first operation of a Group (raydcp only): the large save by the 4 ranks, and the save of a
      tiny state (4 tensors of 48 x 8 floats: fixed costs only), each
      warm        on the group the ranks have used since the warm-up
      cold group  on a Group name never used before (a new one each repeat)
      host not started  on a new Group name right after the cluster's coordinator host was killed
                  (and waited for until dead), so the operation starts it, as the first operation
                  in a fresh Ray instance does; cold and warm alternate in order each repeat.
                  The very first operation of the run (the warm-up's first save, small) is
                  reported too: it also pays the ranks' own first raydcp call

Peers, at equal durability (data fsynced before the checkpoint commits):
  torch DCP  6 processes in one gloo world on 127.0.0.1 (``dist.init_process_group("gloo")``),
             spawned once and kept for every repeat, so no process start is timed; an operation on
             N ranks runs on the first N, holding DTensors on DeviceMesh("cpu", [0..N-1]) and using
             that mesh's process group: ``dcp.save(state, storage_writer=FileSystemWriter(dir))``
             (sync_files=True, its default) and ``dcp.load`` into the DTensors, with barriers around;
             its time is the slowest rank's
  raydcp     4 Ray actors, each keeping one ``raydcp.Group`` per world size it takes part in (the
             4->3 load runs on the first 3 of them, as DCP's does), so each group's coordinator
             host actor starts on the warm-up operation; ``raydcp.save``/``raydcp.load`` timed from
             the driver (``ray.get`` over the actors); (4) is ``ShardGroup.reshard(6)``

The disk's write limit, beside (1) (``bench/_disk_limit.py``; not with --only reshard): 4 plain
processes, started once, write the layout of raydcp's save of the large set (the same files and
bytes, written in the same number of threads per process, every file fsynced, then an atomic
publish of a metadata file of the same size) without raydcp, each repeat three ways: a plain
``write`` + ``fsync`` (what DCP's writer does), 4 MiB writes each followed by the start of its
writeback (``sync_file_range``) + ``fsync``, and ``O_DIRECT``. The fastest way's median is the
limit, and the save's goal is a share of it.

The tensors a rank saves are the ones it loads into (as in training): they are refilled with its
values before each save and with NaN before each load (untimed), and every loaded value is
compared with what was saved, for both libraries. Both libraries warm up (imports, connections,
coordinator actors) before timing. Before each timed operation of either library the driver
touches and frees 1 GiB (untimed, ``_util.refill_free_memory``): this VM hands memory that stayed
free a few seconds back to the hypervisor, and whichever process touches it first then pays host
page faults, which depends on what ran before, not on the library. Each repeat runs every scenario
with one library, then the other; the order rotates from repeat to repeat, so both find their files in the page cache alike.
Medians of --repeats; ratios are DCP time / raydcp time.

    python bench/distributed.py                                  # full size, a few minutes on 2 cores
    python bench/distributed.py --mib 64 --small 512 --repeats 1 # quick
    python bench/distributed.py --profile                        # + cProfile of raydcp inside an actor
    python bench/distributed.py --first-op-only                  # only (6), raydcp alone
    python bench/distributed.py --only reshard --breakdown       # (4) alone, + where a reshard's time goes
    python bench/distributed.py --only save --repeats 7          # (1) alone, against the disk's write limit

``--breakdown`` prints, for the prepared reshards (medians over the repeats, seconds from the
reshard call): the driver's planning and task submission, when the senders' publish steps ended,
when the first and last message reached a receiver, the receivers' busiest time in local copies,
copies out of messages, waiting and fetching, and when the last receiver and the call itself ended.
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import os
import pstats
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import uuid
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _disk_limit import WAYS, DiskSide, layout_of  # noqa: E402
from _util import (LoadRange, argv_line, goal, log, machine, median, refill_free_memory, save_json,  # noqa: E402
                   stop_processes, table)

MIB = 1 << 20
GB = 1e9
N_LARGE = 64
COLS = 1024
SMALL_PER_RANK = 64
SAVERS = 4
RESHARD_LOAD = 3
RESHARD_MEM = 6
CMD_TIMEOUT_S = 900.0

# ----------------------------------------------------------------------------- data (shared by both sides)
# A data set is {fqn: global shape}; values are a cheap function of (tensor index, element index), so
# every rank builds or checks exactly its own piece without holding the whole tensor.


def dataset(kind: str, mib: int, small: int) -> dict[str, tuple[int, ...]]:
    if kind == "large":
        rows = max(1, mib * MIB // N_LARGE // 4 // COLS)
        return {f"layers.{i}.weight": (rows, COLS) for i in range(N_LARGE)}
    if kind == "small":
        return {f"blocks.{i // 64}.p{i % 64}": (SAVERS * SMALL_PER_RANK,) for i in range(small)}
    if kind == "warm":
        return {f"warm.{i}": (48, 8) for i in range(4)}
    raise ValueError(kind)


def chunk_rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rows [lo, hi) of ``torch.chunk(t, world)[rank]`` (empty past the last piece)."""
    step = -(-n // world)
    lo = min(rank * step, n)
    return lo, min(lo + step, n)


def values(i: int, shape: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of global tensor number ``i``: exact float32 values that differ by position."""
    inner = 1
    for s in shape[1:]:
        inner *= s
    idx = torch.arange(lo * inner, hi * inner, dtype=torch.int64)
    v = (idx * 2654435761 + (i + 1) * 40503) % 65521
    return ((v.to(torch.float32) - 32760.0) / 64.0).reshape((hi - lo, *shape[1:]))


def pieces(spec: dict, world: int, rank: int):
    """(index, fqn, global shape, lo, hi) of ``rank``'s piece of every tensor."""
    for i, (fqn, shape) in enumerate(spec.items()):
        lo, hi = chunk_rows(shape[0], world, rank)
        yield i, fqn, shape, lo, hi


def count_bad(spec: dict, world: int, rank: int, local: dict) -> int:
    """How many of ``rank``'s pieces in ``local`` ({fqn: tensor}) differ from the saved values."""
    return sum(not torch.equal(local[fqn], values(i, shape, lo, hi))
               for i, fqn, shape, lo, hi in pieces(spec, world, rank))


def nbytes(spec: dict) -> int:
    total = 0
    for shape in spec.values():
        n = 4
        for s in shape:
            n *= s
        total += n
    return total


# ----------------------------------------------------------------------------- torch DCP: gloo worker processes
# One pool of max(world sizes) processes in one gloo world, started once. Every rank builds the
# 1-D meshes of the first 4, 3 and 6 ranks; an operation "onto w ranks" runs on the mesh of the
# first w, with that mesh's process group (the others answer at once and wait for the next one).

def _dcp_worker(rank: int, world: int, port: int, conn, specs: dict, worlds: tuple) -> None:
    """One DCP rank: joins the gloo group once, then runs the driver's commands until "quit"."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=CMD_TIMEOUT_S))
    meshes = {w: DeviceMesh("cpu", list(range(w))) for w in worlds}
    states: dict[tuple[str, int], dict] = {}  # (kind, w) -> DTensors; the same tensors are saved and loaded into

    def state(kind: str, w: int) -> dict:
        if (kind, w) not in states:
            out = {}
            for _, fqn, shape, lo, hi in pieces(specs[kind], w, rank):
                local = torch.empty((hi - lo, *shape[1:]))
                stride = tuple(int(torch.tensor(shape[d + 1:]).prod()) for d in range(len(shape)))
                out[fqn] = DTensor.from_local(local, meshes[w], [Shard(0)], run_check=False,
                                              shape=torch.Size(shape), stride=stride)
            states[kind, w] = out
        return states[kind, w]

    conn.send(("ready", os.getpid(), 0))
    while True:
        cmd, kind, path, w = conn.recv()
        if cmd == "quit":
            break
        try:
            if rank >= w:
                conn.send(("ok", 0.0, 0))
                continue
            st, pg = state(kind, w), meshes[w].get_group()
            if cmd == "save":  # untimed: this rank's values into the tensors
                for i, fqn, shape, lo, hi in pieces(specs[kind], w, rank):
                    st[fqn].to_local().copy_(values(i, shape, lo, hi))
                op = lambda: dcp.save(st, storage_writer=dcp.FileSystemWriter(path), process_group=pg)  # noqa: E731
            elif cmd == "load":  # untimed: NaN, so that a load that writes nothing fails verification
                for d in st.values():
                    d.to_local().fill_(float("nan"))
                op = lambda: dcp.load(st, storage_reader=dcp.FileSystemReader(path), process_group=pg)  # noqa: E731
            else:
                raise ValueError(cmd)
            dist.barrier(group=pg)
            t0 = time.perf_counter()
            op()
            t = time.perf_counter() - t0
            dist.barrier(group=pg)
            bad = count_bad(specs[kind], w, rank, {k: v.to_local() for k, v in st.items()}) if cmd == "load" else 0
            conn.send(("ok", t, bad))
        except Exception:
            conn.send(("error", traceback.format_exc(), 0))
    dist.destroy_process_group()
    conn.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DcpPool:
    """The gloo processes; ``run`` has the first w run one command and returns the slowest rank's time."""

    def __init__(self, specs: dict, worlds: tuple):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.world = max(worlds)
        port = _free_port()
        self.conns, self.procs = [], []
        for r in range(self.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_dcp_worker, args=(r, self.world, port, child, specs, worlds), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self._recv_all("start")

    def _recv_all(self, what: str) -> list:
        out = []
        for r, c in enumerate(self.conns):
            if not c.poll(CMD_TIMEOUT_S):
                raise RuntimeError(f"DCP rank {r}: no answer to {what} within {CMD_TIMEOUT_S:g}s")
            msg = c.recv()
            if msg[0] == "error":
                raise RuntimeError(f"DCP rank {r} failed {what}:\n{msg[1]}")
            out.append(msg)
        return out

    def run(self, cmd: str, kind: str, path: str, w: int) -> tuple[float, int]:
        refill_free_memory()
        for c in self.conns:
            c.send((cmd, kind, path, w))
        answers = self._recv_all(f"{cmd} {kind} on {w} ranks")
        return max(a[1] for a in answers), sum(a[2] for a in answers)

    def close(self) -> None:
        stop_processes(self.conns, self.procs, ("quit", None, None, 0))


# ----------------------------------------------------------------------------- raydcp: Ray actors

class Rank:
    """One raydcp rank (a Ray actor, see RayDcpSide): its pieces, and one Group per world size it is
    part of (rank r of the 4 savers, and of the 3 loaders for r < 3), each kept for every operation."""

    def __init__(self, rank: int, worlds: tuple, specs: dict):
        import raydcp

        self.raydcp = raydcp
        self.rank, self.specs = rank, specs
        self.groups = {w: raydcp.Group(f"bench-dist-{w}", rank, w, timeout_s=CMD_TIMEOUT_S) for w in worlds if rank < w}
        self.states: dict[tuple[str, int], dict] = {}  # (kind, w) -> Shards; the same tensors are saved and loaded into
        self.profile: cProfile.Profile | None = None

    def prepare(self, kind: str, w: int, what: str) -> int:
        """Untimed: this rank's values into its pieces (before a save), or NaN (before a load)."""
        if (kind, w) not in self.states:
            self.states[kind, w] = {
                fqn: self.raydcp.Shard(torch.empty((hi - lo, *shape[1:])), (lo,) + (0,) * (len(shape) - 1), shape)
                for _, fqn, shape, lo, hi in pieces(self.specs[kind], w, self.rank)}
        st = self.states[kind, w]
        if what == "save":
            for i, fqn, shape, lo, hi in pieces(self.specs[kind], w, self.rank):
                st[fqn].tensor.copy_(values(i, shape, lo, hi))
        else:
            for s in st.values():
                s.tensor.fill_(float("nan"))
        return os.getpid()

    def save(self, kind: str, w: int, path: str) -> dict:
        return self._op(lambda: self.raydcp.save(self.states[kind, w], path, group=self.groups[w]))

    def load(self, kind: str, w: int, path: str) -> dict:
        return self._op(lambda: self.raydcp.load(self.states[kind, w], path, group=self.groups[w]))

    def save_as(self, kind: str, w: int, path: str, group_name: str) -> dict:
        """A save under a Group named ``group_name`` (a name never used before: a cold group)."""
        group = self.raydcp.Group(group_name, self.rank, w, timeout_s=CMD_TIMEOUT_S)
        return self._op(lambda: self.raydcp.save(self.states[kind, w], path, group=group))

    def _op(self, fn) -> dict:
        t0 = time.perf_counter()
        if self.profile is not None:
            self.profile.enable()
        try:
            out = fn()
        finally:
            if self.profile is not None:
                self.profile.disable()
        res = {"seconds": time.perf_counter() - t0}
        if hasattr(out, "bytes_read"):
            res.update(bytes_read=out.bytes_read, bytes_needed=out.bytes_needed)
        return res

    def verify(self, kind: str, w: int) -> int:
        return count_bad(self.specs[kind], w, self.rank, {k: s.tensor for k, s in self.states[kind, w].items()})

    def set_profile(self, on: bool):
        """Start (on) or stop profiling the operations; stopping returns the summary."""
        if on:
            self.profile = cProfile.Profile()
            return None
        prof, self.profile = self.profile, None
        return _profile_summary(prof)

    def use_groups(self, prefix: str) -> None:
        """Take part in the groups ``{prefix}-{w}`` from now on (for the profiled operations)."""
        self.groups = {w: self.raydcp.Group(f"{prefix}-{w}", self.rank, w, timeout_s=CMD_TIMEOUT_S)
                       for w in self.groups}


_RAY_FUNCS = {"get_objects", "put_object", "_actor_method_call", "deserialize_objects"}


def _profile_summary(prof: "cProfile.Profile | pstats.Stats") -> dict[str, tuple[float, float, int]]:
    """{function: (cumulative s, own s, calls)} for raydcp's functions, the builtins and Ray's get/put."""
    out: dict[str, tuple[float, float, int]] = {}
    stats = prof if isinstance(prof, pstats.Stats) else pstats.Stats(prof)
    for (fn, _, name), (_, nc, tt, ct, _) in stats.stats.items():
        if "raydcp/" in fn:
            label = fn[fn.rindex("raydcp/"):] + ":" + name
        elif fn == "~":
            label = name
        elif name in _RAY_FUNCS or "dataclasses.py" in fn and name.startswith("_dataclass_"):
            label = fn.rsplit("/", 1)[-1] + ":" + name
        else:
            continue
        c, t, n = out.get(label, (0.0, 0.0, 0))
        out[label] = (c + ct, t + tt, n + nc)
    return out


def _profile_table(cols: dict[str, dict], top: int = 20) -> str:
    """Functions by the largest cumulative time in any process; one column per process."""
    labels = {k for c in cols.values() for k in c}
    ranked = sorted(labels, key=lambda k: -max(c.get(k, (0.0,))[0] for c in cols.values()))[:top]
    rows = [[k, *[c[k][0] if k in c else None for c in cols.values()]] for k in ranked]
    return table(["function: cumulative s (profiled)", *cols], rows)


def _profiling_host_cls():
    """raydcp's coordinator host, profiling on request its event-loop thread and the worker threads
    where the reductions run (decoding the plans, planning, encoding the replies)."""
    from raydcp.runtime.coordinator_host import CoordinatorHost

    class ProfilingCoordinatorHost(CoordinatorHost):
        prof = None
        reductions: list = []

        async def prof_start(self) -> None:
            self.reductions = []
            self.prof = cProfile.Profile()
            self.prof.enable()

        async def prof_stop(self) -> dict:
            self.prof.disable()
            stats = pstats.Stats(self.prof)
            for p in self.reductions:
                stats.add(p)
            self.prof = None
            return _profile_summary(stats)

        def _reduction(self, step, reduce_fn):
            run = super()._reduction(step, reduce_fn)
            if self.prof is None:
                return run

            def profiled(values):  # in a worker thread: a profiler of its own, merged at the end
                prof = cProfile.Profile()
                prof.enable()
                try:
                    return run(values)
                finally:
                    prof.disable()
                    self.reductions.append(prof)

            return profiled

    return ProfilingCoordinatorHost


def _timed_shard_actor_cls(profile: bool = False):
    """ShardActor recording when its reshard steps (publish, take) ran, and (``profile``) profiling its take."""
    from raydcp.runtime.shard_group.actor import ShardActor

    class TimedShardActor(ShardActor):
        span = (0.0, 0.0)
        prof = None

        def take(self, *args):
            self.prof = cProfile.Profile() if profile else None
            t0 = time.time()
            if self.prof is not None:
                self.prof.enable()
            try:
                return super().take(*args)
            finally:
                if self.prof is not None:
                    self.prof.disable()
                self.span = (t0, time.time())

        def timing(self):
            steps = self.transfer_steps()
            return {"span": self.span, "pid": os.getpid(), "steps": steps,
                    "profile": _profile_summary(self.prof) if self.prof is not None else None}

    return TimedShardActor


def _check_group_pieces(state: dict, spec: dict, rank: int, world: int) -> int:
    """Run inside a ShardGroup actor: how many of its pieces differ from the saved values."""
    return count_bad(spec, world, rank, {k: v.tensor for k, v in state.items()})


# ----------------------------------------------------------------------------- the two sides of one repeat

class DcpSide:
    name = "torch DCP"

    def __init__(self, specs: dict):
        t0 = time.perf_counter()
        self.pool = DcpPool(specs, (SAVERS, RESHARD_LOAD, RESHARD_MEM))
        log(f"  torch DCP: {self.pool.world} gloo processes up in {time.perf_counter() - t0:.1f} s")

    def _load(self, w: int, kind: str, path: str) -> float:
        t, bad = self.pool.run("load", kind, path, w)
        if bad:
            raise AssertionError(f"torch DCP: {bad} tensors differ after the load onto {w} ranks")
        return t

    def warm_up(self, root: str) -> str:
        path = os.path.join(root, "dcp-warm")
        self.pool.run("save", "warm", path, SAVERS)
        for w in (SAVERS, RESHARD_LOAD, RESHARD_MEM):
            self._load(w, "warm", path)
        shutil.rmtree(path)
        return f"save by {SAVERS}, loads onto {SAVERS}, {RESHARD_LOAD} and {RESHARD_MEM} ranks"

    def repeat_save(self, root: str) -> dict:
        path = os.path.join(root, "dcp-large")
        t, _ = self.pool.run("save", "large", path, SAVERS)
        shutil.rmtree(path)
        return {"save": t}

    def repeat_reshard(self, root: str) -> dict:
        """Scenario (4) alone: the save, then the resharded load onto 6 ranks."""
        path = os.path.join(root, "dcp-large")
        out = {}
        out["save"], _ = self.pool.run("save", "large", path, SAVERS)
        out["load 4->6"] = self._load(RESHARD_MEM, "large", path)
        for op in RESHARD_OPS[:2]:
            out[op] = out["save"] + out["load 4->6"]
        shutil.rmtree(path)
        return out

    def repeat(self, root: str) -> dict:
        path, spath = os.path.join(root, "dcp-large"), os.path.join(root, "dcp-small")
        out = {}
        out["save"], _ = self.pool.run("save", "large", path, SAVERS)
        out["load 4->4"] = self._load(SAVERS, "large", path)
        out["load 4->3"] = self._load(RESHARD_LOAD, "large", path)
        out["load 4->6"] = self._load(RESHARD_MEM, "large", path)
        for op in RESHARD_OPS:
            out[op] = out["save"] + out["load 4->6"]
        out["small save"], _ = self.pool.run("save", "small", spath, SAVERS)
        out["small load"] = self._load(SAVERS, "small", spath)
        shutil.rmtree(path)
        shutil.rmtree(spath)
        return out

    def close(self) -> None:
        self.pool.close()


class RayDcpSide:
    name = "raydcp"

    def __init__(self, specs: dict):
        import ray

        self.ray = ray
        self.specs = specs
        actor = ray.remote(num_cpus=0, max_restarts=0)(Rank)
        t0 = time.perf_counter()
        self.ranks = [actor.remote(r, (SAVERS, RESHARD_LOAD), specs) for r in range(SAVERS)]
        ray.get([a.prepare.remote("warm", SAVERS, "save") for a in self.ranks])
        log(f"  raydcp: {SAVERS} actors up in {time.perf_counter() - t0:.1f} s")
        self.cls = _timed_shard_actor_cls()
        self.group = None  # ShardGroup(4) holding the large state, loaded once (untimed)
        self.reshard_breakdown: list[dict] = []  # of the reshards starting their actors
        self.phases: dict[str, list[dict]] = {}  # of the prepared reshards, by row
        self.very_first: float | None = None

    def _save(self, kind: str, path: str) -> float:
        ray, actors = self.ray, self.ranks[:SAVERS]
        refill_free_memory()
        ray.get([a.prepare.remote(kind, SAVERS, "save") for a in actors])
        t0 = time.perf_counter()
        ray.get([a.save.remote(kind, SAVERS, path) for a in actors])
        return time.perf_counter() - t0

    def _save_as(self, kind: str, path: str, group_name: str) -> float:
        ray, actors = self.ray, self.ranks[:SAVERS]
        refill_free_memory()
        ray.get([a.prepare.remote(kind, SAVERS, "save") for a in actors])
        t0 = time.perf_counter()
        ray.get([a.save_as.remote(kind, SAVERS, path, group_name) for a in actors])
        return time.perf_counter() - t0

    def _kill_host(self) -> bool:
        """Kill the cluster's coordinator host and wait until it is dead; False where this raydcp
        has no cluster-wide host (one per group: a cold group already starts one)."""
        from raydcp.runtime import actors

        if not hasattr(actors, "host_name"):
            return False
        ray = self.ray
        try:
            host = ray.get_actor(actors.host_name(), namespace=actors.NAMESPACE)
        except ValueError:
            return True
        ray.kill(host)
        while True:
            try:
                ray.get(host.ready.remote(), timeout=30)
            except ray.exceptions.RayActorError:
                return True

    def first_operations(self, root: str, rep: int) -> dict:
        """(6): a save on the warm group, on a new group, and on a new group with no host; for the
        large state and for the tiny one (where the fixed costs are all there is)."""
        path = os.path.join(root, "raydcp-first")
        out = {}
        for kind, suffix in (("large", ""), ("warm", FIRST_TINY)):
            tag = uuid.uuid4().hex[:8]
            cases = [("warm operation", lambda: self._save(kind, path)),
                     ("first operation (cold group)", lambda: self._save_as(kind, path, f"bench-cold-{tag}"))]
            for what, run in cases[rep % 2:] + cases[:rep % 2]:
                out[what + suffix] = run()
                shutil.rmtree(path)
            if self._kill_host():
                out["first operation (host not started)" + suffix] = self._save_as(kind, path, f"bench-fresh-{tag}")
                shutil.rmtree(path)
        return out

    def _load(self, w: int, kind: str, path: str) -> float:
        ray, actors = self.ray, self.ranks[:w]
        refill_free_memory()
        ray.get([a.prepare.remote(kind, w, "load") for a in actors])
        t0 = time.perf_counter()
        stats = ray.get([a.load.remote(kind, w, path) for a in actors])
        t = time.perf_counter() - t0
        bad = sum(ray.get([a.verify.remote(kind, w) for a in actors]))
        if bad:
            raise AssertionError(f"raydcp: {bad} tensors differ after the load onto {w} ranks")
        read, needed = sum(s["bytes_read"] for s in stats), sum(s["bytes_needed"] for s in stats)
        if read > needed:
            raise AssertionError(f"raydcp read {read} bytes for {needed} needed")
        return t

    def _check_group(self, group, world: int) -> None:
        spec = self.specs["large"]
        bad = sum(self.ray.get([group.apply_remote(r, _check_group_pieces, spec, r, world)
                                for r in range(world)]))
        if bad:
            raise AssertionError(f"raydcp ShardGroup({world}): {bad} pieces differ from the saved values")

    def _reshard(self, group=None, *, prepared: bool = True, transport: str = "object_store") -> tuple[float, dict]:
        """``group.reshard(6, transport=...)``, timed, verified and shut down; with where its time went.

        ``prepared``: the 2 actors the reshard adds were started ahead (``prepare_reshard``, untimed,
        as DCP's 6 processes are), their pieces allocated and (RDT) the collective group made;
        otherwise the timed call starts them.
        """
        group = group or self.group
        if prepared:
            group.prepare_reshard(RESHARD_MEM, transport=transport)
            self.ray.get([m.handle.info.remote() for m in group._spares])  # up, imports done
            self.ray.get(group._prepared)  # the new pieces allocated
            if group._rdt_pending is not None:
                group._rdt_pending.wait("bench: prepare_reshard")  # the collective group made
        refill_free_memory()
        wall0, t0 = time.time(), time.perf_counter()
        new = group.reshard(RESHARD_MEM, transport=transport)
        t = time.perf_counter() - t0
        try:
            self._check_group(new, RESHARD_MEM)
            both = {a._actor_id.hex(): a for a in group.actors + new.actors}
            timings = self.ray.get([a.timing.remote() for a in both.values()])
            added = len(both) - len(group.actors)
        finally:
            new.shutdown()
        profile = next((s["profile"] for s in timings if s["profile"]), None)
        return t, {**_phases(wall0, t, new.last_transfer, timings), "profile": profile, "added": added}

    def warm_up(self, root: str) -> str:
        path = os.path.join(root, "raydcp-warm")
        first = self._save("warm", path)
        if self.very_first is None:  # the first raydcp operation in this Ray instance
            self.very_first = first
        self._load(SAVERS, "warm", path)
        self._load(RESHARD_LOAD, "warm", path)
        shutil.rmtree(path)
        return f"save by {SAVERS}, loads onto {SAVERS} and {RESHARD_LOAD} ranks"

    def setup_group(self, root: str) -> None:
        """ShardGroup(4) holding the large state (untimed), then one untimed warm-up reshard."""
        from raydcp import ShardGroup

        path = os.path.join(root, "raydcp-group-src")
        self._save("large", path)
        t0 = time.perf_counter()
        self.group = ShardGroup(SAVERS, num_gpus_per_actor=0, layout="dim0", timeout_s=CMD_TIMEOUT_S,
                                _actor_cls=self.cls)
        self.group.load(path, layout="dim0")
        self._check_group(self.group, SAVERS)
        log(f"  raydcp: ShardGroup({SAVERS}) loaded and verified in {time.perf_counter() - t0:.1f} s (untimed)")
        shutil.rmtree(path)
        for transport in ("object_store", "rdt"):
            t, b = self._reshard(transport=transport)
            log(f"  raydcp: warm-up reshard({RESHARD_MEM}, transport={transport!r}) {t:.2f} s, verified")

    def repeat_reshard(self, root: str) -> dict:
        """The prepared reshards, through the object store and by RDT (their order alternates)."""
        self._turn = getattr(self, "_turn", -1) + 1
        order = (("object_store", RESHARD_OPS[0]), ("rdt", RESHARD_OPS[1]))
        out = {}
        for transport, op in order[self._turn % 2:] + order[:self._turn % 2]:
            out[op], b = self._reshard(prepared=True, transport=transport)
            b.pop("profile", None)
            self.phases.setdefault(op, []).append(b)
        return out

    def layout(self, root: str) -> tuple[dict[int, list[int]], int]:
        """The files of a save of the large set (untimed): what the disk limit writes."""
        path = os.path.join(root, "raydcp-layout")
        self._save("large", path)
        try:
            return layout_of(path)
        finally:
            shutil.rmtree(path)

    def repeat_save(self, root: str) -> dict:
        path = os.path.join(root, "raydcp-large")
        t = self._save("large", path)
        shutil.rmtree(path)
        return {"save": t}

    def repeat(self, root: str) -> dict:
        path, spath = os.path.join(root, "raydcp-large"), os.path.join(root, "raydcp-small")
        out = {}
        out["save"] = self._save("large", path)
        out["load 4->4"] = self._load(SAVERS, "large", path)
        out["load 4->3"] = self._load(RESHARD_LOAD, "large", path)
        out.update(self.repeat_reshard(root))
        out["reshard 4->6 +start"], b = self._reshard(prepared=False)
        b.pop("profile", None)
        self.reshard_breakdown.append(b)
        out["reshard: actors up"] = b["until_all_arrived"]
        out["reshard: transfer"] = b["transfer"]
        out["small save"] = self._save("small", spath)
        out["small load"] = self._load(SAVERS, "small", spath)
        shutil.rmtree(path)
        shutil.rmtree(spath)
        out.update(self.first_operations(root, self._reps))
        self._reps += 1
        return out

    _reps = 0

    def run_profile(self, root: str) -> dict[str, str]:
        """One more of each operation (untimed), profiled in every taking part actor and in the coordinator.

        The cluster's coordinator host is replaced here by a profiling one under its name (the
        ranks' first call finds the old one dead and takes the new one). File writes run in a
        thread pool, not profiled: in a rank they show as the wait for it (``acquire``).
        """
        from raydcp import ShardGroup
        from raydcp.runtime import actors as runtime_actors

        ray, prefix = self.ray, "bench-dist-prof"
        self._kill_host()
        host = ray.remote(_profiling_host_cls()).options(**runtime_actors.host_options()).remote()
        ray.get(host.ready.remote())
        hosts = {w: host for w in (SAVERS, RESHARD_LOAD)}
        ray.get([a.use_groups.remote(prefix) for a in self.ranks])
        out = {}
        path, spath = os.path.join(root, "raydcp-prof"), os.path.join(root, "raydcp-prof-small")
        self.warm_up(root)
        for name, w, run in (("save (large)", SAVERS, lambda: self._save("large", path)),
                             ("load 4->4 (large)", SAVERS, lambda: self._load(SAVERS, "large", path)),
                             ("load 4->3 (large)", RESHARD_LOAD, lambda: self._load(RESHARD_LOAD, "large", path)),
                             ("save (small)", SAVERS, lambda: self._save("small", spath)),
                             ("load 4->4 (small)", SAVERS, lambda: self._load(SAVERS, "small", spath))):
            actors = self.ranks[:w]
            ray.get([a.set_profile.remote(True) for a in actors] + [hosts[w].prof_start.remote()])
            t = run()
            cols = dict(zip([f"rank {r}" for r in range(w)], ray.get([a.set_profile.remote(False) for a in actors])))
            cols["coordinator"] = ray.get(hosts[w].prof_stop.remote())
            out[f"{name}: {t:.2f} s"] = _profile_table(cols)
        self._kill_host()  # the next operation starts an ordinary one
        self.group.shutdown()  # its memory, for the profiled group
        group = ShardGroup(SAVERS, num_gpus_per_actor=0, timeout_s=CMD_TIMEOUT_S,
                           _actor_cls=_timed_shard_actor_cls(True))
        try:
            group.load(path, layout="dim0")
            t, b = self._reshard(group)
        finally:
            group.shutdown()
        out[f"reshard 4->6: {t:.2f} s, {b['until_all_arrived']:.2f} s until the new actors are up, transfer "
            f"{b['transfer']:.2f} s; one receiving actor"] = _profile_table({"receiver": b["profile"]})
        shutil.rmtree(path)
        shutil.rmtree(spath)
        return out

    def close(self) -> None:
        if self.group is not None:
            self.group.shutdown()
        for a in self.ranks:
            self.ray.kill(a)


# ----------------------------------------------------------------------------- report

RESHARD_OPS = ["reshard 4->6 (prepared) object store", "reshard 4->6 (prepared) RDT", "reshard 4->6 +start"]
OPS = ["save", "load 4->4", "load 4->3", *RESHARD_OPS, "small save", "small load"]

# the phases of a prepared reshard (seconds; "@" ones are times since the call began)
PHASES = [("driver: plan", "plan_s"), ("driver: submit the tasks", "submit_s"),
          ("@ first receive step starts", "first_take"), ("@ last publish step ends", "publish_end"),
          ("@ first message at a receiver", "first_message"), ("@ last message at a receiver", "last_message"),
          ("busiest receiver: local copies", "local_s"), ("busiest receiver: copies out of messages", "copy_in_s"),
          ("busiest receiver: fetching messages", "get_s"), ("busiest receiver: waiting with nothing to copy", "wait_s"),
          ("@ last receive step ends", "last_end"), ("@ the call returns (total)", "total")]


def _phases(wall0: float, total: float, transfer: dict, timings: list[dict]) -> dict:
    """Where one reshard's time went, from the driver's record (``ShardGroup.last_transfer``) and
    the actors' step logs (``ShardActor.transfer_steps``)."""
    ranks = [r for r in transfer["ranks"].values() if r]
    publishes = [st for t in timings for st in t["steps"] if st[0] == "publish" and st[1] >= wall0]
    msgs = [r["first_message"] for r in ranks if r["first_message"]]
    lasts = [r["last_message"] for r in ranks if r["last_message"]]
    out = {"total": total, "plan_s": transfer["plan_s"], "submit_s": transfer["submit_s"],
           "first_take": min(r["start"] for r in ranks) - wall0,
           "publish_end": max((st[2] for st in publishes), default=wall0) - wall0,
           "first_message": min(msgs) - wall0 if msgs else 0.0, "last_message": max(lasts) - wall0 if lasts else 0.0,
           "last_end": max(r["end"] for r in ranks) - wall0,
           "local_mib": transfer["local_bytes"] / MIB, "remote_mib": transfer["remote_bytes"] / MIB,
           "messages": transfer["messages"], "transport": transfer["transport"]}
    for k in ("local_s", "copy_in_s", "get_s", "wait_s"):
        out[k] = max(r[k] for r in ranks)
    # for the reshard starting its actors: until the last receive step began, moving, returning
    out["until_all_arrived"] = max(r["start"] for r in ranks) - wall0
    out["transfer"] = out["last_end"] - out["until_all_arrived"]
    out["after"] = total - out["last_end"]
    return out


def phase_table(phases: dict[str, list[dict]]) -> str:
    """Medians of each phase over the repeats, one column per prepared reshard."""
    cols = [op for op in RESHARD_OPS if op in phases]
    rows = [[label, *[median([p[key] for p in phases[op]]) for op in cols]] for label, key in PHASES]
    first = phases[cols[0]][0]
    note = (f"{first['local_mib']:.0f} MiB copied inside the kept actors, {first['remote_mib']:.0f} MiB in "
            f"{first['messages']} messages; transports: " + ", ".join(phases[op][0]["transport"] for op in cols))
    return table(["phase (s; @: since the call began)", *cols], rows) + "\n\n" + note


def disk_report(d: dict, r: dict, disk: dict, best: dict, nbytes: int, n: int) -> tuple[str, float]:
    """The save against the disk's write limit (the fastest way of writing raydcp's layout)."""
    rows = [[f"disk limit: {way}", disk[f"save ({way})"], best[f"save ({way})"], nbytes / GB / disk[f"save ({way})"],
             disk[f"save ({way})"] / r["save"]] for way in WAYS]
    rows += [["raydcp save", r["save"], None, nbytes / GB / r["save"], None],
             ["torch DCP save", d["save"], None, nbytes / GB / d["save"], None]]
    limit = min(disk[f"save ({way})"] for way in WAYS)
    text = table(["write of the large set (same files, fsyncs)", "median s", f"best of {n} s", "GB/s",
                  "as a share of raydcp's save"], rows)
    return (text + f"\n\nThe limit is the fastest way: {limit:.3f} s; raydcp's save reaches "
            f"{100 * limit / r['save']:.0f}% of it, torch DCP's {100 * limit / d['save']:.0f}%."), limit


def report(med: dict, best: dict, sizes: dict, n: int, breakdown: dict | None) -> tuple[str, dict, dict]:
    d, r = med["torch DCP"], med["raydcp"]
    ops = [op for op in OPS if op in r]
    ratio = {op: d[op] / r[op] for op in ops}
    best_ratio = {op: best["torch DCP"][op] / best["raydcp"][op] for op in ops}
    large_gb = sizes["large"] / GB
    rows = []
    for op in ops:
        gb = sizes["small"] / GB if op.startswith("small") else large_gb
        rows.append([op, d[op], r[op], gb / d[op], gb / r[op], ratio[op], best_ratio[op]])
    heads = ["scenario", "torch DCP s", "raydcp s", "DCP GB/s", "raydcp GB/s", "DCP / raydcp", f"best of {n}"]
    os_op, rdt_op, start_op = RESHARD_OPS
    text = [table(heads, rows), ""]
    b = best_ratio
    if os_op in r:
        para = (f"DCP's reshard 4->6 is its save ({d['save']:.2f} s) + its load onto 6 ranks ({d['load 4->6']:.2f} s). "
                f"raydcp's reshard(6) call keeps the 4 actors and adds 2. Started ahead with prepare_reshard(6) "
                f"(untimed, as DCP's 6 processes are): {r[os_op]:.2f} s through the object store, {r[rdt_op]:.2f} s "
                f"by Ray Direct Transport (gloo).")
        if breakdown is not None:
            para += (f" Started by the call itself: {r[start_op]:.2f} s (medians of the parts): "
                     f"{breakdown['until_all_arrived']:.2f} s until the last added actor is up and enters its receive "
                     f"step (placement group, actor starts), {breakdown['transfer']:.2f} s moving the pieces, "
                     f"{breakdown['after']:.2f} s returning to the driver.")
        text += [para, ""]
    disk = med.get("disk limit")
    limit = None
    if disk and "save" in ops:
        disk_text, limit = disk_report(d, r, disk, best["disk limit"], sizes["large"], n)
        text += [disk_text, ""]
    checks = []  # (goal, median, best of n, target, met)
    if "save" in ops:
        checks.append(("save >= 1.5x DCP", ratio["save"], b["save"], ">= 1.5", ratio["save"] >= 1.5))
    if limit is not None:
        share, best_share = limit / r["save"], min(best["disk limit"].values()) / best["raydcp"]["save"]
        checks.append(("save >= 85% of the disk's write limit (same run)", share, best_share, ">= 0.85",
                       share >= 0.85))
    if "load 4->4" in ops:
        own, own_best = r["load 4->3"] / r["load 4->4"], best["raydcp"]["load 4->3"] / best["raydcp"]["load 4->4"]
        checks += [
            ("resharded load 4->3 >= 1.5x DCP", ratio["load 4->3"], b["load 4->3"], ">= 1.5",
             ratio["load 4->3"] >= 1.5),
            ("resharded load <= 1.2x own same-size load (4->3 / 4->4)", own, own_best, "<= 1.2", own <= 1.2),
            ("small tensors save >= 5x DCP", ratio["small save"], b["small save"], ">= 5", ratio["small save"] >= 5),
            ("small tensors load >= 5x DCP", ratio["small load"], b["small load"], ">= 5", ratio["small load"] >= 5)]
    if os_op in r:
        checks += [
            ("in-memory reshard 4->6 (object store) >= 10x DCP save + resharded load", ratio[os_op], b[os_op],
             ">= 10", ratio[os_op] >= 10),
            ("in-memory reshard 4->6 (RDT gloo) vs DCP save + resharded load", ratio[rdt_op], b[rdt_op], "(shown)",
             True)]
    text += [table(["goal", "measured (medians)", f"best of {n} each", "target", "status"],
                   [[c[0], c[1], c[2], c[3], goal(c[4]) if c[3] != "(shown)" else "-"] for c in checks]), ""]
    ratios = {"DCP/raydcp": ratio, "best DCP/raydcp": best_ratio}
    if limit is not None:
        ratios["raydcp save / disk limit"] = limit / r["save"]
        ratios["DCP save / disk limit"] = limit / d["save"]
    if start_op in r:
        ratios["DCP reshard / raydcp reshard with its actors starting"] = d[start_op] / r[start_op]
    return "\n".join(text), ratios, {c[0]: c[4] for c in checks if c[3] != "(shown)"}


FIRST_OPS = ["warm operation", "first operation (cold group)", "first operation (host not started)"]
FIRST_TINY = ", tiny state"  # the 'warm' set: 4 tensors of 48 x 8 floats


def first_op_report(times: dict[str, list[float]], very_first: float | None, n: int) -> tuple[str, dict, dict]:
    """(6): the first operation of a Group against a warm one (raydcp alone, medians of n)."""
    text, ratios, checks = [], {}, []
    for suffix, what in (("", "the large save by 4 ranks"), (FIRST_TINY, "the tiny save by 4 ranks (4 tensors)")):
        med = {op: median(times[op + suffix]) for op in FIRST_OPS if op + suffix in times}
        warm = med["warm operation"]
        rows = [[op, med[op], min(times[op + suffix]), med[op] / warm, med[op] - warm] for op in med]
        text += [table([f"raydcp: {what}", "median s", f"best of {n} s", "/ warm", "on top of warm s"], rows), ""]
        cold = med["first operation (cold group)"]
        ratios[f"cold group / warm{suffix}"] = cold / warm
        ratios[f"cold group - warm s{suffix}"] = cold - warm
        if "first operation (host not started)" in med:
            ratios[f"host not started / warm{suffix}"] = med["first operation (host not started)"] / warm
        if not suffix:
            checks.append(("first operation of a new Group within 2x of a warm one (large save)", cold / warm,
                           "<= 2", cold / warm <= 2))
        checks.append((f"... under 0.5 s on top of a warm one ({'tiny' if suffix else 'large'} save)", cold - warm,
                       "<= 0.5 s", cold - warm <= 0.5))
    if very_first is not None:
        text += [f"The run's very first raydcp operation (the warm-up's save of the tiny set in a fresh Ray "
                 f"instance: it starts the coordinator host and is also each rank's first raydcp call): "
                 f"{very_first:.2f} s.", ""]
    text += [table(["goal", "measured (medians)", "target", "status"], [[c[0], c[1], c[2], goal(c[3])] for c in checks]),
             ""]
    return "\n".join(text), ratios, {c[0]: c[3] for c in checks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory to write checkpoints in (default: a temp dir under /tmp)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mib", type=int, default=512, help="size of the large state, all ranks together (64 tensors)")
    ap.add_argument("--small", type=int, default=4096, help="small tensors per rank (64 floats each per rank)")
    ap.add_argument("--profile", action="store_true",
                    help="also cProfile raydcp's operations inside an actor (untimed)")
    ap.add_argument("--first-op-only", action="store_true",
                    help="only scenario (6), the first operation of a Group (raydcp alone, no DCP)")
    ap.add_argument("--only", choices=["reshard", "save"], default=None,
                    help="run one scenario alone: reshard = (4), DCP's save + load onto 6 against the prepared "
                         "reshards; save = (1), with the disk's write limit")
    ap.add_argument("--breakdown", action="store_true",
                    help="print where the prepared reshards' time goes, phase by phase (medians)")
    args = ap.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the temp dir is removed when killed
    warnings.filterwarnings("ignore")
    info = machine()
    loads = LoadRange()
    specs = {k: dataset(k, args.mib, args.small) for k in ("large", "small", "warm")}
    sizes = {k: nbytes(s) for k, s in specs.items()}
    root = tempfile.mkdtemp(prefix="raydcp-bench-dist-", dir=args.dir or "/tmp")
    log(f"machine: {info['nproc']} CPUs, {info['mem_gib']} GiB RAM, torch {info['torch']}; load average "
        f"{info['loadavg']}; writing under {root}")
    log(f"large: {len(specs['large'])} tensors, {sizes['large'] / MIB:.0f} MiB "
        f"({sizes['large'] / SAVERS / MIB:.0f} MiB per rank of {SAVERS}); small: {len(specs['small'])} tensors x "
        f"{SMALL_PER_RANK} floats per rank; {args.repeats} repeats")

    import ray

    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")
    sides = []
    times: dict[str, dict[str, list[float]]] = {}
    profiles = {}
    try:
        log("starting raydcp's actors" if args.first_op_only else "starting torch DCP's gloo processes and raydcp's actors")
        sides = [RayDcpSide(specs)] if args.first_op_only else [DcpSide(specs), RayDcpSide(specs)]
        raydcp_side = sides[-1]
        log("warming up (untimed)")
        for side in sides:
            t0 = time.perf_counter()
            what = side.warm_up(root)
            log(f"  {side.name}: warm-up {what} verified in {time.perf_counter() - t0:.1f} s")
        if args.only != "reshard" and not args.first_op_only:
            layout, meta = sides[1].layout(root)
            from raydcp.options import IOOptions

            sides.append(DiskSide(layout, meta, IOOptions().write_threads))
            log(f"  disk limit: warm-up {sides[-1].warm_up(root)}")
        if args.only is None and not args.first_op_only:
            sides[1].setup_group(root)
        for rep in range(args.repeats):
            order = sides[rep % len(sides):] + sides[:rep % len(sides)]
            for side in order:
                if args.first_op_only:
                    res = side.first_operations(root, rep)
                elif args.only == "reshard":
                    res = side.repeat_reshard(root)
                elif args.only == "save":
                    res = side.repeat_save(root)
                else:
                    res = side.repeat(root)
                for op, t in res.items():
                    times.setdefault(side.name, {}).setdefault(op, []).append(t)
                log(f"  repeat {rep + 1}/{args.repeats} {side.name:9s} "
                    + "  ".join(f"{op} {t:.2f}" for op, t in res.items())
                    + f"  (s, all verified); load average {loads.sample()}")
        if args.profile:
            log("profiling raydcp (untimed)")
            profiles = raydcp_side.run_profile(root)
    finally:
        for side in sides:
            side.close()
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)

    med = {lib: {op: median(ts) for op, ts in d.items()} for lib, d in times.items()}
    best = {lib: {op: min(ts) for op, ts in d.items()} for lib, d in times.items()}
    phases = raydcp_side.phases
    first_text, first_ratios, first_goals = ("", {}, {}) if "warm operation" not in times["raydcp"] else \
        first_op_report(times["raydcp"], raydcp_side.very_first, args.repeats)
    if args.first_op_only:
        text, ratios, goals, bd = "", {}, {}, []
    else:
        bd = raydcp_side.reshard_breakdown
        breakdown = ({k: median([b[k] for b in bd]) for k in ("total", "until_all_arrived", "transfer", "after")}
                     if bd else None)
        text, ratios, goals = report(med, best, sizes, args.repeats, breakdown)
    if first_text:
        text += "\n### the first operation of a Group\n\n" + first_text
    ratios.update(first_ratios)
    goals.update(first_goals)
    info["loadavg_during"] = str(loads)
    print(f"\n## distributed  ({info['date']}, {info['nproc']} CPUs, {info['mem_gib']} GiB RAM;"
          f" 1-minute load average during the run {loads})\n")
    print(f"command: {argv_line()}\n")
    print(f"4 ranks; large: {len(specs['large'])} float32 tensors, {sizes['large'] / MIB:.0f} MiB in all, dim-0 "
          f"sharded (torch.chunk); small: {len(specs['small'])} tensors, {SMALL_PER_RANK} floats per rank "
          f"({sizes['small'] / MIB:.1f} MiB in all). Medians of {args.repeats}; every load verified.\n")
    print(text)
    if args.breakdown:
        print(f"Where a prepared reshard 4->6 spends its time (medians of {args.repeats}):\n")
        print(phase_table(phases))
    for what, prof in profiles.items():
        print(f"\n--- cProfile raydcp {what}\n\n{prof}")
    out = save_json("distributed-first-op" if args.first_op_only else "distributed",
                    {"machine": info, "args": vars(args), "sizes": sizes, "times": times,
                     "median": med, "best": best, "reshard_breakdown": bd, "phases": phases, "ratios": ratios,
                     "goals": goals})
    log(f"results: {out}")


if __name__ == "__main__":
    main()
