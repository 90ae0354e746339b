"""Delta checkpoints in the memory and node-local tiers (raymem://, raynode://; keep_last=1): each checkpoint holds
only what changed, the frozen bytes are held once, and keep_last releases them only when no kept
checkpoint references them."""
from __future__ import annotations

import pytest
import torch

import raydcp
from raydcp import SaveOptions
from raydcp.storage import CheckpointStorage, list_committed

from ._raymem_state import fresh_name


@pytest.fixture
def name(ray_session):
    yield from fresh_name(ray_session, "delta")


def _files(url: str) -> list[str]:
    return [n for n in CheckpointStorage(url).list_files() if n.endswith(".bin")]


@pytest.mark.parametrize("tier", ["raymem", "raynode"])
def test_deltas_in_the_cluster_tiers_hold_the_frozen_bytes_once(ray_session, name, tier, tmp_path):
    root = f"raymem://{name}/run" if tier == "raymem" else f"raynode://{tmp_path}/{{node}}/run"
    s = {"frozen": torch.randn(256, 64), "adapter": torch.randn(4, 4), "step": 0}
    for step in range(1, 5):
        s["adapter"] += 1
        if step == 4:
            s["frozen"] += 1
        s["step"] = step
        raydcp.save(s, f"{root}/step-{step}", options=SaveOptions(base="previous"), storage_options={"keep_last": 1})
        out = {"frozen": torch.zeros(256, 64), "adapter": torch.zeros(4, 4), "step": -1}
        raydcp.load(out, f"{root}/step-{step}")
        assert torch.equal(out["frozen"], s["frozen"]) and torch.equal(out["adapter"], s["adapter"])
        assert [c.name for c in list_committed(root)] == [f"step-{step}"]
        if step in (2, 3):
            md = raydcp.read_metadata(f"{root}/step-{step}")
            assert set(md.references) == {"../step-1"} and md.owned_bytes == s["adapter"].nbytes
            assert _files(f"{root}/step-1")  # released by keep_last, its frozen bytes held
    assert not _files(f"{root}/step-1")  # nothing references them once step-4 rewrote them
    assert not _files(f"{root}/step-3")
