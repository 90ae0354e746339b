"""async_save: how long it blocks the caller, and how much a background persist slows training.

In one run, on the same data:
1. the time a synchronous ``raydcp.save`` takes, the time ``raydcp.async_save``
   blocks (staging), and the machine's memcpy bandwidth measured on the same
   bytes (the floor for staging);
2. training step time (a CPU MLP, forward + backward + AdamW) with no save
   running, and while a background persist of the state runs.

Goals: blocking <= 0.15x the sync save and <= 1.2x staged bytes / memcpy bandwidth;
step time during a persist >= 0.95x of without (reported as speed ratio).

Run: .venv/bin/python bench/async_save.py [--mib 512] [--repeats 3] [--dir /tmp/x]
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import torch

import raydcp
from _util import goal, log, machine, median, save_json, table


def make_state(mib: int) -> dict:
    n = 32
    per = (mib << 20) // n // 4
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.w": torch.randn(per, generator=g) for i in range(n)}


def memcpy_seconds(state: dict) -> float:
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    for k, v in state.items():  # touch the pages first: measure copying, not page faults
        dst[k].copy_(v)
    t0 = time.perf_counter()
    for k, v in state.items():
        dst[k].copy_(v)
    return time.perf_counter() - t0


def train_steps(model, opt, steps: int) -> float:
    """Median seconds per training step."""
    times = []
    x = torch.randn(256, 1024)
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="raydcp-bench-async-")
    state = make_state(args.mib)
    nbytes = sum(v.numel() * 4 for v in state.values())
    log(f"{nbytes / 2**20:.0f} MiB in {len(state)} tensors under {root}")

    # Each repeat measures memcpy, the sync save and the async call back to back, and the ratios
    # are taken per repeat (medians of ratios): on a shared machine the speed of memory and disk
    # moves from minute to minute, so ratios of medians taken minutes apart mislead.
    sync_s, block_s, total_s, mem_s = [], [], [], []
    raydcp.async_save(state, f"{root}/warm").result()  # start the helper, allocate the arena
    for r in range(args.repeats):
        log(f"repeat {r + 1}/{args.repeats}")
        mem_s.append(memcpy_seconds(state))
        t0 = time.perf_counter()
        raydcp.save(state, f"{root}/sync")
        sync_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fut = raydcp.async_save(state, f"{root}/async")
        block_s.append(time.perf_counter() - t0)
        fut.result()
        total_s.append(time.perf_counter() - t0)
    sync, block, mem = median(sync_s), median(block_s), median(mem_s)
    block_vs_sync = median([b / s for b, s in zip(block_s, sync_s)])
    block_vs_mem = median([b / m for b, m in zip(block_s, mem_s)])

    log("training steps without and during a background persist")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 1024))
    opt = torch.optim.AdamW(model.parameters())
    train_steps(model, opt, 5)
    idle, during, speeds = [], [], []
    for _ in range(args.repeats):  # idle steps right before each persist, then steps during it
        before = [train_steps(model, opt, 1) for _ in range(10)]
        fut = raydcp.async_save(state, f"{root}/during")
        t_steps = []
        while not fut.done():
            t_steps.append(train_steps(model, opt, 1))
        fut.result()
        idle.extend(before)
        during.extend(t_steps)
        if t_steps:
            speeds.append(median(before) / median(t_steps))
    base = median(idle)
    busy = median(during) if during else float("nan")
    shutil.rmtree(root, ignore_errors=True)

    rows = [
        ["sync raydcp.save", sync, "1.00"],
        ["async_save blocking (staging)", block, f"{block / sync:.3f}"],
        ["async_save until committed", median(total_s), f"{median(total_s) / sync:.2f}"],
        ["memcpy of the same bytes", mem, f"{mem / sync:.3f}"],
    ]
    print(table(["what", "seconds", "x sync save"], rows))
    speed = median(speeds) if speeds else float("nan")
    print(table(["training step", "seconds"], [["no save running", base], [f"during persist ({len(during)} steps)", busy]]))
    print("ratios: medians over the repeats of each repeat's own ratio")
    print(f"blocking / sync save = {block_vs_sync:.3f}  (goal <= 0.15: {goal(block_vs_sync <= 0.15)})")
    print(f"blocking / memcpy    = {block_vs_mem:.2f}   (goal <= 1.2: {goal(block_vs_mem <= 1.2)})")
    print(f"step speed during persist = {speed:.2f}x of idle  (goal >= 0.95: {goal(speed >= 0.95)}; "
          f"per repeat: {', '.join(f'{x:.2f}' for x in speeds)})")
    save_json("async_save", {"machine": machine(), "bytes": nbytes, "sync_s": sync, "block_s": block,
                             "memcpy_s": mem, "total_s": median(total_s), "step_idle_s": base,
                             "step_busy_s": busy, "steps_during": len(during), "block_vs_sync": block_vs_sync,
                             "block_vs_memcpy": block_vs_mem, "step_speed": speed, "step_speeds": speeds,
                             "per_repeat": {"sync_s": sync_s, "block_s": block_s, "memcpy_s": mem_s}})


if __name__ == "__main__":
    main()
