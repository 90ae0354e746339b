"""Pure policies: retention per tier, tiers and options, retries with backoff, load order."""
from __future__ import annotations

import pytest

from raydcp.errors import CheckpointError
from raydcp.pipeline.policy import (Candidate, CopyInfo, Retention, RetryPolicy, Tier, load_order, make_tiers,
                                    pipeline_file, under_retention)
from raydcp.errors import CheckpointDamagedError
from raydcp.pipeline.replicate import Piece, plan_segments


def cands(n: int, protected=()) -> list[Candidate]:
    return [Candidate(f"c{i}", i, i in protected) for i in range(1, n + 1)]


def test_keep_last():
    assert Retention(keep_last=3).select(cands(5)) == ["c1", "c2"]
    assert Retention(keep_last=3).select(cands(2)) == []


def test_keep_every_keeps_multiples_and_the_newest():
    assert Retention(keep_every=10).select(cands(23)) == [f"c{i}" for i in range(1, 23) if i not in (10, 20)]


def test_union_and_protection():
    pruned = Retention(keep_last=2, keep_every=4).select(cands(9, protected={3}))
    assert pruned == ["c1", "c2", "c5", "c6", "c7"]
    assert Retention().select(cands(5)) == []  # no policy: keep everything


def test_retention_scope_is_the_copies_saved_under_a_policy_of_the_tier():
    stages, copies = ["staged@0", "committed@0", "retention@0"], ["/t0/c", "s3://b/run/c"]
    assert under_retention(stages, copies, 0, "/t0/c")
    assert not under_retention(stages, copies, 1, "s3://b/run/c")        # no policy on that tier
    assert not under_retention(["staged@0", "committed@0"], copies, 0, "/t0/c")  # saved without one
    assert not under_retention(stages, copies, 0, "/other/c")             # saved to another directory
    assert not under_retention(stages, copies, 3, "/t0/c")


def test_pipeline_files_are_its_status_record_and_export_only():
    own = ["raydcp.status.json", "raydcp.status.json.tmp-0123456789abcdef", "export/safetensors/model.safetensors.index.json",
           "export/safetensors/model-00001-of-00002.safetensors"]
    foreign = ["README.md", "export/safetensors/notes.txt", "export/model-00001-of-00002.safetensors",
               "raydcp.status.json.bak", "other/safetensors/model.safetensors.index.json"]
    assert all(pipeline_file(n, "export") for n in own)
    assert not any(pipeline_file(n, "export") for n in foreign)


@pytest.mark.parametrize("kw", [{"keep_last": 0}, {"keep_every": -1}, {"keep_last": True}, {"keep_last": 1.5}])
def test_retention_is_validated(kw):
    with pytest.raises(CheckpointError, match="integer >= 1"):
        Retention(**kw)


def test_make_tiers_resolves_retention_and_options():
    opts = {"key": "k"}
    tiers = make_tiers(["/nvme/ck/", "s3://b/run"], {0: {"keep_last": 3}, "s3://b/run": Retention(keep_every=10)}, opts)
    assert [t.url for t in tiers] == ["/nvme/ck", "s3://b/run"]
    assert tiers[0].retention == Retention(keep_last=3) and tiers[1].retention == Retention(keep_every=10)
    assert tiers[0].storage_options is None and tiers[1].options() == opts  # remote tiers only
    assert tiers[1].copy_url("step-3") == "s3://b/run/step-3"
    assert make_tiers(["/a", "/b"], [None, {"keep_last": 1}], None)[1].retention.keep_last == 1
    for bad, match in [((["/a", "/a"], None), "distinct"), ((["/a"], {5: {}}), "not one of the tiers"),
                       ((["/a"], {0: {"keep_newest": 1}}), "unknown retention"), (("/a", None), "non-empty list")]:
        with pytest.raises(CheckpointError, match=match):
            make_tiers(*bad, None)
    with pytest.raises(CheckpointError):
        Tier("")


def test_retry_backs_off_and_gives_up():
    calls, waits = [], []
    policy = RetryPolicy(attempts=4, initial_s=0.1, multiplier=3, max_s=0.5)
    assert list(policy.delays()) == [0.1, pytest.approx(0.3), 0.5]

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OSError("unreachable")
        return "ok"

    assert policy.call(flaky, wait=lambda s: waits.append(s) or False) == "ok"
    assert len(calls) == 3 and waits == [0.1, pytest.approx(0.3)]

    calls.clear()
    with pytest.raises(OSError):
        policy.call(lambda: calls.append(1) or (_ for _ in ()).throw(OSError("down")), wait=lambda s: False)
    assert len(calls) == 4

    calls.clear()
    with pytest.raises(ValueError):  # not retryable: one call
        policy.call(lambda: calls.append(1) or (_ for _ in ()).throw(ValueError()), retryable=lambda e: False)
    assert len(calls) == 1

    calls.clear()
    with pytest.raises(OSError):  # wait() says stop: no more calls
        policy.call(lambda: calls.append(1) or (_ for _ in ()).throw(OSError()), wait=lambda s: True)
    assert len(calls) == 1


def test_load_order_prefers_fast_intact_committed_copies():
    copies = [CopyInfo(0, True, known_damaged=True), CopyInfo(1, False), CopyInfo(2, True), CopyInfo(3, True)]
    assert load_order(copies) == [2, 3, 0]
    assert load_order([CopyInfo(0, False)]) == []


def test_segments_start_at_piece_boundaries_and_cover_the_file():
    pieces = [Piece(0, 100, 1), Piece(128, 100, 2), Piece(256, 300, 3), Piece(576, 10, 4)]
    segs = plan_segments("f", 600, pieces, 200)
    # every segment but the last holds at least part_bytes; pieces are never split
    assert [(s.start, s.end) for s in segs] == [(0, 256), (256, 576), (576, 600)]
    assert [len(s.pieces) for s in segs] == [2, 1, 1] and [s.part for s in segs] == [1, 2, 3]
    assert {s.parts for s in segs} == {3}
    assert [(s.start, s.end) for s in plan_segments("f", 600, pieces, 10**9)] == [(0, 600)]
    assert [(s.start, s.end) for s in plan_segments("f", 0, [], 10)] == [(0, 0)]
    with pytest.raises(CheckpointDamagedError, match="truncated"):
        plan_segments("f", 500, pieces, 200)


def test_the_pipeline_and_its_cli_do_not_import_ray():
    import subprocess
    import sys

    code = ("import sys, raydcp.pipeline.api, raydcp.pipeline.driver, raydcp.pipeline.check, raydcp.cli.status_cmd; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
