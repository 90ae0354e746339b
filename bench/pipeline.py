"""The checkpoint pipeline: the stall training sees with tiers, against a direct save to the remote tier.

In one run, on the same data, with S3 served by moto on loopback (in its own process, so its
request handling does not share the trainer's GIL) and the pipeline coordinator as a Ray actor:

1. ``raydcp.async_save`` to a local directory: the stall of the local save (the goal);
2. ``CheckpointPipeline([local, s3://...]).save``: its stall, and how long until the copy on s3 is
   committed (replication, verification and retention run on the cluster meanwhile);
3. ``raydcp.save`` straight to s3 (synchronous): the stall is the whole upload;
4. ``raydcp.async_save`` straight to s3: the stall, and the time until committed;
5. training step time (a CPU MLP) with nothing running, and while the pipeline replicates.

Goal: pipeline stall <= 1.2x the local async_save stall (remote persistence fully hidden). The step
speed while replicating is reported, not a goal here: on a small machine the moto server (a
Python process parsing every upload) competes with training for the same cores, which a real
object store does not.

Run: .venv/bin/python bench/pipeline.py [--mib 256] [--repeats 3] [--dir /tmp/x]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import raydcp
from raydcp.pipeline import CheckpointPipeline, RetryPolicy

RESULTS = Path(__file__).resolve().parent / "results"
BUCKET = "raydcp-bench"
KEYS = {"key": "bench", "secret": "bench-secret"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, dict]:
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("moto_server did not start")
            time.sleep(0.1)
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=KEYS["key"],
                 aws_secret_access_key=KEYS["secret"]).create_bucket(Bucket=BUCKET)
    return proc, {**KEYS, "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def make_state(mib: int) -> dict:
    n = 32
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.w": torch.randn((mib << 20) // n // 4, generator=g) for i in range(n)}


def train_steps(model, opt, steps: int) -> list[float]:
    x = torch.randn(256, 1024)
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        out.append(time.perf_counter() - t0)
    return out


def table(headers, rows) -> str:
    cells = [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) if i == 0 else v.rjust(w)  # noqa: E731
                                        for i, (v, w) in enumerate(zip(vals, widths))) + " |"
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"), "nproc": os.cpu_count(),
            "cpu": cpu, "python": platform.python_version(), "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="raydcp-bench-pipeline-")
    moto, opts = start_moto()
    import ray

    ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING, runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).parents[1])}})
    try:
        run(args, root, opts)
    finally:
        ray.shutdown()
        moto.terminate()
        shutil.rmtree(root, ignore_errors=True)


def run(args, root: str, opts: dict) -> None:
    state = make_state(args.mib)
    nbytes = sum(v.numel() * 4 for v in state.values())
    log(f"{nbytes / 2**20:.0f} MiB in {len(state)} tensors; local tier {root}, remote tier s3://{BUCKET} (moto)")
    remote = f"s3://{BUCKET}/run"
    pipe = CheckpointPipeline([f"{root}/tier0", remote], storage_options=opts, driver="ray",
                              retention={0: {"keep_last": 2}, 1: {"keep_last": 2}},
                              retry=RetryPolicy(attempts=3, initial_s=0.5))
    log("warm-up: helper process, coordinator actor, task workers")
    raydcp.async_save(state, f"{root}/warm").result()
    pipe.save(state, "warm").wait()
    raydcp.save(state, f"{remote}/direct-warm", storage_options=opts)

    local_stall, pipe_stall, pipe_remote, sync_stall, async_stall, async_total = [], [], [], [], [], []
    for r in range(args.repeats):
        log(f"repeat {r + 1}/{args.repeats}")
        t0 = time.perf_counter()
        fut = raydcp.async_save(state, f"{root}/local")
        local_stall.append(time.perf_counter() - t0)
        fut.result()

        t0 = time.perf_counter()
        handle = pipe.save(state, f"step-{r}")
        pipe_stall.append(time.perf_counter() - t0)
        record = handle.wait()
        assert record.state == "complete", record.failures()
        committed = record.entry("committed@1").finished_at
        pipe_remote.append(committed - record.entry("staged@0").started_at)
        last_record = record

        t0 = time.perf_counter()
        raydcp.save(state, f"{remote}/direct-sync", storage_options=opts)
        sync_stall.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        fut = raydcp.async_save(state, f"{remote}/direct-async", storage_options=opts)
        async_stall.append(time.perf_counter() - t0)
        fut.result()
        async_total.append(time.perf_counter() - t0)

    log("training steps without and during replication")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 1024))
    opt = torch.optim.AdamW(model.parameters())
    train_steps(model, opt, 5)
    idle = median(train_steps(model, opt, 30))
    busy: list[float] = []
    for r in range(args.repeats):
        handle = pipe.save(state, f"during-{r}")
        handle.result()  # committed locally: what remains is the pipeline's background work
        while pipe.status(handle.name).state == "running":
            busy += train_steps(model, opt, 1)
        pipe.wait(handle.name)
    pipe.close()

    ls, ps = median(local_stall), median(pipe_stall)
    rows = [
        ["async_save to the local tier (stall)", ls, f"{1.0:.2f}"],
        ["pipeline local+s3 (stall)", ps, f"{ps / ls:.2f}"],
        ["pipeline: until committed on s3", median(pipe_remote), f"{median(pipe_remote) / ls:.1f}"],
        ["raydcp.save straight to s3 (stall)", median(sync_stall), f"{median(sync_stall) / ls:.1f}"],
        ["async_save straight to s3 (stall)", median(async_stall), f"{median(async_stall) / ls:.2f}"],
        ["async_save straight to s3: until committed", median(async_total), f"{median(async_total) / ls:.1f}"],
    ]
    print(table(["what", "seconds", "x local stall"], rows))
    print(table(["pipeline stage (last repeat)", "seconds", "MiB/s"],
                [[e.key, e.seconds or 0.0, f"{e.throughput / 2**20:.0f}" if e.throughput else "-"]
                 for e in last_record.stages]))
    speed = idle / median(busy) if busy else float("nan")
    print(table(["training step", "seconds"], [["nothing running", idle],
                                               [f"while the pipeline replicates ({len(busy)} steps)", median(busy)]]))
    print(f"pipeline stall / local stall = {ps / ls:.2f}  (goal <= 1.2: {'met' if ps / ls <= 1.2 else 'MISSED'})")
    print(f"step speed while replicating = {speed:.2f}x of idle  (moto shares this machine's {os.cpu_count()} cores)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "pipeline.json").write_text(json.dumps({
        "machine": machine(), "bytes": nbytes, "repeats": args.repeats,
        "local_async_stall_s": ls, "pipeline_stall_s": ps, "pipeline_until_remote_committed_s": median(pipe_remote),
        "direct_s3_sync_stall_s": median(sync_stall), "direct_s3_async_stall_s": median(async_stall),
        "direct_s3_async_total_s": median(async_total), "step_idle_s": idle, "step_during_replication_s": median(busy),
        "steps_during": len(busy), "stages_s": {e.key: e.seconds for e in last_record.stages},
    }, indent=2))


if __name__ == "__main__":
    main()
