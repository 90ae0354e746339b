"""Ray Train with checkpoints in the cluster's memory: jobs/train_elastic.py --memory, end to end.

The job (its own two-node ``ray.cluster_utils.Cluster``, in a subprocess) trains on 2 workers,
checkpoints into ``raymem://`` every 2 steps and persists steps 4 and 8 (multiples of its
``--persist-every 4``, and the last); a node is added and the run resumes
on 4 workers from memory; at step 6 (a checkpoint held only in memory) the added node is removed
and the run resumes on the 2 survivors from the memory replicas; it matches an uninterrupted run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]


def test_elastic_run_resumes_from_memory_after_scale_up_and_node_loss(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, str(REPO / "jobs" / "train_elastic.py"), "--memory", "--verify", "--json",
                          "--dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=1400)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    attempts = summary["attempts"]
    assert [a["world_size"] for a in attempts] == [2, 4, 2]
    assert [a["start_step"] for a in attempts] == [0, 4, 6]
    assert [a["source"] for a in attempts] == [None, "memory", "memory"]
    assert summary["node_removed_at_step"] == 6
    # step 6 was never persisted: only the memory replicas held it when its node was lost
    assert not any("step00000006" in d for d in os.listdir(tmp_path / "elastic"))
    assert summary["verify"]["param_max_rel_diff"] <= 1e-5 and summary["verify"]["lr_equal"]
    assert summary["ok"]
