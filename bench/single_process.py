"""Single-process save and load: raydcp against torch.save/torch.load and torch DCP, same data, same run.

Two data sets:
  large  1 GiB in 64 float32 tensors (16 MiB each)
  small  100k float32 tensors of 64-256 elements (--small-count to shrink)

Peers, at equal durability (every file fsynced before the save returns):
  raydcp      raydcp.save / raydcp.load (group=None), load fills preallocated tensors in place
  torch.save  torch.save to an open file + flush + os.fsync; torch.load(weights_only=True, mmap=False)
  torch DCP   torch.distributed.checkpoint.save / load in one process without a process group,
              FileSystemWriter defaults (sync_files=True, thread_count=1); load fills in place
  disk        the limit: the same bytes written with large writes to one file + fsync, and read
              back with readinto into preallocated buffers

Every repeat saves then immediately loads with each library in turn (the order rotates from
repeat to repeat), so each load finds its files in the page cache alike (--cold evicts them with
posix_fadvise(DONTNEED) before every load instead). Loaded values are compared with the saved
ones for every library. Medians of --repeats are reported; ratios are peer time / raydcp time.

    python bench/single_process.py                        # full size, ~3-5 minutes on 2 cores
    python bench/single_process.py --large-mib 128 --small-count 10000 --repeats 1   # quick
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import shutil
import signal
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import GC, RESULTS, LoadRange, argv_line, goal, log, machine, measured, median, save_json, table, timed  # noqa: E402

import raydcp  # noqa: E402

warnings.filterwarnings("ignore")  # DCP warns that it runs without a process group: intended here

GB = 1e9


# ----------------------------------------------------------------------------- data

def make_large(total_mib: int, n: int = 64) -> dict[str, torch.Tensor]:
    per = total_mib * (1 << 20) // n // 4  # float32 elements per tensor
    cols = 1024 if per % 1024 == 0 else 1
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(per // cols, cols, generator=g) for i in range(n)}


def make_small(count: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(64, 257, (count,), generator=g).tolist()
    flat = torch.randn(sum(sizes), generator=g)
    out, pos = {}, 0
    for i, n in enumerate(sizes):
        out[f"blocks.{i // 100}.p{i % 100}"] = flat[pos:pos + n].clone()
        pos += n
    return out


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def blank_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Destination tensors, touched and filled with NaN so that a load that writes nothing fails verification."""
    return {k: torch.full_like(v, float("nan")) for k, v in state.items()}


def verify(name: str, saved: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    if set(saved) != set(loaded):
        raise AssertionError(f"{name}: loaded keys differ ({len(saved)} saved, {len(loaded)} loaded)")
    bad = [k for k, v in saved.items() if not torch.equal(v, loaded[k])]
    if bad:
        raise AssertionError(f"{name}: {len(bad)} tensors differ after load, e.g. {bad[:3]}")


def evict(path: str) -> None:
    """Drop the clean pages of every file under ``path`` from the page cache (they were fsynced)."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------- libraries
# Each has save(state, path) (timed), load(path, state) -> loaded dict (timed) and
# prepare_load(state) (untimed: what a training job already has, e.g. its model's tensors).

class Disk:
    name = "disk (raw)"

    def __init__(self, state):
        # large writes: a data set of small tensors is joined into one buffer beforehand (untimed)
        ts = list(state.values())
        self.bufs = ts if len(ts) <= 1024 else [torch.cat([t.reshape(-1) for t in ts])]

    def save(self, state, path):
        with open(path, "wb") as f:
            for t in self.bufs:
                f.write(t.numpy().data.cast("B"))
            f.flush()
            os.fsync(f.fileno())

    def prepare_load(self, state):
        return [torch.full_like(t, float("nan")) for t in self.bufs]

    def load(self, path, dest):
        with open(path, "rb", buffering=0) as f:
            for t in dest:
                view = t.numpy().data.cast("B")
                got = 0
                while got < len(view):
                    n = f.readinto(view[got:])
                    if not n:
                        raise EOFError(path)
                    got += n
        return dest

    def check(self, state, loaded):
        if not all(torch.equal(a, b) for a, b in zip(self.bufs, loaded)):
            raise AssertionError("disk: read back differs")


class DiskParallel(Disk):
    """The same bytes in as many files as raydcp writes (256 MiB each), written and read by one thread per file."""

    def __init__(self, state, file_bytes: int = 256 << 20, max_workers: int = 8):
        super().__init__(state)
        self.files: list[list[torch.Tensor]] = [[]]
        size = 0
        for t in self.bufs:
            n = t.numel() * t.element_size()
            if self.files[-1] and size + n > file_bytes:
                self.files.append([])
                size = 0
            self.files[-1].append(t)
            size += n
        self.workers = min(max_workers, len(self.files))
        self.name = f"disk ({len(self.files)} files)"

    def _map(self, fn, items):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.workers) as pool:
            return list(pool.map(fn, items))

    def save(self, state, path):
        os.makedirs(path)

        def write(i):
            with open(os.path.join(path, f"f{i}"), "wb") as f:
                for t in self.files[i]:
                    f.write(t.numpy().data.cast("B"))
                f.flush()
                os.fsync(f.fileno())

        self._map(write, range(len(self.files)))

    def prepare_load(self, state):
        return [[torch.full_like(t, float("nan")) for t in ts] for ts in self.files]

    def load(self, path, dest):
        self._map(lambda i: Disk.load(self, os.path.join(path, f"f{i}"), dest[i]), range(len(self.files)))
        return [t for ts in dest for t in ts]


class RayDCP:
    name = "raydcp"

    def save(self, state, path):
        raydcp.save(state, path)

    def prepare_load(self, state):
        return blank_like(state)

    def load(self, path, dest):
        stats = raydcp.load(dest, path)
        if stats.bytes_read != stats.bytes_needed:
            raise AssertionError(f"raydcp read {stats.bytes_read} bytes for {stats.bytes_needed} needed")
        return dest


class TorchSave:
    name = "torch.save"

    def save(self, state, path):
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def prepare_load(self, state):
        return None  # torch.load allocates its own tensors: that is its API

    def load(self, path, dest):
        return torch.load(path, weights_only=True, mmap=False)


class TorchDCP:
    name = "torch DCP"

    def __init__(self):
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp

    def save(self, state, path):
        self.dcp.save(state, storage_writer=self.dcp.FileSystemWriter(path))  # sync_files=True by default

    def prepare_load(self, state):
        return blank_like(state)

    def load(self, path, dest):
        self.dcp.load(dest, storage_reader=self.dcp.FileSystemReader(path))
        return dest


# ----------------------------------------------------------------------------- runner

def run_set(label: str, state, root: str, repeats: int, cold: bool, loads: LoadRange) -> dict:
    total = nbytes(state)
    libs = [Disk(state), RayDCP(), TorchSave(), TorchDCP()]
    par = DiskParallel(state)
    if len(par.files) > 1:  # the disk may write faster from several streams: measure that limit too
        libs.insert(1, par)
    keys = ("save", "load", "save_cpu", "load_cpu", "save_gc", "load_gc")
    times = {lib.name: {k: [] for k in keys} for lib in libs}
    for rep in range(repeats):
        order = libs[rep % len(libs):] + libs[:rep % len(libs)]
        for lib in order:
            path = os.path.join(root, f"{label}-{lib.name.split()[0].replace('.', '_')}")
            gc.collect()
            ts, cs, gs, _ = measured(lambda: lib.save(state, path))
            dest = lib.prepare_load(state)
            if cold:
                evict(path)
            gc.collect()
            tl, cl, gl, loaded = measured(lambda: lib.load(path, dest))
            (lib.check if isinstance(lib, Disk) else lambda s, l: verify(lib.name, s, l))(state, loaded)
            del loaded, dest
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            for k, v in zip(keys, (ts, tl, cs, cl, gs, gl)):
                times[lib.name][k].append(v)
            log(f"  {label} repeat {rep + 1}/{repeats} {lib.name:15s} save {ts:7.3f} s (cpu {cs:6.2f}, gc {gs:5.2f})  "
                f"load {tl:7.3f} s (cpu {cl:6.2f}, gc {gl:5.2f})  verified; load average {loads.sample()}")
    med = {name: {k: median(v) for k, v in d.items()} for name, d in times.items()}
    return {"bytes": total, "tensors": len(state), "times": times, "median": med}


def _ratios(stat: dict, disks: list[str], suffix: str = "") -> dict[str, float]:
    r = stat["raydcp"]
    out = {
        "torch.save/raydcp save": stat["torch.save"]["save" + suffix] / r["save" + suffix],
        "torch.save/raydcp load": stat["torch.save"]["load" + suffix] / r["load" + suffix],
        "DCP/raydcp save": stat["torch DCP"]["save" + suffix] / r["save" + suffix],
        "DCP/raydcp load": stat["torch DCP"]["load" + suffix] / r["load" + suffix],
    }
    if not suffix:
        for d in disks:
            out[f"raydcp save % of {d}"] = 100 * stat[d]["save"] / r["save"]
    return out


def report(label: str, res: dict) -> tuple[str, dict]:
    med, total = res["median"], res["bytes"]
    best = {name: {k: min(v) for k, v in d.items()} for name, d in res["times"].items()}
    r = med["raydcp"]
    names = list(med)
    disks = [n for n in names if n.startswith("disk")]
    n = len(res["times"]["raydcp"]["save"])
    rows = []
    for name in names:
        m = med[name]
        rows.append([name, m["save"], m["load"], total / m["save"] / GB, total / m["load"] / GB,
                     m["save"] / r["save"], m["load"] / r["load"], m["save_cpu"], m["load_cpu"],
                     m["save_gc"] + m["load_gc"]])
    ratios, best_ratios, cpu_ratios = _ratios(med, disks), _ratios(best, disks), _ratios(med, disks, "_cpu")
    text = [f"### {label}: {res['tensors']} tensors, {total / GB:.3f} GB (median of {n})",
            "",
            table(["library", "save s", "load s", "save GB/s", "load GB/s", "save time / raydcp",
                   "load time / raydcp", "save CPU s", "load CPU s", "gc s (save+load)"], rows),
            ""]
    if label == "large":  # goal (a)
        fastest = min(disks, key=lambda d: med[d]["save"])
        pct = f"raydcp save % of {fastest}"
        checks = [("(a) save >= 1.0x torch.save", "torch.save/raydcp save", ">= 1.0", 1.0),
                  (f"(a) save >= 70% of the disk limit ({fastest}, the faster)", pct, ">= 70 %", 70.0)]
    else:  # goal (b)
        checks = [("(b) save >= 10x DCP", "DCP/raydcp save", ">= 10", 10.0),
                  ("(b) load >= 10x DCP", "DCP/raydcp load", ">= 10", 10.0)]
    text += [table(["goal", "measured (medians)", "target", "status", f"best of {n} each", "CPU-time ratio"],
                   [[c[0], ratios[c[1]], c[2], goal(ratios[c[1]] >= c[3]), best_ratios[c[1]],
                     cpu_ratios.get(c[1]) if label == "small" else None] for c in checks]), ""]
    text += ["Ratios of medians (peer time / raydcp time; raydcp save as % of a disk limit = disk time / raydcp time): "
             + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()), "",
             f"Ratios of the best of {n} (a check on a busy machine): "
             + ", ".join(f"{k} {v:.2f}" for k, v in best_ratios.items()), "",
             "Ratios of median CPU seconds (user + system, all threads; meaningful for CPU-bound work such as"
             " the small set; for the large set much of the CPU of writing back pages is the kernel's, not the"
             " process's): "
             + ", ".join(f"{k} {v:.2f}" for k, v in cpu_ratios.items()), ""]
    return "\n".join(text), {"ratios": ratios, "best_ratios": best_ratios, "cpu_ratios": cpu_ratios,
                             "goals": {c[0]: ratios[c[1]] >= c[3] for c in checks}}


def profile_raydcp(label: str, state, root: str, top: int) -> None:
    """One more raydcp save and load under cProfile (main thread; file writes run in a thread pool)."""
    path = os.path.join(root, f"{label}-profile")
    RESULTS.mkdir(parents=True, exist_ok=True)
    for op in ("save", "load"):
        dest = blank_like(state) if op == "load" else None
        gc.collect()
        prof = cProfile.Profile()
        g0, c0 = GC.total, GC.collections
        t, _ = timed(lambda: (prof.enable(), raydcp.save(state, path) if op == "save" else raydcp.load(dest, path),
                              prof.disable()))
        g, c = GC.total - g0, GC.collections - c0
        out = RESULTS / f"single_process-{label}-raydcp-{op}.prof"
        prof.dump_stats(out)
        print(f"\n--- cProfile raydcp {op} ({label}): {t:.2f} s under the profiler, of which {g:.2f} s in "
              f"{c} garbage collections; full stats in {out}")
        for key, what in (("cumulative", "by cumulative time"), ("tottime", "by own time")):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(r"raydcp|\{built-in|\{method", top)
            lines = [ln.replace(str(Path(raydcp.__file__).parent.parent) + "/", "")
                     for ln in buf.getvalue().splitlines() if ln.strip()]
            start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
            print(f"  {what}:")
            print("\n".join(lines[start:]))
    shutil.rmtree(path)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (label, res) in zip(axes[0], results.items()):
        names = list(res["median"])
        x = range(len(names))
        gbs_s = [res["bytes"] / res["median"][n]["save"] / GB for n in names]
        gbs_l = [res["bytes"] / res["median"][n]["load"] / GB for n in names]
        ax.bar([i - 0.2 for i in x], gbs_s, 0.4, label="save")
        ax.bar([i + 0.2 for i in x], gbs_l, 0.4, label="load")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("GB/s (higher is better)")
        ax.set_title(f"{label}: {res['tensors']} tensors, {res['bytes'] / GB:.2f} GB")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory to write checkpoints in (default: a temp dir under /tmp)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--large-mib", type=int, default=1024, help="size of the large data set (64 tensors)")
    ap.add_argument("--small-count", type=int, default=100_000, help="tensors in the small data set")
    ap.add_argument("--only", choices=["large", "small"], help="run one data set")
    ap.add_argument("--cold", action="store_true", help="evict each checkpoint's files from the page cache before its load")
    ap.add_argument("--profile", action="store_true", help="also cProfile one raydcp save and load per data set")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the temp dir is removed when killed
    info = machine()
    loads = LoadRange()
    root = tempfile.mkdtemp(prefix="raydcp-bench-", dir=args.dir or "/tmp")
    log(f"machine: {info['nproc']} CPUs, {info['mem_gib']} GiB RAM, torch {info['torch']}; load average {info['loadavg']}; writing under {root}")
    sets = {"large": lambda: make_large(args.large_mib), "small": lambda: make_small(args.small_count)}
    if args.only:
        sets = {args.only: sets[args.only]}
    results, texts, summary = {}, [], {}
    try:
        for label, make in sets.items():
            log(f"{label}: generating data")
            state = make()
            log(f"{label}: {len(state)} tensors, {nbytes(state) / GB:.3f} GB; {args.repeats} repeats"
                f"{' (cold loads)' if args.cold else ''}")
            res = run_set(label, state, root, args.repeats, args.cold, loads)
            results[label] = res
            text, summ = report(label, res)
            texts.append(text)
            summary[label] = summ
            print("\n" + text, flush=True)
            if args.profile:
                profile_raydcp(label, state, root, 20)
            del state
            gc.collect()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    info["loadavg_during"] = str(loads)
    print(f"\n## single_process  ({info['date']}, {info['nproc']} CPUs, {info['mem_gib']} GiB RAM;"
          f" 1-minute load average during the run {loads})\n")
    print(f"command: {argv_line()}  (raydcp at {info['revision']})\n")
    print("\n".join(texts))
    out = save_json("single_process" + ("-cold" if args.cold else ""),
                    {"machine": info, "args": vars(args), "results": results, "summary": summary})
    log(f"results: {out}")
    if not args.no_plot:
        png = RESULTS / ("single_process" + ("-cold" if args.cold else "") + ".png")
        plot(results, png)
        log(f"plot: {png}")


if __name__ == "__main__":
    main()
