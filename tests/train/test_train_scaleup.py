"""A real elastic scale-up: jobs/train_elastic.py on its own Ray cluster (ray.cluster_utils.Cluster).

The example runs in a subprocess, so that its cluster (a head with room for 2 workers, then a
second node with room for 2 more) never meets the session's Ray instance in this process; the
``train_runs`` fixture starts it in the background and this module (last of the Ray Train tests)
collects it. The run starts on 2 workers (ScalingConfig(num_workers=(2, 4))), checkpoints at
step 3 and waits; the added node makes Ray Train restart it on 4 workers, which restore the
2-rank checkpoint resharded and train to step 6. The result is compared with the session's
uninterrupted 2-worker reference run (same configuration).
"""
from __future__ import annotations

import json

import pytest

import raydcp

pytestmark = [pytest.mark.ray, pytest.mark.multinode, pytest.mark.timeout(600)]


def test_scale_up_through_an_added_node_resumes_resharded_and_matches(train_runs):
    returncode, stdout, stderr = train_runs.scaleup()
    assert returncode == 0, stdout[-3000:] + stderr[-6000:]
    summary = json.loads(stdout.strip().splitlines()[-1])

    # two attempts: a fresh start on 2 workers, then 4 workers resumed at the step-3 checkpoint
    assert [(a["world_size"], a["resumed"], a["start_step"]) for a in summary["attempts"]] == [
        (2, False, 0), (4, True, 3)]
    final = summary["final"]
    assert (final["step"], final["world_size"], final["start_step"], final["rng"]) == (6, 4, 3, "derived")
    recs = [r for r in summary["records"] if r["event"] == "checkpoint"]
    assert [(r["step"], r["world_size"], r["complete"]) for r in recs] == [(3, 2, True), (6, 4, True)]
    assert raydcp.read_metadata(summary["checkpoint"]).world_size == 4

    # the same numbers as the uninterrupted run on 2 workers
    ex = train_runs.example
    ref = train_runs.reference()
    assert abs(final["loss"] - ref.metrics["loss"]) <= 1e-5 * abs(ref.metrics["loss"])
    assert final["lr"] == ref.metrics["lr"]
    a, b = ex.load_full(ref.checkpoint.path), ex.load_full(summary["checkpoint"])
    assert ex.max_rel_diff(a, b, "train.model.") <= 1e-5
    assert ex.max_rel_diff(a, b, "train.optim.state.") <= 1e-5
    assert final["draws"] == [train_runs.derived_draws(0, 3, r, 3) for r in range(4)]
