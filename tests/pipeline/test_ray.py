"""The pipeline coordinator as a Ray actor: replication as Ray tasks, a Ray task hook, and the
coordinator killed mid-replication (Ray restarts it; the new instance resumes from the record)."""
from __future__ import annotations

import os

import pytest

import raydcp
from raydcp.pipeline import CheckpointPipeline, read_status
from raydcp.storage import CheckpointStorage

from .helpers import (FAST_RETRY, BlockOnce, GateActor, assert_same, files_of, make_state, marker_hook,
                      zeros_like_state)

pytestmark = [pytest.mark.ray, pytest.mark.s3]


def test_ray_coordinator_runs_the_stages_and_a_ray_task_hook(ray_session, tiers):
    ray = ray_session
    urls, opts = tiers
    p = CheckpointPipeline(urls, storage_options=opts, driver="ray", retry=FAST_RETRY, max_parallel=2,
                           hooks=[ray.remote(num_cpus=0)(marker_hook)], max_staging_bytes=4096)
    state = make_state()
    try:
        from raydcp.runtime.pipeline_actor import RemoteDriver

        assert isinstance(p.driver(), RemoteDriver)
        record = p.save(state, "step-1").wait(120)
        assert record.state == "complete", [(e.key, e.error) for e in record.failures()]
        assert record.node_id == ray.get_runtime_context().get_node_id()
        assert p.status("step-1").to_dict() == record.to_dict()
        assert os.path.exists(f"{urls[0]}/step-1.hook")  # the hook ran as a Ray task
        assert files_of(f"{urls[1]}/step-1", opts) == files_of(f"{urls[0]}/step-1")
        out = zeros_like_state(state)
        os.remove(f"{urls[0]}/step-1/raydcp.meta")  # tier 0 gone: served from s3
        assert p.load(out).tier == 1
        assert_same(out, state)
    finally:
        p.close()


def test_coordinator_killed_mid_replication_is_restarted_and_resumes(ray_session, tiers):
    ray = ray_session
    urls, opts = tiers
    gate = ray.remote(num_cpus=0)(GateActor).remote()
    p = CheckpointPipeline(urls, storage_options=opts, driver="ray", retry=FAST_RETRY, max_parallel=1,
                           on_event=BlockOnce(gate, after=2), max_staging_bytes=4096, verify=False)
    state = make_state(6, 1000, seed=7)
    try:
        p.save(state, "step-1").result(60)
        ray.get(gate.wait_arrived.remote(), timeout=120)  # 2 files copied, the coordinator is stuck
        record = read_status(f"{urls[0]}/step-1")
        assert record.entry("replicated@1").state == "running"
        assert not CheckpointStorage(f"{urls[1]}/step-1", opts).is_committed()  # nothing half-visible

        ray.kill(p.driver().handle, no_restart=False)  # Ray restarts it; the new one resumes
        record = p.wait("step-1", 120)
        assert record.state == "complete", [(e.key, e.error) for e in record.failures()]
        e = record.entry("replicated@1")
        assert e.attempts == 2 and "2 already there" in e.detail  # resumed, not restarted from zero
        assert files_of(f"{urls[1]}/step-1", opts) == files_of(f"{urls[0]}/step-1")  # no duplicate, no loss
        out = zeros_like_state(state)
        raydcp.load(out, f"{urls[1]}/step-1", storage_options=opts)
        assert_same(out, state)
    finally:
        ray.get(gate.open.remote())
        p.close()
