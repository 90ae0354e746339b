"""CheckpointPipeline.load: falling back from tier to tier never leaves a mix of states behind."""
from __future__ import annotations

import os

import pytest

from raydcp.errors import CheckpointError
from raydcp.pipeline import CheckpointPipeline

from .helpers import FAST_RETRY, assert_same, make_state


def damage_last_piece(copy_url: str) -> None:
    """Flip the last byte of the last data file: the piece a load reads last."""
    files = sorted(os.path.join(root, n) for root, _, names in os.walk(os.path.join(copy_url, "data")) for n in names)
    with open(files[-1], "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x01]))


def test_every_tier_damaged_leaves_the_state_as_it_was(tmp_path):
    urls = [str(tmp_path / "fast"), str(tmp_path / "slow")]
    p = CheckpointPipeline(urls, driver="local", retry=FAST_RETRY, verify=False)
    try:
        assert p.save(make_state(seed=3), "step-1").wait(60).state == "complete"
        for url in urls:
            damage_last_piece(f"{url}/step-1")
        state = make_state(seed=9)
        before = make_state(seed=9)
        with pytest.raises(CheckpointError, match="no tier holds a loadable copy"):
            p.load(state, "step-1")
        assert_same(state, before)
    finally:
        p.close()
