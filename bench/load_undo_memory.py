"""Peak extra memory of ``raydcp.load`` with and without its undo copy (``LoadOptions(atomic=)``).

One process per measurement (a fresh heap each): the state (--count tensors of --mib MiB each,
float32, resident) is loaded from a checkpoint in the page cache, saved once beforehand; a thread
samples the resident set size (``/proc/self/statm``) every half millisecond during the load. Printed:
peak RSS during the load minus RSS before it, against the state's size, and the load's wall time.
The difference between the two modes is the undo copy (docs/loading.md).

    python bench/load_undo_memory.py                      # 24 x 16 MiB, each mode twice
    python bench/load_undo_memory.py --count 100000 --kib 1  # many small tensors
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _state(count: int, numel: int, fill: float):
    import torch

    return {f"t{i}": torch.full((numel,), fill + i) for i in range(count)}


def measure(ck: str, atomic: bool, count: int, numel: int) -> str:
    import raydcp

    dest = _state(count, numel, -1.0)  # written: resident
    size = sum(t.nbytes for t in dest.values())
    base, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.perf_counter()
    try:
        raydcp.load(dest, ck, options=raydcp.LoadOptions(atomic=atomic))
    finally:
        seconds = time.perf_counter() - t0
        done.set()
        sampler.join()
    extra = max(peak[0], _rss()) - base
    return (f"atomic={atomic!s:5}  state {size / 2**20:8.1f} MiB  peak extra RSS {extra / 2**20:8.1f} MiB "
            f"({extra / size:.2f} x state)  load {seconds:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=24, help="tensors in the state")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--mib", type=float, default=None, help="MiB per tensor (default 16)")
    size.add_argument("--kib", type=float, default=None, help="KiB per tensor")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--_measure", nargs=2, metavar=("CKPT", "ATOMIC"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    nbytes = int((args.kib * 1024) if args.kib is not None else (args.mib or 16) * 2**20)
    numel = max(1, nbytes // 4)
    if args._measure:
        print(measure(args._measure[0], args._measure[1] == "1", args.count, numel), flush=True)
        return
    import raydcp

    with tempfile.TemporaryDirectory() as tmp:
        ck = os.path.join(tmp, "ck")
        raydcp.save(_state(args.count, numel, 1.0), ck)
        for _ in range(args.repeats):
            for atomic in ("1", "0"):
                subprocess.run([sys.executable, __file__, "--count", str(args.count), "--kib", str(nbytes / 1024),
                                "--_measure", ck, atomic], check=True)


if __name__ == "__main__":
    main()
