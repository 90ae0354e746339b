"""Pipeline retention's scope: only the checkpoints a pipeline saved under a retention policy of
the tier, and in them only raydcp's and the pipeline's own files (two local tiers, in-process)."""
from __future__ import annotations

import os

import raydcp
from raydcp.pipeline import CheckpointPipeline
from raydcp.storage import CheckpointStorage, list_committed

from .helpers import FAST_RETRY, make_state


def _pipeline(tiers, **kw) -> CheckpointPipeline:
    return CheckpointPipeline(tiers, driver="local", retry=FAST_RETRY, max_parallel=2, verify=False, **kw)


def test_retention_prunes_only_its_own_saves_and_only_their_own_files(tmp_path):
    tiers = [str(tmp_path / "fast"), str(tmp_path / "slow")]
    other_run = _pipeline(tiers)  # no retention: its checkpoints are kept on every tier
    try:
        assert other_run.save(make_state(2, 10, seed=1), "a1").wait(60).state == "complete"
    finally:
        other_run.close()
    raydcp.save(make_state(2, 10, seed=2), f"{tiers[0]}/manual")  # saved without the pipeline

    run = _pipeline(tiers, retention={0: {"keep_last": 1}}, export="safetensors", export_tier=0)
    try:
        assert run.save(make_state(2, 10, seed=3), "b1").wait(60).state == "complete"
        old = tmp_path / "fast" / "b1"
        assert any(n.startswith("export/safetensors/model-") for n in CheckpointStorage(str(old)).list_files())
        (old / "README.md").write_text("what this run was")
        (old / "export" / "safetensors" / "notes.txt").write_text("a user's file")
        assert run.save(make_state(2, 10, seed=4), "b2").wait(60).state == "complete"
    finally:
        run.close()

    assert sorted(c.name for c in list_committed(tiers[0])) == ["a1", "b2", "manual"]
    left = sorted(CheckpointStorage(str(old)).list_files())
    assert left == ["README.md", "export/safetensors/notes.txt"]  # raydcp's and the pipeline's files went
    assert (old / "README.md").read_text() == "what this run was"
    assert CheckpointStorage(f"{tiers[1]}/b1").is_committed()  # no policy on the slow tier


def test_retention_never_prunes_through_a_symbolic_link(tmp_path):
    tiers = [str(tmp_path / "fast"), str(tmp_path / "slow")]
    run = _pipeline(tiers, retention={0: {"keep_last": 2}})
    try:
        for i in (1, 2):
            assert run.save(make_state(2, 10, seed=i), f"s{i}").wait(60).state == "complete"
        os.symlink(tmp_path / "fast" / "s2", tmp_path / "fast" / "latest")  # a name for s2, not a checkpoint
        assert run.save(make_state(2, 10, seed=3), "s3").wait(60).state == "complete"
    finally:
        run.close()
    assert os.path.islink(tmp_path / "fast" / "latest")
    assert CheckpointStorage(str(tmp_path / "fast" / "s2")).is_committed()  # kept: one of the 2 newest
    assert not CheckpointStorage(str(tmp_path / "fast" / "s1")).is_committed()
    assert CheckpointStorage(str(tmp_path / "fast" / "s3")).is_committed()
