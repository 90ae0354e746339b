"""Ray Train on two nodes: 4 workers with replicated (DDP-style) state, a preemption announced for the
node of two of them (a drain with a deadline, as a spot reclaim), and that node removed at its
deadline while the emergency save runs or before its ranks start it: the survivors commit, the run
resumes on the 2 remaining workers from that step, and its losses, parameters and samples read
match an uninterrupted run's.

- ``during``: Ray Train's collectives stay strict (``relax_collectives_on_preemption=False``), so
  every worker gets the notice at the same call and starts the save; the node goes while all of them
  are in it. The survivors commit, then wait in ``ray.train.report`` for the dead workers until Ray
  Train tears them down at the end of ``preemption_grace_s``: the checkpoint is never registered, and
  the resume finds it all the same.
- ``before``: relaxed collectives; the preempted workers never start the save (nor took part in any
  operation of the worker group before it): the survivors find them lost by their node, commit, and
  Ray Train registers the checkpoint from the survivors' reports.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

import raydcp

from . import _train_survivors as run

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

NODE_ARGS = dict(num_cpus=2, object_store_memory=100 * 1024 * 1024)
SLOT = "survivors-train"  # a resource of the two nodes the workers run on (2 workers each)
STEPS, SAVE_AT, PREEMPT_AT = 6, (6,), 3
RELAX = {"during": False, "before": True}  # Ray Train's relax_collectives_on_preemption, per case
GRACE_S = {"during": 10, "before": 120}  # its preemption_grace_s: how long survivors may outlive the deadline
RAY_TRAIN_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2", "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.2",
                 "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "1"}


@pytest.fixture(scope="module")
def slots(cluster):
    """The nodes with room for 2 workers each (a test removes one and the next adds one back)."""
    nodes: list = []
    with pytest.MonkeyPatch.context() as mp:
        for k, v in RAY_TRAIN_ENV.items():
            mp.setenv(k, v)
        yield cluster.cluster, nodes
    for node in nodes:
        cluster.cluster.remove_node(node)


def _two_nodes(c, nodes: list) -> None:
    while len(nodes) < 2:
        nodes.append(c.add_node(resources={SLOT: 2}, **NODE_ARGS))
    c.wait_for_nodes()


def _trainer(tmp: Path, name: str, workers: int, config: dict, relax: bool = True, grace_s: float = 0):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    return TorchTrainer(
        run.train_fn, train_loop_config={"control": str(tmp / "control"), "steps": STEPS, "save_at": SAVE_AT,
                                         **config},
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 0.5, SLOT: 1}),
        run_config=RunConfig(name=name, storage_path=str(tmp / "runs"),
                             checkpoint_config=CheckpointConfig(num_to_keep=None),
                             failure_config=FailureConfig(max_failures=0, max_preemption_failures=0,
                                                          relax_collectives_on_preemption=relax,
                                                          preemption_grace_s=grace_s),
                             callbacks=[raydcp.train.RayDCPCallback()]))


def _wait(cond, what: str, fit: threading.Thread, timeout_s: float = 240):
    end = time.monotonic() + timeout_s
    while not cond():
        assert fit.is_alive(), f"the run ended before {what}"
        assert time.monotonic() < end, f"no {what} within {timeout_s}s"
        time.sleep(0.05)


def _drain(address: str, node_id: str, deadline_ms: int) -> None:
    """What a cloud's spot reclaim does through the autoscaler: drain the node, with a deadline."""
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2

    accepted, why = GcsClient(address=address).drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"), "spot reclaim", deadline_ms)
    assert accepted, why


def _log(control: Path, attempt: str) -> list[dict]:
    return [json.loads(line) for line in (control / f"{attempt}.log").read_text().splitlines()]


@pytest.mark.parametrize("when", ["during", "before"])
def test_a_preempted_node_removed_during_or_before_the_emergency_save_and_the_run_resumes_exactly(
        slots, tmp_path, when):
    c, nodes = slots
    _two_nodes(c, nodes)
    control = tmp_path / "control"
    control.mkdir()
    name = f"survivors-{when}-{uuid.uuid4().hex[:6]}"
    failed: list = []

    def first():
        try:
            _trainer(tmp_path, name, 4, {"attempt": "first", "preempt_at": PREEMPT_AT, "when": when},
                     relax=RELAX[when], grace_s=GRACE_S[when]).fit()
        except Exception as exc:  # the preemption ends the run (max_preemption_failures=0)
            failed.append(exc)

    fit = threading.Thread(target=first)
    fit.start()
    _wait(lambda: (control / "at-notice").exists(), "step 3", fit)
    ranks_on = {}
    for r in range(4):
        ranks_on.setdefault((control / f"first.node{r}").read_text(), []).append(r)
    # the node without rank 0 goes (Ray Train's collectives go on without preempted ranks but rank 0)
    victim = next(n for n in nodes if n.node_id != (control / "first.node0").read_text())
    assert sorted(map(len, ranks_on.values())) == [2, 2] and victim.node_id in ranks_on, ranks_on
    gone = ranks_on[victim.node_id]
    deadline_ms = int(time.time() * 1000) + 2000
    _drain(c.address, victim.node_id, deadline_ms)
    if when == "during":  # every rank is in the save, about to write: the node goes now
        _wait(lambda: all((control / f"writing{r}").exists() for r in range(4)), "the ranks writing", fit)
    while time.time() * 1000 < deadline_ms + 300:  # reclaimed at its deadline
        time.sleep(0.05)
    c.remove_node(victim)
    nodes.remove(victim)
    (control / "removed").touch()
    fit.join(timeout=300)
    seen = sorted(p.name for p in control.iterdir())
    assert not fit.is_alive() and failed, f"the run should end with the preemption; control files: {seen}"
    assert "preempt" in f"{type(failed[0]).__name__} {failed[0]}".lower(), (failed[0], seen)

    emergency = [d for d in (tmp_path / "runs" / name).iterdir() if d.name.startswith("raydcp-step00000003")]
    assert len(emergency) == 1, list((tmp_path / "runs" / name).iterdir())
    md = raydcp.read_metadata(str(emergency[0]))
    assert md.values["step"] == PREEMPT_AT and md.world_size == 4 and md.extra["lost_ranks"] == gone
    records = tmp_path / "runs" / name / raydcp.train.RECORDS_NAME
    registered = {r.get("checkpoint") for r in map(json.loads, records.read_text().splitlines())
                  if r.get("event") == "checkpoint"} if records.exists() else set()
    assert (emergency[0].name in registered) == RELAX[when], registered  # strict: Ray Train never registered it

    # the run resumes on the 2 remaining workers from the emergency checkpoint and goes on to the end
    result = _trainer(tmp_path, name, 2, {"attempt": "resume"}).fit()
    assert result.error is None
    resumed = _log(control, "resume")
    assert resumed[0]["step"] == PREEMPT_AT + 1
    expected_log, expected_params = run.reference(STEPS)
    got = _log(control, "first")[:PREEMPT_AT] + resumed
    assert [e["step"] for e in got] == list(range(1, STEPS + 1))
    assert [e["samples"] for e in got] == [e["samples"] for e in expected_log]  # none skipped, none repeated
    for e, want in zip(got, expected_log):
        assert abs(e["loss"] - want["loss"]) <= 1e-5 * max(1.0, abs(want["loss"])), (e, want)
    last = raydcp.read_metadata(result.checkpoint.path)
    assert last.values["step"] == STEPS
    params = {k: torch.zeros(tuple(t.shape)) for k, t in last.tensors.items() if k.startswith("model.")}
    raydcp.load(params, result.checkpoint.path, strict=False)
    for k, want in expected_params.items():
        torch.testing.assert_close(params[f"model.{k}"], want, rtol=1e-5, atol=1e-6)
