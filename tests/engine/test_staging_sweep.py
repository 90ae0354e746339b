"""Shared staging arenas are named after the process that made them, and a new one first removes
those whose maker is gone (killed before it removed the name): nothing piles up in /dev/shm."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from raydcp.engine.save import local_save_plan
from raydcp.engine.staging import ARENA_PREFIX, StagingArena, sweep_arenas
from raydcp.state import flatten_state


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_arenas_of_dead_makers_are_removed_and_live_ones_kept(tmp_path):
    dead = tmp_path / f"{ARENA_PREFIX}{_dead_pid()}-feed"
    live = tmp_path / f"{ARENA_PREFIX}{os.getpid()}-beef"
    other = tmp_path / "psm_someone_else"
    for f in (dead, live, other):
        f.write_bytes(b"x" * 10)
    assert sweep_arenas(str(tmp_path)) == 1
    assert not dead.exists() and live.exists() and other.exists()


def test_a_shared_arena_is_named_after_this_process_and_gone_once_unlinked():
    arena = StagingArena(shared=True)
    staged = local_save_plan(0, flatten_state({"w": torch.arange(100.0)}), compare_replicas=False)
    staged.data = [t.reshape(-1).view(torch.uint8) for t in staged.sources()]
    arena.stage(staged, [0])
    try:
        assert arena.shm_name.startswith(f"{ARENA_PREFIX}{os.getpid()}-")
        path = os.path.join("/dev/shm", arena.shm_name)
        assert os.path.exists(path)
        arena.unlink()
        assert not os.path.exists(path)
        assert torch.equal(arena.buffer[:400].view(torch.float32), torch.arange(100.0))  # still mapped here
    finally:
        arena.close()
