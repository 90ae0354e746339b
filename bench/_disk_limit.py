"""The disk's write limit for one save's layout, measured without raydcp.

The same bytes in the same files, written by as many processes at once as the save had ranks (a
process writes its files in as many threads as the save's ranks did), every file fsynced, then one
process publishes a metadata file of the committed size atomically (temporary file, fsync, rename,
fsync of the directory). Each file is written one of three ways, and the fastest way counts as the
limit (medians of the repeats):

  plain      ``write`` of the whole file, then ``fsync`` (what torch DCP's FileSystemWriter does)
  overlap    ``write`` 4 MiB at a time, starting the writeback of each piece at once
             (``sync_file_range(SYNC_FILE_RANGE_WRITE)``), then ``fsync``
  direct     ``O_DIRECT`` writes from an aligned buffer (the page cache skipped), then ``fsync``

``layout_of(path)`` reads a committed raydcp checkpoint's layout (rank -> its data files' sizes);
``DiskLimit(layout).run(directory, way)`` times one write of it (the slowest process), a time the
same as a save's: from the moment every process starts until the metadata is durable.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _util import stop_processes

WAYS = ("plain", "overlap", "direct")
CHUNK = 4 << 20
_ALIGN = 4096
_SFR_WRITE = 2  # SYNC_FILE_RANGE_WRITE
_RANK_FILE = re.compile(r"r(\d+)-f(\d+)\.bin$")


def layout_of(path: str) -> tuple[dict[int, list[int]], int]:
    """``({rank: [file sizes in file order]}, metadata bytes)`` of the checkpoint at ``path``."""
    root = Path(path)
    ranks: dict[int, list[tuple[int, int]]] = {}
    for f in (root / "data").rglob("*.bin"):
        m = _RANK_FILE.search(f.name)
        if m:
            ranks.setdefault(int(m.group(1)), []).append((int(m.group(2)), f.stat().st_size))
    if not ranks:
        raise RuntimeError(f"no data files of raydcp's naming under {root / 'data'}")
    meta = sum(f.stat().st_size for f in root.iterdir() if f.is_file())
    return {r: [size for _, size in sorted(files)] for r, files in sorted(ranks.items())}, meta


def _libc():
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


def _write_file(path: str, view: memoryview, way: str, libc) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if way == "direct":
        flags |= os.O_DIRECT
    fd = os.open(path, flags, 0o644)
    try:
        if way == "direct":  # whole aligned blocks; the tail is written without O_DIRECT
            body = len(view) // _ALIGN * _ALIGN
            off = 0
            while off < body:
                off += os.write(fd, view[off:min(off + CHUNK, body)])
            if body < len(view):
                os.close(fd)
                fd = os.open(path, os.O_WRONLY)
                os.pwrite(fd, view[body:], body)
        elif way == "overlap" and libc is not None:
            off = 0
            while off < len(view):
                n = os.write(fd, view[off:off + CHUNK])
                libc.sync_file_range(fd, ctypes.c_longlong(off), ctypes.c_longlong(n), _SFR_WRITE)
                off += n
        else:
            off = 0
            while off < len(view):
                off += os.write(fd, view[off:])
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(directory: str, nbytes: int) -> None:
    tmp, final = os.path.join(directory, ".metadata.tmp"), os.path.join(directory, ".metadata")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"\0" * nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _worker(rank: int, sizes: list[int], threads: int, meta_bytes: int, conn, barrier) -> None:
    libc = _libc()
    total = sum(-(-s // _ALIGN) * _ALIGN for s in sizes)
    buf = mmap.mmap(-1, max(total, _ALIGN))  # page-aligned (O_DIRECT needs it)
    buf.write(os.urandom(1 << 20) * (len(buf) >> 20) + os.urandom(len(buf) & ((1 << 20) - 1)))
    whole = memoryview(buf)
    views, off = [], 0
    for s in sizes:
        views.append(whole[off:off + s])
        off += -(-s // _ALIGN) * _ALIGN
    pool = ThreadPoolExecutor(max(1, min(threads, len(sizes))))
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        directory, way = msg
        try:
            os.makedirs(os.path.join(directory, "data"), exist_ok=True)
            paths = [os.path.join(directory, "data", f"r{rank:05d}-f{i:03d}.bin") for i in range(len(sizes))]
            barrier.wait()
            t0 = time.perf_counter()
            list(pool.map(lambda pv: _write_file(pv[0], pv[1], way, libc), zip(paths, views)))
            barrier.wait()  # the metadata is published after every rank's data is durable
            if rank == 0:
                _publish(directory, meta_bytes)
            conn.send(("ok", time.perf_counter() - t0))
        except Exception as exc:  # noqa: BLE001 - reported to the driver
            barrier.abort()
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    pool.shutdown()
    del views, whole
    buf.close()


class DiskLimit:
    """One process per rank of ``layout`` (``{rank: file sizes}``), started once and kept."""

    def __init__(self, layout: dict[int, list[int]], meta_bytes: int, threads: int = 8):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        barrier = ctx.Barrier(len(layout))
        self.conns, self.procs = [], []
        for rank, sizes in layout.items():
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, sizes, threads, meta_bytes, child, barrier), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            if c.recv() != "ready":
                raise RuntimeError("a disk-limit process did not start")
        self.nbytes = sum(sum(s) for s in layout.values())

    def run(self, directory: str, way: str) -> float:
        """Seconds for one write of the layout into ``directory`` (the slowest process)."""
        if way not in WAYS:
            raise ValueError(f"way must be one of {WAYS}, got {way!r}")
        for c in self.conns:
            c.send((directory, way))
        answers = [c.recv() for c in self.conns]
        bad = [a[1] for a in answers if a[0] != "ok"]
        if bad:
            raise RuntimeError(f"disk-limit write ({way}) failed: {bad[0]}")
        return max(a[1] for a in answers)

    def close(self) -> None:
        stop_processes(self.conns, self.procs, None)


class DiskSide:
    """The disk's write limit as a side of ``bench/distributed.py``: each repeat writes the layout of
    raydcp's save of the large set every way (``WAYS``), with the same memory refill before each."""

    name = "disk limit"

    def __init__(self, layout: dict[int, list[int]], meta_bytes: int, threads: int):
        self.limit = DiskLimit(layout, meta_bytes, threads)
        self.files = sum(len(s) for s in layout.values())

    def _write(self, root: str, way: str) -> float:
        import shutil

        from _util import refill_free_memory

        path = os.path.join(root, f"disk-{way}")
        refill_free_memory()
        try:
            return self.limit.run(path, way)
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def warm_up(self, root: str) -> str:
        for way in WAYS:
            self._write(root, way)
        return f"{self.files} files of raydcp's layout written each way ({', '.join(WAYS)})"

    def repeat(self, root: str) -> dict:
        return {f"save ({way})": self._write(root, way) for way in WAYS}

    repeat_save = repeat

    def close(self) -> None:
        self.limit.close()
