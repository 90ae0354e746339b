"""Helpers shared by the Ray tests: a scripted rank actor and picklable reduce functions.

Lives in an importable module (not a test file) so Ray workers can import what
the driver pickles by reference.
"""
from __future__ import annotations

import threading
import time

import pyarrow as pa
import torch

import raydcp.api
import raydcp.group
from raydcp.errors import CheckpointError, RankFailure


# -- reduce functions (module level: picklable by reference) ------------------------------
def add_rank_sum(values):
    """Each rank gets its own value plus the sum of all values."""
    total = sum(values)
    return [v + total for v in values]


def gather_all(values):
    return [list(values) for _ in values]


def boom(values):
    raise CheckpointError("plan rejected: key 'w' has two shapes")


def buggy(values):
    raise ZeroDivisionError("oops")


def wrong_length(values):
    return values[:1]


def shm_mapping(address: int) -> str | None:
    """The file backing ``address`` in this process (Linux), e.g. Ray's plasma shared memory."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= address < hi:
                    return parts[5] if len(parts) > 5 else ""
    except OSError:
        return None
    return None


class RankActor:
    """One rank of a test group. ``open`` then ``run(ops)``; every op's outcome is returned.

    ``open`` with the same group again starts the group's next operation (one Group per rank).

    ops: ("rs", step, local, fn) | ("ex", step, {dest: [(tag, bytes)]}) | ("fail", step, msg)
         | ("hang",) -- block until killed | ("close",)
    An op that raises CheckpointError ends the script (the transport is closed, as the engine does).
    """

    def __init__(self):
        self.transport = None
        self.group = None
        self._never = threading.Event()
        self._hanging = threading.Event()

    def pid(self):
        import os

        return os.getpid()

    def wait_hanging(self, timeout_s: float) -> bool:
        """True once ``run`` reached a ("hang",) op (call with max_concurrency >= 2)."""
        return self._hanging.wait(timeout_s)

    def open(self, name: str, rank: int, world_size: int, timeout_s: float):
        g = self.group
        if g is None or (g.name, g.rank, g.world_size) != (name, rank, world_size):
            self.group = raydcp.group.Group(name, rank, world_size, timeout_s=timeout_s)
        self.transport = raydcp.api.resolve_group(self.group).open_transport()
        return self.transport.coordinator_name

    def run(self, ops):
        t = self.transport
        out = []
        for op in ops:
            start = time.monotonic()
            try:
                if op[0] == "rs":
                    out.append(("ok", t.reduce_scatter(op[1], op[2], op[3])))
                elif op[0] == "fail":
                    out.append(("ok", t.reduce_scatter(op[1], RankFailure(t.rank, op[2]), gather_all)))
                elif op[0] == "ex":
                    out.append(("ok", self._exchange(op[1], op[2])))
                elif op[0] == "hang":
                    self._hanging.set()
                    self._never.wait()
                elif op[0] == "close":
                    t.close()
                    out.append(("ok", None))
            except CheckpointError as exc:
                failures = {r: str(e) for r, e in exc.failures.items()}  # rank -> its exception, as text
                out.append(("err", str(exc), failures, time.monotonic() - start))
                t.close()
                break
        return out

    def _exchange(self, step, spec):
        outgoing = {
            dest: [(tag, torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8))
                   for tag, data in items]
            for dest, items in spec.items()
        }
        got = self.transport.exchange(step, outgoing)
        result = []
        for tag, buf in got:
            assert isinstance(buf, pa.Buffer), type(buf)
            result.append((tag, bytes(buf), {"mutable": buf.is_mutable, "mapping": shm_mapping(buf.address) if buf.size else None}))
        return result
