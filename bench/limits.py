"""raydcp's memory-speed paths against the machine's own limits, measured in the same run.

Each goal compares a raydcp operation with a plain operation that moves the same bytes without
raydcp on the same machine, in the same run (the "limit"), and reports the ratio raydcp / limit:

  restore   raydcp.load from ``raymem://`` (one Ray node) by 4 rank actors, same size (4->4) and
            resharded (4->6), of --mib MiB in 64 float32 tensors saved by 4 ranks (dim-0 pieces);
            limit: the same actors copying the same bytes (numpy copy) from one shared-memory
            buffer in the object store into the same destination tensors.   goal: <= 2x
            (reported beside: the load with LoadOptions(atomic=False), without the undo copy)
  tmpfs     raydcp.save to /dev/shm, one process (the driver) and 4 rank actors;
            limit: the same process(es) writing the same bytes to the same tmpfs (one write per
            tensor, fsync), the faster of 1 file and ``write_threads`` files in as many threads
            per process.                                      goal: limit / raydcp >= 0.8
  reshard   ``ShardGroup(4).reshard(6)`` (prepared: the 2 added actors started and their pieces
            allocated ahead, untimed) against the 6 rank actors copying the bytes that move (those
            an actor did not hold before) from one shared-memory buffer.   goal: <= 2.5x
            (against torch DCP's save + resharded load: bench/distributed.py)
  async     raydcp.async_save's blocking time against a memcpy of the state into preallocated
            memory in the same process: the local persister (group=None, the driver) and the Ray
            persister (4 fresh rank actors: the first call of each process without preparation,
            and with ``raydcp.prepare_group(group, async_save=True, state_dict=...)`` and its persister ready);
            the slowest rank counts.                              goal: <= 1.2x (later calls, and
            the first call after preparation; a first call without it is reported)

Every load and reshard is verified against the saved values. Medians of --repeats; the order of
raydcp and its limit alternates from repeat to repeat. Run:

    python bench/limits.py                            # 256 MiB, 3 repeats, every goal
    python bench/limits.py --mib 1024 --only restore tmpfs   # 1 GiB (about 8 GiB of free memory)
    python bench/limits.py --only restore --profile   # also where a raymem restore spends its time
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

# the raydcp of this checkout, in the driver as in the actors (runtime_env below): every process of
# the run must run the same code (the coordinator host's name is a digest of it)
sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
from _util import LoadRange, argv_line, log, machine, median, refill_free_memory, save_json, table  # noqa: E402
from distributed import Rank, _profile_table, dataset, nbytes, pieces, values  # noqa: E402

MIB = 1 << 20
SAVERS, MORE = 4, 6
SHM = "/dev/shm"


class LimitRank(Rank):
    """bench/distributed.py's rank, with the plain operations that are its limits."""

    def plain_copy(self, kind: str, w: int, boxed: list) -> float:
        """Copy this rank's pieces of ``kind`` (world ``w``) from the shared-memory buffer ``boxed[0]``
        (the whole state, tensor after tensor) into its tensors: what a load must do at least."""
        import ray

        src = ray.get(boxed[0])
        pos = 0
        st = self.states[kind, w]
        for _, fqn, shape, lo, hi in pieces(self.specs[kind], w, self.rank):
            row = 4 * int(np.prod(shape[1:]))
            dst = st[fqn].tensor.numpy().reshape(-1).view(np.uint8)
            np.copyto(dst, src[pos + lo * row:pos + hi * row])
            pos += shape[0] * row
        return 0.0

    def plain_copy_moved(self, kind: str, boxed: list) -> int:
        """Copy into this rank's pieces of ``kind`` on MORE ranks the rows it did not hold on SAVERS
        ranks (all of them for a rank added by the reshard), from the shared-memory buffer
        ``boxed[0]``: what an in-memory reshard 4 -> 6 must move at least. Returns the bytes copied."""
        import ray

        src = ray.get(boxed[0])
        pos = copied = 0
        st = self.states[kind, MORE]
        old = dict(((fqn, (lo, hi)) for _, fqn, _, lo, hi in pieces(self.specs[kind], SAVERS, self.rank))
                   if self.rank < SAVERS else ())
        for _, fqn, shape, lo, hi in pieces(self.specs[kind], MORE, self.rank):
            row = 4 * int(np.prod(shape[1:]))
            dst = st[fqn].tensor.numpy().reshape(-1).view(np.uint8)
            for a, b in moved_rows(lo, hi, old.get(fqn)):
                np.copyto(dst[(a - lo) * row:(b - lo) * row], src[pos + a * row:pos + b * row])
                copied += (b - a) * row
            pos += shape[0] * row
        return copied

    def load_with(self, kind: str, w: int, path: str, atomic: bool) -> dict:
        """raydcp.load with ``LoadOptions(atomic=atomic)`` (False: no undo copy of the tensors it fills)."""
        opts = self.raydcp.LoadOptions(atomic=atomic)
        return self._op(lambda: self.raydcp.load(self.states[kind, w], path, group=self.groups[w], options=opts))

    def plain_write(self, kind: str, w: int, directory: str, threads: int) -> int:
        """Write this rank's pieces to ``threads`` files in ``directory`` (one write per piece, fsync)."""
        os.makedirs(directory, exist_ok=True)
        views = [s.tensor.numpy().reshape(-1).view(np.uint8) for s in self.states[kind, w].values()]
        return write_plain(views, os.path.join(directory, f"r{self.rank}"), threads)


class AsyncRank(LimitRank):
    """A rank of the async goal: its own group name, a fresh process for each first call."""

    def async_saves(self, kind: str, path: str, prepare: bool, repeats: int) -> dict:
        """The blocking seconds of this process's first ``async_save`` (after ``prepare_group(...,
        async_save=True, state_dict=...)`` and its persister ready, with ``prepare``) and of ``repeats`` more, and
        the seconds of a memcpy of the same state into preallocated memory before each."""
        import ray

        group = self.raydcp.Group(f"bench-async-{prepare}", self.rank, SAVERS, timeout_s=600)
        self.prepare(kind, SAVERS, "save")
        state = self.states[kind, SAVERS]
        if prepare:
            from raydcp.runtime.persister import persister_for_this_process

            self.raydcp.prepare_group(group, async_save=True, state_dict=state)
            ray.get(persister_for_this_process().actor.ready.remote())  # as after a few training steps
        return measure_async(lambda i: self.raydcp.async_save(state, f"{path}-{i}", group=group),
                             [s.tensor for s in state.values()], repeats)


def measure_async(call, tensors: list, repeats: int) -> dict:
    """``{"first": s, "steady": [s...], "memcpy": [s...]}``: the blocking seconds of ``call(i)``
    (whose future is then waited for), the first and ``repeats`` more, each after a memcpy of
    ``tensors`` into preallocated, touched memory (the limit)."""
    dst = [torch.empty_like(t) for t in tensors]

    def memcpy() -> float:
        t0 = time.perf_counter()
        for d, t in zip(dst, tensors):
            d.copy_(t)
        return time.perf_counter() - t0

    out: dict = {"steady": [], "memcpy": []}
    memcpy()
    for i in range(repeats + 1):
        out["memcpy"].append(memcpy())
        t0 = time.perf_counter()
        fut = call(i)
        blocked = time.perf_counter() - t0
        fut.result()
        if i == 0:
            out["first"] = blocked
        else:
            out["steady"].append(blocked)
    return out


def moved_rows(lo: int, hi: int, kept: tuple[int, int] | None) -> list[tuple[int, int]]:
    """The rows of [lo, hi) outside ``kept`` (the rows the same actor held before), as runs."""
    if kept is None:
        return [(lo, hi)] if hi > lo else []
    a, b = max(lo, kept[0]), min(hi, kept[1])
    if a >= b:
        return [(lo, hi)] if hi > lo else []
    return [(x, y) for x, y in ((lo, a), (b, hi)) if y > x]


def write_plain(views: list, prefix: str, threads: int) -> int:
    """The bytes of ``views`` written to ``threads`` files ``{prefix}-{i}.bin`` (views dealt round
    robin), each one write per view then fsync, in ``threads`` threads at once."""
    def one(i: int) -> int:
        fd = os.open(f"{prefix}-{i}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            n = 0
            for v in views[i::threads]:
                n += os.write(fd, v)
            os.fsync(fd)
            return n
        finally:
            os.close(fd)

    if threads == 1:
        return one(0)
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(one, range(threads)))


def source_buffer(specs: dict, kind: str) -> np.ndarray:
    """The whole state of ``kind`` as one byte array, tensor after tensor (the plain copy's source)."""
    parts = [values(i, shape, 0, shape[0]).reshape(-1).view(torch.uint8).numpy()
             for i, (_, shape) in enumerate(specs[kind].items())]
    return np.concatenate(parts)


class Ranks:
    """6 rank actors: the first 4 save, 4 or 6 load."""

    def __init__(self, specs: dict):
        import ray

        self.ray = ray
        actor = ray.remote(num_cpus=0, max_restarts=0)(LimitRank)
        self.ranks = [actor.remote(r, (SAVERS, MORE), specs) for r in range(MORE)]

    def call(self, w: int, method: str, *args) -> tuple[float, list]:
        actors = self.ranks[:w]
        refill_free_memory()
        t0 = time.perf_counter()
        out = self.ray.get([getattr(a, method).remote(*args) for a in actors])
        return time.perf_counter() - t0, out

    def prepare(self, kind: str, w: int, what: str) -> None:
        self.ray.get([a.prepare.remote(kind, w, what) for a in self.ranks[:w]])

    def load(self, kind: str, w: int, url: str, atomic: bool = True) -> float:
        self.prepare(kind, w, "load")
        t, _ = self.call(w, "load_with", kind, w, url, atomic)
        self.check(kind, w, url)
        return t

    def check(self, kind: str, w: int, what: str) -> None:
        bad = sum(self.ray.get([a.verify.remote(kind, w) for a in self.ranks[:w]]))
        if bad:
            raise AssertionError(f"{bad} tensors differ after {what} onto {w} ranks")

    def profile(self, w: int, on: bool):
        return self.ray.get([a.set_profile.remote(on) for a in self.ranks[:w]])

    def close(self) -> None:
        for a in self.ranks:
            self.ray.kill(a)


def alternate(rep: int, pair: list) -> list:
    return pair if rep % 2 == 0 else pair[::-1]


def run_restore(args, ranks: Ranks, specs: dict, times: dict) -> None:
    """Goal 1: the raymem:// restore, 4->4 and 4->6, against the plain copy."""
    import ray

    url = "raymem://bench-limits/ckpt"
    ranks.prepare("large", SAVERS, "save")
    ranks.call(SAVERS, "save", "large", SAVERS, url)
    src = ray.put(source_buffer(specs, "large"))
    for w in (SAVERS, MORE):  # warm: the loaders' groups and the plain copy's first touch
        ranks.load("large", w, url)
        ranks.prepare("large", w, "load")
        ranks.call(w, "plain_copy", "large", w, [src])
    for rep in range(args.repeats):
        for w in (SAVERS, MORE):
            for lib in alternate(rep, ["raydcp", "limit"]) + ["raydcp atomic=False"]:
                if lib.startswith("raydcp"):
                    t = ranks.load("large", w, url, atomic=lib == "raydcp")
                else:
                    ranks.prepare("large", w, "load")
                    t, _ = ranks.call(w, "plain_copy", "large", w, [src])
                    ranks.check("large", w, "the plain copy")
                times.setdefault(f"restore 4->{w} {lib}", []).append(t)
        log(f"  restore repeat {rep + 1}: " + "  ".join(f"{k} {v[-1]:.3f}" for k, v in times.items()
                                                        if k.startswith("restore")))
    if args.profile:
        for w in (SAVERS, MORE):
            ranks.prepare("large", w, "load")
            ranks.profile(w, True)
            ranks.call(w, "load", "large", w, url)
            prof = ranks.profile(w, False)
            print(f"\nprofile of one raymem restore 4->{w} (cumulative seconds per rank):\n")
            print(_profile_table({f"rank {r}": p for r, p in enumerate(prof)}, top=25))
    del src
    import raydcp
    from raydcp.runtime.memstore import RayMemFileSystem

    RayMemFileSystem().rm("bench-limits", recursive=True)
    del raydcp


def run_tmpfs(args, ranks: Ranks, specs: dict, times: dict) -> None:
    """Goal 3: saves to tmpfs, one process and 4 ranks, against plain writes of the same bytes."""
    import raydcp
    from raydcp.options import IOOptions

    threads = IOOptions().write_threads
    root = os.path.join(SHM, f"raydcp-bench-limits-{os.getpid()}")
    state = {k: values(i, shape, 0, shape[0]) for i, (k, shape) in enumerate(specs["large"].items())}
    views = [t.reshape(-1).view(torch.uint8).numpy() for t in state.values()]
    ranks.prepare("large", SAVERS, "save")

    def clean() -> None:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)

    def single(lib: str) -> float:
        clean()
        refill_free_memory()
        t0 = time.perf_counter()
        if lib == "raydcp":
            raydcp.save(state, os.path.join(root, "ckpt"))
        else:
            write_plain(views, os.path.join(root, "plain"), 1 if lib == "limit 1 thread" else threads)
        return time.perf_counter() - t0

    def four(lib: str) -> float:
        clean()
        if lib == "raydcp":
            return ranks.call(SAVERS, "save", "large", SAVERS, os.path.join(root, "ckpt"))[0]
        return ranks.call(SAVERS, "plain_write", "large", SAVERS, root, 1 if lib == "limit 1 thread" else threads)[0]

    try:
        for run in (single, four):  # warm
            run("raydcp")
        libs = ["raydcp", "limit 1 thread", f"limit {threads} threads"]
        for rep in range(args.repeats):
            for name, run in (("1 process", single), ("4 ranks", four)):
                for lib in libs[rep % 3:] + libs[:rep % 3]:
                    times.setdefault(f"tmpfs {name} {lib}", []).append(run(lib))
            log(f"  tmpfs repeat {rep + 1}: " + "  ".join(f"{k} {v[-1]:.3f}" for k, v in times.items()
                                                          if k.startswith("tmpfs")))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_reshard(args, ranks: Ranks, specs: dict, times: dict, info: dict) -> None:
    """Goal 2: ``ShardGroup(4).reshard(6)`` (prepared: the 2 added actors started and their pieces
    allocated ahead, untimed) against the plain copy of the bytes that move, by 6 rank actors."""
    import ray

    from raydcp import ShardGroup

    path = os.path.join(SHM, f"raydcp-bench-limits-group-{os.getpid()}")
    ranks.prepare("large", SAVERS, "save")
    ranks.call(SAVERS, "save", "large", SAVERS, path)
    group = ShardGroup(SAVERS, num_gpus_per_actor=0, layout="dim0", timeout_s=600)
    src = ray.put(source_buffer(specs, "large"))
    try:
        group.load(path, layout="dim0")
        shutil.rmtree(path, ignore_errors=True)
        ranks.prepare("large", MORE, "load")
        for rep in range(args.repeats + 1):  # the first: warm-up
            for lib in alternate(rep, ["raydcp", "limit"]):
                if lib == "limit":
                    ranks.prepare("large", MORE, "load")
                    t, copied = ranks.call(MORE, "plain_copy_moved", "large", [src])
                    info["reshard_bytes_moved"] = sum(copied)
                else:
                    group.prepare_reshard(MORE)
                    ray.get([m.handle.info.remote() for m in group._spares])  # up, imports done
                    ray.get(group._prepared)  # the new pieces allocated
                    refill_free_memory()
                    t0 = time.perf_counter()
                    new = group.reshard(MORE)
                    t = time.perf_counter() - t0
                    try:
                        check_full(new.full_state_dict(), specs["large"])
                    finally:
                        new.shutdown()
                if rep:
                    times.setdefault(f"reshard 4->6 {lib}", []).append(t)
            if rep:
                log_repeat("reshard", rep, times)
    finally:
        group.shutdown()
        shutil.rmtree(path, ignore_errors=True)


def check_full(full: dict, spec: dict) -> None:
    for i, (fqn, shape) in enumerate(spec.items()):
        if not torch.equal(full[fqn], values(i, shape, 0, shape[0])):
            raise AssertionError(f"reshard: {fqn} differs from the saved values")


def run_async(args, specs: dict, times: dict) -> None:
    """Goal 4: async_save's blocking time against a memcpy of the state, the local persister (in
    this process, group=None) and the Ray persister (4 fresh rank actors each way)."""
    import ray

    import raydcp

    root = os.path.join(SHM, f"raydcp-bench-limits-async-{os.getpid()}")
    state = {k: values(i, shape, 0, shape[0]) for i, (k, shape) in enumerate(specs["large"].items())}
    try:
        got = measure_async(lambda i: raydcp.async_save(state, os.path.join(root, f"local-{i}")),
                            list(state.values()), args.repeats)
        record_async(times, "local", [got])
        actor = ray.remote(num_cpus=0, max_restarts=0)(AsyncRank)
        for prepare in (False, True):
            ranks = [actor.remote(r, (SAVERS,), specs) for r in range(SAVERS)]
            try:
                got = ray.get([a.async_saves.remote("large", os.path.join(root, f"ray-{prepare}"), prepare,
                                                    args.repeats) for a in ranks])
            finally:
                for a in ranks:
                    ray.kill(a)
            record_async(times, "ray prepared" if prepare else "ray", got)
        log("  async: " + "  ".join(f"{k} {median(v):.3f}" for k, v in times.items() if k.startswith("async")))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def record_async(times: dict, name: str, per_rank: list[dict]) -> None:
    """The slowest rank's figures (a group's async_save blocks its training step for the slowest)."""
    times[f"async {name} first"] = [max(g["first"] for g in per_rank)]
    times[f"async {name} steady"] = [max(g["steady"][i] for g in per_rank) for i in range(len(per_rank[0]["steady"]))]
    times[f"async {name} memcpy"] = [max(g["memcpy"][i] for g in per_rank) for i in range(len(per_rank[0]["memcpy"]))]


def run_s3(args, times: dict, info: dict) -> None:
    """Goal 5: raydcp's save and load of --s3-mib MiB (one process) to S3 served by moto on loopback,
    against boto3's transfer manager moving the same bytes (one object, from and into memory) with
    raydcp's concurrency and part sizes: the save writes its one data file through s3fs (parts of
    s3fs's block size, one at a time), the load reads it in ``read_threads`` ranges of
    ``read_task_bytes`` at once."""
    import io

    import boto3
    from boto3.s3.transfer import TransferConfig
    from pipeline import BUCKET, start_moto

    import raydcp
    from raydcp.options import IOOptions

    spec = {f"s3.{i}": (max(1, args.s3_mib * MIB // 64 // 4 // 1024), 1024) for i in range(64)}
    state = {k: values(i, shape, 0, shape[0]) for i, (k, shape) in enumerate(spec.items())}
    blob = np.concatenate([t.reshape(-1).view(torch.uint8).numpy() for t in state.values()])
    info["s3_bytes"] = int(blob.nbytes)
    moto, opts = start_moto()
    try:
        import s3fs

        client = boto3.client("s3", endpoint_url=opts["client_kwargs"]["endpoint_url"], region_name="us-east-1",
                              aws_access_key_id=opts["key"], aws_secret_access_key=opts["secret"])
        iod = IOOptions()
        part = s3fs.S3FileSystem.default_block_size
        put_cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=1,
                                 use_threads=False)
        get_cfg = TransferConfig(multipart_threshold=iod.read_task_bytes, multipart_chunksize=iod.read_task_bytes,
                                 max_concurrency=iod.read_threads)
        out = {k: torch.empty_like(v) for k, v in state.items()}
        sink = np.empty_like(blob)

        def run(lib: str, op: str, i: int) -> float:
            t0 = time.perf_counter()
            if lib == "raydcp" and op == "save":
                raydcp.save(state, f"s3://{BUCKET}/raydcp-{i}", storage_options=opts)
            elif lib == "raydcp":
                for t in out.values():
                    t.fill_(float("nan"))
                t0 = time.perf_counter()
                raydcp.load(out, f"s3://{BUCKET}/raydcp-{i}", storage_options=opts)
            elif op == "save":
                client.upload_fileobj(io.BytesIO(memoryview(blob)), BUCKET, f"boto3-{i}", Config=put_cfg)
            else:
                buf = io.BytesIO()
                client.download_fileobj(BUCKET, f"boto3-{i}", buf, Config=get_cfg)
                np.copyto(sink, np.frombuffer(buf.getbuffer(), np.uint8))
            t = time.perf_counter() - t0
            if op == "load" and lib == "raydcp" and not all(torch.equal(out[k], v) for k, v in state.items()):
                raise AssertionError("s3: raydcp's load differs from the saved values")
            if op == "load" and lib == "boto3" and not np.array_equal(sink, blob):
                raise AssertionError("s3: boto3's download differs from the uploaded bytes")
            return t

        for rep in range(args.repeats + 1):  # the first: warm-up (connections, imports)
            for op in ("save", "load"):
                for lib in alternate(rep, ["raydcp", "boto3"]):
                    t = run(lib, op, rep)
                    if rep:
                        times.setdefault(f"s3 {op} {lib}", []).append(t)
            if rep:
                log_repeat("s3", rep, times)
    finally:
        moto.terminate()


def log_repeat(what: str, rep: int, times: dict[str, list[float]]) -> None:
    """One line per repeat: the latest time of each measure of ``what``."""
    log(f"  {what} repeat {rep}: " + "  ".join(f"{k} {v[-1]:.3f}" for k, v in times.items() if k.startswith(what)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="size of the state, all ranks together (64 tensors)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", nargs="+", choices=["restore", "tmpfs", "async", "reshard", "s3"],
                    default=["restore", "tmpfs", "async", "reshard", "s3"])
    ap.add_argument("--profile", action="store_true", help="profile one raymem restore per world size")
    ap.add_argument("--s3-mib", type=int, default=64, help="size of the state of the S3 goal (one process)")
    args = ap.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    warnings.filterwarnings("ignore")
    info, loads = machine(), LoadRange()
    specs = {k: dataset(k, args.mib, 0) for k in ("large", "warm")}
    size = nbytes(specs["large"])
    log(f"machine: {info['nproc']} CPUs, {info['mem_gib']} GiB RAM; load average {info['loadavg']}; "
        f"{size / MIB:.0f} MiB in {len(specs['large'])} tensors")
    import ray

    repo = str(Path(__file__).resolve().parent.parent)
    env = {"PYTHONPATH": os.pathsep.join([repo, str(Path(__file__).resolve().parent)])}
    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR", object_store_memory=max(1 << 30, 3 * size), runtime_env={"env_vars": env})
    times: dict[str, list[float]] = {}
    ranks = None
    try:
        ranks = Ranks(specs)
        if "restore" in args.only:
            run_restore(args, ranks, specs, times)
        if "tmpfs" in args.only:
            run_tmpfs(args, ranks, specs, times)
        if "reshard" in args.only:
            run_reshard(args, ranks, specs, times, info)
        if "async" in args.only:
            run_async(args, specs, times)
        if "s3" in args.only:
            run_s3(args, times, info)
    finally:
        if ranks is not None:
            ranks.close()
        ray.shutdown()
    report(args, info, loads, size, times)


def report(args, info: dict, loads: LoadRange, size: int, times: dict) -> None:
    med = {k: median(v) for k, v in times.items()}
    rows, goals = [], {}
    for w in (SAVERS, MORE):
        r, lim = med.get(f"restore 4->{w} raydcp"), med.get(f"restore 4->{w} limit")
        if r is not None:
            ok = r / lim <= 2.0
            rows.append([f"restore raymem 4->{w}", r, lim, r / lim, "<= 2", "met" if ok else "MISSED"])
            goals[f"restore 4->{w}"] = ok
            plain = med.get(f"restore 4->{w} raydcp atomic=False")
            if plain is not None:  # without the undo copy a failed load takes to give the tensors back
                rows.append([f"restore raymem 4->{w}, LoadOptions(atomic=False)", plain, lim, plain / lim,
                             "reported", ""])
    for name in ("1 process", "4 ranks"):
        r = med.get(f"tmpfs {name} raydcp")
        if r is not None:
            lim = min(v for k, v in med.items() if k.startswith(f"tmpfs {name} limit"))
            ok = lim / r >= 0.8
            rows.append([f"save to tmpfs, {name}", r, lim, r / lim, "<= 1.25", "met" if ok else "MISSED"])
            goals[f"tmpfs {name}"] = ok
    r, lim = med.get("reshard 4->6 raydcp"), med.get("reshard 4->6 limit")
    if r is not None:
        ok = r / lim <= 2.5
        moved = info.get("reshard_bytes_moved", 0)
        rows.append([f"ShardGroup.reshard 4->6 ({moved / MIB:.0f} MiB move)", r, lim, r / lim, "<= 2.5",
                     "met" if ok else "MISSED"])
        goals["reshard 4->6"] = ok
    for op in ("save", "load"):
        r, lim = med.get(f"s3 {op} raydcp"), med.get(f"s3 {op} boto3")
        if r is not None:
            ok = lim / r >= 0.9
            rows.append([f"S3 (moto) {op}, {info['s3_bytes'] / MIB:.0f} MiB, vs boto3", r, lim, r / lim, "<= 1.11",
                         "met" if ok else "MISSED"])
            goals[f"s3 {op}"] = ok
    for name in ("local", "ray", "ray prepared"):
        steady, mem = med.get(f"async {name} steady"), med.get(f"async {name} memcpy")
        if steady is None:
            continue
        first = med[f"async {name} first"]
        what = {"local": "async_save, local persister", "ray": "async_save, Ray persister (4 ranks)",
                "ray prepared": "async_save, Ray persister, after prepare_group"}[name]
        if name != "ray prepared":
            ok = steady / mem <= 1.2
            rows.append([f"{what}, later calls", steady, mem, steady / mem, "<= 1.2", "met" if ok else "MISSED"])
            goals[f"async {name} steady"] = ok
        # the first call of a process: with the Ray persister after prepare_group (the goal), else
        # (no preparation: the local persister has none) reported
        ok = first / mem <= 1.2
        prepared = name == "ray prepared"
        rows.append([f"{what}, first call", first, mem, first / mem, "<= 1.2" if prepared else "reported",
                     ("met" if ok else "MISSED") if prepared else ""])
        if prepared:
            goals[f"async {name} first"] = ok
    info["loadavg_during"] = str(loads)
    print(f"\n## limits  ({info['date']}, {info['nproc']} CPUs, {info['mem_gib']} GiB RAM; 1-minute load average "
          f"during the run {loads})\n")
    print(f"command: {argv_line()}\n")
    print(f"{size / MIB:.0f} MiB in 64 float32 tensors (4 ranks: dim-0 pieces); medians of {args.repeats}\n")
    print(table(["goal", "raydcp s", "limit s", "raydcp / limit", "goal", ""], rows))
    out = save_json("limits", {"machine": info, "args": vars(args), "bytes": size, "times": times, "median": med,
                               "goals": goals})
    log(f"results: {out}")


if __name__ == "__main__":
    main()
