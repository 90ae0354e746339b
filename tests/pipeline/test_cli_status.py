"""`raydcp status PATH`: stages per tier, sizes, durations, throughput; good and damaged copies."""
from __future__ import annotations

import json
import os
import shutil

import pytest

import raydcp
from raydcp.cli import main
from raydcp.pipeline import CheckpointPipeline

from .helpers import FAST_RETRY, flip_a_byte, make_state


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("status")
    tiers = [str(root / "fast"), str(root / "slow")]
    p = CheckpointPipeline(tiers, driver="local", retry=FAST_RETRY, async_save=False)
    try:
        assert p.save(make_state(), "step-1", step=100).wait(60).state == "complete"
    finally:
        p.close()
    return tiers


@pytest.fixture
def copy_of(saved, tmp_path):
    """A private copy of both tiers, to damage."""
    tiers = [str(tmp_path / "fast"), str(tmp_path / "slow")]
    for src, dst in zip(saved, tiers):
        shutil.copytree(src, dst)
    # the records name the original directories: point them at the copies
    for t in tiers:
        path = os.path.join(t, "step-1", "raydcp.status.json")
        with open(path) as f:
            text = f.read()
        for src, dst in zip(saved, tiers):
            text = text.replace(src, dst)
        with open(path, "w") as f:
            f.write(text)
    return tiers


def test_status_of_a_good_checkpoint(saved, capsys):
    code, out, err = run(capsys, "status", f"{saved[0]}/step-1")
    assert code == 0 and err == ""
    assert "step-1 (seq 1, step 100" in out and "complete" in out
    for word in ("staged", "persisted", "replicated", "verified", "committed", "/s"):
        assert word in out, word
    assert out.count("│ ok") == 2  # both copies checked


def test_status_json_from_either_copy(saved, capsys):
    code, out, _ = run(capsys, "status", f"{saved[1]}/step-1", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["record"]["state"] == "complete"
    assert [c["live"] for c in doc["checks"]] == ["ok", "ok"]
    stages = {f"{s['stage']}@{s['tier']}": s for s in doc["record"]["stages"]}
    assert stages["replicated@1"]["state"] == "done" and stages["replicated@1"]["bytes"] > 0
    assert stages["replicated@1"]["seconds"] is not None


def test_status_finds_a_missing_copy_and_a_bit_flip(copy_of, capsys):
    fast, slow = copy_of
    shutil.rmtree(os.path.join(slow, "step-1", "data"))
    code, out, _ = run(capsys, "status", f"{fast}/step-1")
    assert code == 1 and "damaged" in out and "the data file is missing" in out

    flip_a_byte(f"{fast}/step-1")
    code, out, _ = run(capsys, "status", f"{fast}/step-1", "--json")
    assert code == 1 and json.loads(out)["checks"][0]["live"] == "ok"  # sizes alone do not see a bit flip
    code, out, _ = run(capsys, "status", f"{fast}/step-1", "--json", "--verify")
    checks = json.loads(out)["checks"]
    assert code == 1 and checks[0]["live"] == "damaged" and "checksum mismatch" in checks[0]["problems"][0]


def test_status_of_a_damaged_record_and_of_plain_checkpoints(copy_of, tmp_path, capsys):
    fast, _ = copy_of
    with open(os.path.join(fast, "step-1", "raydcp.status.json"), "w") as f:
        f.write("{not json")
    code, out, _ = run(capsys, "status", f"{fast}/step-1")
    assert code == 0 and "not a valid status record" in out  # the copy itself is fine

    raydcp.save(make_state(), tmp_path / "plain")
    code, out, _ = run(capsys, "status", tmp_path / "plain")
    assert code == 0 and "no pipeline status record" in out and "copy: ok" in out

    code, out, err = run(capsys, "status", tmp_path / "nothing")
    assert code == 2 and out == "" and "neither a raydcp checkpoint nor a pipeline status record" in err
