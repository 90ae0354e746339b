"""Shared helpers of the benchmarks: machine description, timing, tables, results files."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """What the numbers were measured on (recorded beside every result)."""
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gib = round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import torch

    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "mem_gib": mem_gib,
        "cpu": cpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg": loadavg(),
        "revision": revision(),
    }


def revision() -> str:
    """The commit measured, and whether raydcp/ differed from it (the tree is edited while benchmarks run)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "raydcp"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"
    return head + (" + uncommitted changes in raydcp/" if dirty else "")


def loadavg() -> str:
    """The 1-minute load average: other work on a shared machine, the context of every number."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "?"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measured(fn: Callable[[], Any]) -> tuple[float, float, float, Any]:
    """Run ``fn`` once: (wall s, CPU s of this process in all its threads, user + system, gc wall s, result).

    CPU seconds are the contention-robust view of CPU-bound work on a shared machine: other
    processes delay a step's wall time, but barely change the CPU it burns.
    """
    import resource

    r0 = resource.getrusage(resource.RUSAGE_SELF)
    g0 = GC.total
    t0 = time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return wall, cpu, GC.total - g0, out


class LoadRange:
    """The 1-minute load average, sampled as a run goes: other work on the machine meanwhile."""

    def __init__(self):
        self.samples: list[float] = []
        self.sample()

    def sample(self) -> str:
        try:
            self.samples.append(os.getloadavg()[0])
            return f"{self.samples[-1]:.1f}"
        except OSError:
            return "?"

    def __str__(self) -> str:
        if not self.samples:
            return "?"
        return f"{min(self.samples):.1f}-{max(self.samples):.1f} (median {statistics.median(self.samples):.1f})"


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-markdown table (readable in a terminal too)."""
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda vals: "| " + " | ".join(v.rjust(w) if i else v.ljust(w)  # noqa: E731
                                        for i, (v, w) in enumerate(zip(vals, widths))) + " |"
    sep = "|" + "|".join("-" * (w + 1) + (":" if i else "-") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "-"
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        if abs(v) >= 0.1:
            return f"{v:.2f}"
        return f"{v:.3f}"
    return str(v)


def save_json(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str))
    return path


def goal(ok: bool) -> str:
    return "met" if ok else "MISSED"


def argv_line() -> str:
    return " ".join([Path(sys.executable).name, *sys.argv])


class GcTimer:
    """Seconds spent in Python's cyclic garbage collector (it runs inside whatever code allocates)."""

    def __init__(self):
        import gc

        self.total = 0.0  # wall seconds
        self.cpu = 0.0    # CPU seconds of this process
        self.collections = 0
        self._t0 = self._c0 = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase, info):
        if phase == "start":
            self._t0, self._c0 = time.perf_counter(), time.process_time()
        else:
            self.total += time.perf_counter() - self._t0
            self.cpu += time.process_time() - self._c0
            self.collections += 1


GC = GcTimer()


def refill_free_memory(mib: int = 1024) -> None:
    """Touch and free ``mib`` MiB, untimed, right before a timed operation (of either library).

    On a VM whose balloon driver reports free memory to the hypervisor (virtio-balloon free page
    reporting, as on the 2-core machines these benchmarks run on), memory that stayed free for a
    few seconds is unmapped on the host, and the next process to take it pays a host page fault per
    page: after 15 s idle, writing 128 MiB into the page cache took 0.55-0.66 s instead of
    0.03-0.07 s. Which library pays depends on what ran just before and on its untimed set-up, not
    on the library; after this call both find the same host-backed free memory.
    """
    import numpy as np

    block = np.ones(mib << 20, np.uint8)  # large: its own mapping, returned to the kernel when freed
    del block


def fsync_tree(root: str, *, evict: bool = False) -> None:
    """fsync every file under ``root``; ``evict`` also drops them from the page cache (a cold read next)."""
    for d, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                if evict:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def stop_processes(conns: Sequence[Any], procs: Sequence[Any], quit_msg: Any) -> None:
    """Send ``quit_msg`` down every pipe, then join each process (killed after 30 s)."""
    for c in conns:
        try:
            c.send(quit_msg)
        except OSError:
            pass
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
