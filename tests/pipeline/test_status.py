"""The status record: schema, JSON encoding, the stage state machine (pure, no storage)."""
from __future__ import annotations

import json

import pytest

from raydcp.errors import CheckpointError
from raydcp.pipeline.status import (STATUS_VERSION, StatusRecord, TierCopy, decode_status, dependencies,
                                    encode_status, freshest, plan_stages)


def record(n_tiers: int = 2, **kw) -> StatusRecord:
    stages = plan_stages(n_tiers, verify=True, export_tier=n_tiers - 1, hooks=["notify"], retention_tiers=[0, 1])
    return StatusRecord(name="step-1", seq=1, tiers=[TierCopy(f"/t{i}/step-1") for i in range(n_tiers)],
                        stages=stages, **kw)


def test_plan_orders_the_stages():
    keys = [e.key for e in record(3).stages]
    assert keys == ["staged@0", "persisted@0", "committed@0", "verified@0",
                    "replicated@1", "committed@1", "verified@1", "replicated@2", "committed@2", "verified@2",
                    "exported@2", "hook:notify", "retention@0", "retention@1"]
    bare = plan_stages(1, verify=False, export_tier=None, hooks=[], retention_tiers=[])
    assert [e.key for e in bare] == ["staged@0", "persisted@0", "committed@0"]
    with pytest.raises(CheckpointError, match="unique"):
        plan_stages(1, verify=False, export_tier=None, hooks=["a", "a"], retention_tiers=[])


def test_round_trip_is_json_and_exact():
    r = record(step=30, save_id="abc", node_id="n1", bytes=123, files=2)
    r.transition("staged@0", "running", now=10.0)
    r.transition("staged@0", "done", now=11.0, seconds=0.5, nbytes=123)
    r.transition("persisted@0", "running")
    r.transition("persisted@0", "failed", error="disk full")
    data = encode_status(r)
    doc = json.loads(data)  # plain JSON, no pickle anywhere
    assert doc["format"] == "raydcp.status" and doc["state"] == "running"
    back = decode_status(data)
    assert back.to_dict() == r.to_dict()
    assert back.entry("staged@0").seconds == 0.5 and back.entry("persisted@0").error == "disk full"


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.update(format="other"), "not a raydcp status record"),
    (lambda d: d.update(version=[STATUS_VERSION[0] + 1, 0]), "upgrade raydcp"),
    (lambda d: d["stages"][0].update(state="sideways"), "unknown stage state"),
    (lambda d: d["tiers"][0].update(copy="floating"), "unknown copy state"),
    (lambda d: d["stages"][0].update(tier=7), "names tier 7"),
    (lambda d: d.update(seq="one"), "seq has the wrong type"),
    (lambda d: d.pop("stages"), "malformed"),
    (lambda d: d["stages"].append(dict(d["stages"][0])), "listed twice"),
])
def test_decode_refuses_bad_records(mutate, match):
    doc = json.loads(encode_status(record()))
    mutate(doc)
    with pytest.raises(CheckpointError, match=match):
        decode_status(json.dumps(doc).encode(), "ck/raydcp.status.json")


def test_decode_refuses_garbage_naming_the_file():
    with pytest.raises(CheckpointError, match=r"ck/raydcp.status.json: not a valid status record"):
        decode_status(b"\x00\xff{", "ck/raydcp.status.json")


def test_state_machine():
    r = record()
    e = r.transition("staged@0", "running")
    assert e.attempts == 1 and r.state == "running"
    r.transition("staged@0", "running")  # a new driver reruns an interrupted stage
    assert r.entry("staged@0").attempts == 2
    r.transition("staged@0", "done")
    with pytest.raises(CheckpointError, match="cannot go from done to running"):
        r.transition("staged@0", "running")
    with pytest.raises(CheckpointError, match="unknown stage state"):
        r.transition("persisted@0", "halfway")
    with pytest.raises(KeyError):
        r.entry("replicated@9")


def test_dependencies_and_blocking():
    r = record()
    deps = {e.key: dependencies(e, r) for e in r.stages}
    assert deps["replicated@1"] == ["committed@0"]      # tiers fill from the fastest copy, independently
    assert deps["committed@1"] == ["replicated@1"]
    assert deps["exported@1"] == ["committed@1", "verified@1"]
    assert deps["hook:notify"] == ["committed@0"] and deps["retention@0"] == []
    for key in ("staged@0", "persisted@0", "committed@0", "verified@0"):
        r.transition(key, "done")
    assert r.next_stage().key == "replicated@1" and r.blockers("replicated@1") == []
    r.transition("replicated@1", "running")
    r.transition("replicated@1", "failed", error="bucket unreachable")
    assert [b.key for b in r.blockers("committed@1")] == ["replicated@1"]
    r.tiers[1].copy = "failed"
    for key in ("committed@1", "verified@1", "exported@1"):
        r.transition(key, "blocked", error="waits")
    for key in ("hook:notify", "retention@0", "retention@1"):
        r.transition(key, "done")
    assert r.state == "failed" and r.finished
    assert [e.key for e in r.failures()] == ["replicated@1", "committed@1", "verified@1", "exported@1"]
    assert r.reset_failed() == ["replicated@1", "committed@1", "verified@1", "exported@1"]
    assert r.state == "running" and r.tiers[1].copy == "absent" and r.next_stage().key == "replicated@1"


def test_complete_record_metrics_and_throughput():
    r = record(1)
    for e in r.stages:
        r.transition(e.key, "done", seconds=2.0, nbytes=100)
    assert r.state == "complete"
    assert r.entry("verified@0").throughput == 50.0
    m = r.metrics()
    assert m["raydcp/verified@0/seconds"] == 2.0 and m["raydcp/verified@0/bytes_per_s"] == 50.0


def test_freshest_takes_the_highest_revision():
    a, b = record(revision=3), record(revision=7)
    assert freshest([a, None, b]) is b and freshest([None]) is None
