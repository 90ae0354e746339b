"""Helpers for the ShardGroup tests: reference state, bit-exact checks, and a fault-injecting actor.

Importable by Ray workers (the driver pickles these by reference).
"""
from __future__ import annotations

import threading
import time

import torch

from raydcp.errors import CheckpointError
from raydcp.group import Group
from raydcp.runtime.shard_group.piece_tensors import take_piece
from raydcp.runtime.ray_transport import RayTransport
from raydcp.runtime.shard_group.actor import ShardActor
from raydcp.state import Shard


def reference_state(seed: int = 0) -> dict:
    """Small tensors of several dtypes and shapes (uneven, empty, scalar) and plain values.

    Float tensors hold random bit patterns (NaN payloads included), so only a
    bit-exact copy compares equal byte for byte.
    """
    g = torch.Generator().manual_seed(seed)

    def bits(shape, dtype):
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)

    return {
        "model.w": bits((7, 5), torch.float32),
        "model.b": bits((5,), torch.float32),
        "model.emb": bits((13, 6), torch.bfloat16),
        "model.conv": bits((3, 4, 2), torch.float16),
        "model.empty": bits((0, 3), torch.float32),
        "optim.step": torch.tensor(12, dtype=torch.int64),
        "optim.idx": torch.arange(11, dtype=torch.int32),
        "step": 12,
        "cfg.lr": 0.001,
        "cfg.names": ["enc", "dec"],
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return bytes(a.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()) == bytes(
        b.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def check_pieces(state: dict, full: dict, layout: str, rank: int, world: int) -> list[str]:
    """Run on an actor: how its held state differs from ``full`` cut in ``layout`` (empty: identical)."""
    problems = []
    if set(state) != set(full):
        problems.append(f"keys differ: {sorted(set(state) ^ set(full))}")
    for key, ref in full.items():
        got = state.get(key)
        if not isinstance(ref, torch.Tensor):
            if got != ref:
                problems.append(f"{key}: {got!r} != {ref!r}")
            continue
        want = take_piece(ref, layout, rank, world)
        if isinstance(want, Shard):
            if not isinstance(got, Shard) or (got.offsets, got.global_shape) != (want.offsets, want.global_shape):
                problems.append(f"{key}: wrong piece {got!r}, want {want!r}")
            elif not same_bits(got.tensor, want.tensor):
                problems.append(f"{key}: bytes differ")
        elif not isinstance(got, torch.Tensor) or not same_bits(got, want):
            problems.append(f"{key}: whole tensor differs")
    return problems


def assert_holds(ray, group, full: dict, layout: str) -> None:
    """Every rank of ShardGroup ``group`` holds exactly its piece of ``full`` in ``layout``."""
    problems = ray.get([group.apply_remote(r, check_pieces, full, layout, r, group.world_size)
                        for r in range(group.world_size)])
    assert problems == [[]] * group.world_size


def piece_ptrs(state: dict) -> dict:
    return {k: (v.tensor if isinstance(v, Shard) else v).data_ptr() for k, v in state.items() if isinstance(v, (Shard, torch.Tensor))}


def bump(state: dict) -> None:
    """Change every tensor in place (a training step, as far as a checkpoint can tell)."""
    for v in state.values():
        t = v.tensor if isinstance(v, Shard) else v
        if isinstance(t, torch.Tensor) and t.numel():
            t.reshape(-1).view(torch.uint8).add_(1)


def grow_global_shape(state: dict, key: str) -> None:
    """Make this rank claim a larger tensor for ``key`` than the others (an inconsistent plan)."""
    s = state[key]
    state[key] = Shard(s.tensor, s.offsets, (s.global_shape[0] + 1,) + tuple(s.global_shape[1:]))


# -- fault injection ----------------------------------------------------------------------
class _FaultTransport(RayTransport):
    def __init__(self, group, op, actor, host=None):
        super().__init__(group, op, host=host)
        self._actor = actor

    def reduce_scatter(self, step, local, reduce_fn):
        self._actor._at(step, self)
        return super().reduce_scatter(step, local, reduce_fn)

    def exchange(self, step, outgoing):
        self._actor._at(step, self)
        return super().exchange(step, outgoing)

    def wait_until_failed(self, within_s: float) -> None:
        """Stay away until the coordinator gave up on this rank (or is gone)."""
        import ray

        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            try:
                status = ray.get(self._coord.status.remote(self._key), timeout=within_s)
                if status is not None and status["failed"]:  # None: the others have not started yet
                    return
            except Exception:  # ended already
                return
            time.sleep(0.05)


class FaultyShardActor(ShardActor):
    """A ShardActor told to misbehave before one step of its next operation.

    modes: "absent" -- stay away until the others gave up on this rank (then carry on);
           "hang" -- block until killed;
           "raise" -- raise a CheckpointError there.
    """

    def __init__(self, rank, world_size):
        super().__init__(rank, world_size)
        self._fault: tuple | None = None
        self._reached = threading.Event()
        self._never = threading.Event()

    def inject(self, step: str, mode: str) -> None:
        assert mode in ("absent", "hang", "raise")
        self._fault = (step, mode)
        self._reached.clear()

    def wait_reached(self, timeout_s: float) -> bool:
        return self._reached.wait(timeout_s)

    def _at(self, step: str, transport: _FaultTransport) -> None:
        if self._fault is not None and self._fault[0] == step:
            _, mode = self._fault
            self._fault = None
            self._reached.set()
            if mode == "hang":
                self._never.wait()
            elif mode == "raise":
                raise CheckpointError(f"a failure injected at {step}")
            else:
                transport.wait_until_failed(within_s=120)

    def _open(self, group):
        host = group[4] if len(group) > 4 and group[4] else None
        return _FaultTransport(Group(*group[:3], timeout_s=group[3]), 0, self, host=host)


def bump_key(state: dict, key: str) -> None:
    """Change one tensor in place (a step that trains only it), every byte of this rank's piece."""
    v = state[key]
    t = v.tensor if isinstance(v, Shard) else v
    if t.numel():
        t.reshape(-1).view(torch.uint8).add_(1)
