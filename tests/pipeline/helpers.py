"""Shared by the pipeline tests (importable by Ray workers: hooks live here)."""
from __future__ import annotations

import os
import threading

import torch

from raydcp.pipeline import RetryPolicy
from raydcp.storage import CheckpointStorage

FAST_RETRY = RetryPolicy(attempts=3, initial_s=0.001, max_s=0.01)


def make_state(n: int = 6, numel: int = 1000, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(numel, generator=g) for i in range(n)},
            "ids": torch.arange(7, dtype=torch.int64) + seed, "step": seed, "name": "run"}


def zeros_like_state(state: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "ids": torch.zeros(7, dtype=torch.int64), "step": None, "name": None}


def assert_same(a: dict, b: dict) -> None:
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k  # bit-exact
    assert torch.equal(a["ids"], b["ids"]) and a["step"] == b["step"] and a["name"] == b["name"]


def files_of(url: str, options=None) -> dict[str, bytes]:
    """Every file of a copy (data, metadata; the status record and the path's own commit log,
    ``_raydcp/``, excluded), by name."""
    s = CheckpointStorage(url, options)
    return {n: s.read_file(n) for n in s.list_files() if n != "raydcp.status.json" and not n.startswith("_raydcp/")}


def flip_a_byte(path: str) -> None:
    data_dir = os.path.join(path, "data")
    for root, _, names in os.walk(data_dir):
        for name in sorted(names):
            full = os.path.join(root, name)
            with open(full, "r+b") as f:
                b = f.read(1)
                f.seek(0)
                f.write(bytes([b[0] ^ 0xFF]))
            return
    raise AssertionError(f"no data file under {path}")


class Recorder:
    """A hook that records what it was told (in-process drivers)."""

    def __init__(self):
        self.calls: list[dict] = []
        self.event = threading.Event()

    def __call__(self, info: dict) -> None:
        self.calls.append(info)
        self.event.set()


def failing_hook(info: dict) -> None:
    raise RuntimeError(f"eval job for {info['name']} refused")


def marker_hook(info: dict) -> None:
    """Leaves ``<first copy>.hook`` beside the first committed copy (works from any process)."""
    with open(info["copies"][0] + ".hook", "w") as f:
        f.write(info["name"])


class BlockOnce:
    """An ``on_event`` observer that, the first time replication to tier 1 has copied ``after``
    segments, tells the gate actor and blocks until the gate opens (or its process is killed).
    Runs inside the coordinator actor, so it talks to the test through a Ray actor."""

    def __init__(self, gate, after: int):
        self.gate, self.after, self.seen = gate, after, 0

    def __call__(self, event: dict) -> None:
        if event["event"] == "start":
            self.seen = 0
        if event["event"] != "progress" or event["stage"] != "replicated@1":
            return
        self.seen += 1
        if self.seen == self.after:
            import ray

            if ray.get(self.gate.arrive.remote()):
                ray.get(self.gate.wait_open.remote())


class GateActor:
    """Made a Ray actor by the tests: ``arrive`` is True only the first time."""

    def __init__(self):
        import asyncio

        self.first, self.arrived, self.opened = True, asyncio.Event(), asyncio.Event()

    async def arrive(self) -> bool:
        first, self.first = self.first, False
        self.arrived.set()
        return first

    async def wait_arrived(self) -> None:
        await self.arrived.wait()

    async def wait_open(self) -> None:
        await self.opened.wait()

    async def open(self) -> None:
        self.opened.set()
