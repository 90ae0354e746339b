"""CheckpointPipeline with an in-process driver: two tiers (a local directory and s3:// on moto),
stages recorded, load fallback, retention per tier, an unreachable tier, a crash mid-replication."""
from __future__ import annotations

import os
import shutil
import threading

import pytest

import raydcp
from raydcp.errors import CheckpointError
from raydcp.pipeline import CheckpointPipeline, PipelineConfig, PipelineDriver, read_status
from raydcp.pipeline.policy import make_tiers
from raydcp.storage import CheckpointStorage, list_committed

from .helpers import (FAST_RETRY, Recorder, assert_same, failing_hook, files_of, flip_a_byte, make_state,
                      zeros_like_state)

pytestmark = pytest.mark.s3


def pipeline(tiers, **kw) -> CheckpointPipeline:
    urls, opts = tiers
    kw.setdefault("retry", FAST_RETRY)
    kw.setdefault("max_parallel", 2)
    return CheckpointPipeline(urls, storage_options=opts, driver="local", **kw)


def test_stages_are_recorded_on_every_tier_and_the_copies_match(tiers):
    urls, opts = tiers
    hook = Recorder()
    p = pipeline(tiers, export="safetensors", hooks=[hook], retention={0: {"keep_last": 2}})
    state = make_state()
    try:
        save = p.save(state, "step-1", step=10)
        assert save.stall_s >= 0 and save.result(30).values["step"] == 0
        record = save.wait(60)
    finally:
        p.close()
    assert record.state == "complete", [(e.key, e.error) for e in record.failures()]
    assert [e.key for e in record.stages] == [
        "staged@0", "persisted@0", "committed@0", "verified@0", "replicated@1", "committed@1", "verified@1",
        "exported@1", f"hook:{hook_name(hook)}", "retention@0"]
    assert all(e.state == "done" and e.seconds is not None and e.attempts == 1 for e in record.stages)
    assert record.entry("replicated@1").bytes >= record.bytes > 0 and record.seq == 1 and record.step == 10
    assert [t.copy for t in record.tiers] == ["committed", "committed"]
    # the record is durable in both copies, identical
    local, remote = read_status(f"{urls[0]}/step-1"), read_status(f"{urls[1]}/step-1", opts)
    assert local.to_dict() == remote.to_dict() == record.to_dict()
    # raw copy: same names, same bytes, metadata included
    assert files_of(f"{urls[1]}/step-1", opts).keys() >= files_of(f"{urls[0]}/step-1").keys()
    remote_files = files_of(f"{urls[1]}/step-1", opts)
    assert all(remote_files[n] == b for n, b in files_of(f"{urls[0]}/step-1").items())
    assert any(n.startswith("export/safetensors/") for n in remote_files)
    assert hook.calls[0]["name"] == "step-1" and len(hook.calls[0]["copies"]) == 2


def hook_name(hook) -> str:
    from raydcp.pipeline.config import hook_name as name

    return name(hook)


def test_load_falls_back_to_the_remote_tier_bit_exact(tiers):
    urls, _ = tiers
    p = pipeline(tiers)
    state = make_state(seed=3)
    try:
        p.save(state, "step-1").wait(60)
        out = zeros_like_state(state)
        assert p.load(out).tier == 0  # latest, from the fast tier
        assert_same(out, state)

        flip_a_byte(f"{urls[0]}/step-1")  # damaged local copy
        out = zeros_like_state(state)
        result = p.load(out, "step-1")
        assert result.tier == 1 and "checksum mismatch" in result.fallbacks[0][1]
        assert_same(out, state)

        shutil.rmtree(f"{urls[0]}/step-1")  # node lost with its local tier
        out = zeros_like_state(state)
        result = p.load(out)  # latest is found on the remote tier
        assert (result.name, result.tier) == ("step-1", 1)
        assert_same(out, state)
    finally:
        p.close()


def test_retention_per_tier(tiers):
    urls, opts = tiers
    p = pipeline(tiers, retention={0: {"keep_last": 2}, 1: {"keep_every": 2}}, verify=False)
    try:
        for i in range(1, 6):
            assert p.save(make_state(1, 10, seed=i), f"s{i}").wait(60).state == "complete"
    finally:
        p.close()
    assert [c.name for c in list_committed(urls[0])] == ["s4", "s5"]
    assert sorted(c.name for c in list_committed(urls[1], opts)) == ["s2", "s4", "s5"]
    # the surviving copies know where the others went
    assert [t.copy for t in read_status(f"{urls[1]}/s2", opts).tiers] == ["pruned", "committed"]
    assert [t.copy for t in read_status(f"{urls[0]}/s4").tiers] == ["committed", "committed"]
    out = zeros_like_state(make_state(1, 10))
    assert p.load(out, "s2").tier == 1 and out["step"] == 2


def test_unreachable_tier_keeps_the_local_copy_and_retry_completes(tmp_path, s3_server):
    bucket = f"later-{os.getpid()}-{id(tmp_path) % 10000}"
    tiers = ([str(tmp_path / "local"), f"s3://{bucket}/run"], s3_server.storage_options)
    events = []
    p = pipeline(tiers, retention={0: {"keep_last": 1}}, on_event=events.append)
    try:
        for name in ("a", "b"):
            record = p.save(make_state(2, 10), name).wait(60)
            assert record.state == "failed"
        e = record.entry("replicated@1")
        assert e.state == "failed" and e.attempts == FAST_RETRY.attempts and "bucket" in e.error
        assert record.entry("committed@1").state == "blocked" and record.tiers[1].copy == "failed"
        assert sum(ev["event"] == "retry" for ev in events if ev["name"] == "b") == FAST_RETRY.attempts - 1
        # not durable anywhere else, so retention keeps both local copies
        assert [c.name for c in list_committed(tiers[0][0])] == ["a", "b"]
        assert p.load(zeros_like_state(make_state(2, 10)), "a").tier == 0

        create_bucket(s3_server, bucket)  # the tier comes back
        for name in ("a", "b"):
            assert "replicated@1" in p.retry(name)
            assert p.wait(name, 60).state == "complete"
        with pytest.raises(CheckpointError, match="no status record"):
            p.status("never-saved")
    finally:
        p.close()


def create_bucket(server, bucket: str) -> None:
    import boto3

    opts = server.storage_options
    boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1", aws_access_key_id=opts["key"],
                 aws_secret_access_key=opts["secret"]).create_bucket(Bucket=bucket)


class Crash(BaseException):
    """Stands for the driver's process dying: nothing below catches it."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_driver_killed_mid_replication_resumes_without_duplicates(tiers):
    urls, opts = tiers
    state = make_state(6, 1000)
    crash_after = 3

    def on_event(ev):
        if ev["event"] == "progress" and ev["done_bytes"] >= crash_after * 4000 and not crashed.is_set():
            crashed.set()
            raise Crash()

    crashed = threading.Event()
    config = PipelineConfig(tiers=make_tiers(urls, None, opts), retry=FAST_RETRY, max_parallel=1, on_event=on_event)
    first = PipelineDriver(config, resume=False)
    p = CheckpointPipeline(urls, storage_options=opts, driver="local", retry=FAST_RETRY, resume=False,
                           max_staging_bytes=4096)  # one file per tensor
    p._driver = first
    p.save(state, "step-1").result(30)
    assert crashed.wait(60)
    first._thread.join(30)
    record = read_status(f"{urls[0]}/step-1")
    assert record.entry("replicated@1").state == "running" and record.state == "running"
    assert not CheckpointStorage(f"{urls[1]}/step-1", opts).is_committed()  # nothing half-visible

    second = PipelineDriver(PipelineConfig(tiers=config.tiers, retry=FAST_RETRY, max_parallel=1))  # resumes
    try:
        record = second.wait("step-1", 60)
    finally:
        second.shutdown()
    assert record.state == "complete"
    e = record.entry("replicated@1")
    assert e.attempts == 2 and "already there" in e.detail and not e.detail.endswith(" 0 already there")
    assert files_of(f"{urls[1]}/step-1", opts) == files_of(f"{urls[0]}/step-1")  # nothing lost, nothing extra
    out = zeros_like_state(state)
    raydcp.load(out, f"{urls[1]}/step-1", storage_options=opts)
    assert_same(out, state)


def test_a_save_the_driver_never_heard_of_is_adopted(tiers):
    urls, opts = tiers
    p = pipeline(tiers, resume=False, verify=False)
    record = p.config.new_record("orphan", 1)
    record.transition("staged@0", "running")
    from raydcp.pipeline.record_files import write_record

    write_record(CheckpointStorage(f"{urls[0]}/orphan"), record)  # the trainer wrote this, then died
    raydcp.save(make_state(), f"{urls[0]}/orphan")                 # after its save had committed
    p.close()
    driver = PipelineDriver(PipelineConfig(tiers=p.tiers, retry=FAST_RETRY, verify=False), resume=False, start=False)
    assert driver.resume() == ["orphan"]
    driver.run_until_idle()
    record = driver.status("orphan")
    assert record.state == "complete" and "adopted" in record.entry("committed@0").detail
    assert CheckpointStorage(f"{urls[1]}/orphan", opts).is_committed()


def test_failing_hook_and_damaged_copy_are_reported(tiers):
    urls, _ = tiers
    p = pipeline(tiers, hooks=[failing_hook])
    try:
        record = p.save(make_state(), "step-1").wait(60)
    finally:
        p.close()
    assert record.state == "failed" and record.tiers[1].copy == "committed"
    assert "refused" in record.entry("hook:failing_hook").error

    # a copy damaged before verification: verified@0 fails and nothing is copied from it
    p = pipeline(tiers, hooks=[], async_save=False)
    p2_state = make_state(seed=5)
    try:
        p._driver = PipelineDriver(p.config, start=False)
        p.save(p2_state, "step-2")
        flip_a_byte(f"{urls[0]}/step-2")
        p._driver.run_until_idle()
        record = p.status("step-2")
    finally:
        p.close()
    assert record.entry("verified@0").state == "failed" and "damaged" in record.entry("verified@0").error
    assert record.entry("verified@0").attempts == 1  # damage is not retried
    e = record.entry("replicated@1")  # the damage is found again on the way and not copied
    assert e.state == "failed" and "checksum mismatch" in e.error and e.attempts == 1
    assert not CheckpointStorage(f"{urls[1]}/step-2", tiers[1]).is_committed()
