"""Delta checkpoints through the pipeline: tier 0 saves deltas (SaveOptions(base="previous")), the
later tiers receive them with their references (each referenced file copied once), retention on
every tier keeps what the kept checkpoints reference, and a copy loads alone."""
from __future__ import annotations

import shutil

import torch

import raydcp
from raydcp import SaveOptions
from raydcp.pipeline import CheckpointPipeline
from raydcp.storage import list_committed
from raydcp.verify import verify_checkpoint

from .helpers import FAST_RETRY, assert_same, make_state, zeros_like_state


def test_delta_checkpoints_replicate_with_their_references_and_retention_keeps_them(tmp_path):
    tiers = [str(tmp_path / "fast"), str(tmp_path / "slow")]
    run = CheckpointPipeline(tiers, driver="local", retry=FAST_RETRY, max_parallel=2, verify=True,
                             retention={0: {"keep_last": 1}, 1: {"keep_last": 2}},
                             save_options=SaveOptions(base="previous"))
    state = make_state(4, 5000, seed=1)
    try:
        for step in range(1, 5):
            state["model"]["w0"] += 1  # one tensor of four changes
            state["step"] = step
            assert run.save(state, f"step-{step}").wait(60).state == "complete"
    finally:
        run.close()
    assert [c.name for c in list_committed(tiers[0])] == ["step-4"]
    assert [c.name for c in list_committed(tiers[1])] == ["step-3", "step-4"]
    md = raydcp.read_metadata(f"{tiers[1]}/step-4")
    assert set(md.references) == {"../step-1"}  # the frozen tensors, copied to the slow tier once
    assert md.owned_bytes < md.stored_bytes / 2
    shutil.rmtree(tiers[0])  # the fast tier lost: the slow tier's copy loads on its own
    assert verify_checkpoint(f"{tiers[1]}/step-4").ok
    out = zeros_like_state(state)
    raydcp.load(out, f"{tiers[1]}/step-4")
    assert_same(out, state)
    assert torch.equal(out["model"]["w0"], state["model"]["w0"])
