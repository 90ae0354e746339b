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
  Ray Train registers the checkpoint from the survivors' reports; it holds the uninterrupted run's
  parameters at that step (the resume from a survivors' checkpoint is the "during" case's).

With state that is not replicated (each worker holds its own rows of a table) and the node removed
during the save, nothing is committed, each survivor gets the error naming the table and the ranks
gone, and the run resumes from the checkpoint before the notice.
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


def _preempted_run(c, nodes: list, tmp_path: Path, name: str, when: str, **config) -> tuple[Path, list, list[int]]:
    """The first run on 4 workers, a node without rank 0 drained at step ``PREEMPT_AT`` and removed at
    its deadline (``when``: module doc); the control directory, the run's error and the ranks gone."""
    _two_nodes(c, nodes)
    control = tmp_path / "control"
    control.mkdir()
    failed: list = []

    def first():
        try:
            _trainer(tmp_path, name, 4, {"attempt": "first", "preempt_at": PREEMPT_AT, "when": when, **config},
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
    return control, failed, gone


def _registered(tmp_path: Path, name: str) -> set:
    records = tmp_path / "runs" / name / raydcp.train.RECORDS_NAME
    return {r.get("checkpoint") for r in map(json.loads, records.read_text().splitlines())
            if r.get("event") == "checkpoint"} if records.exists() else set()


def _resumed_equals_uninterrupted(tmp_path: Path, name: str, control: Path, resumed_from: int, **config):
    """The run resumed on the 2 remaining workers goes on from ``resumed_from`` to the end as the
    uninterrupted run does; its final checkpoint's metadata."""
    result = _trainer(tmp_path, name, 2, {"attempt": "resume", **config}).fit()
    assert result.error is None
    resumed = _log(control, "resume")
    assert resumed[0]["step"] == resumed_from + 1
    expected_log, expected_params = run.reference(STEPS)
    got = _log(control, "first")[:resumed_from] + resumed
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
    return result


@pytest.mark.parametrize("when", ["during", "before"])
def test_a_preempted_node_removed_during_or_before_the_emergency_save_and_the_run_resumes_exactly(
        slots, tmp_path, when):
    c, nodes = slots
    name = f"survivors-{when}-{uuid.uuid4().hex[:6]}"
    control, _, gone = _preempted_run(c, nodes, tmp_path, name, when)
    assert not list(control.glob("error*")), [p.read_text() for p in control.glob("error*")]

    emergency = [d for d in (tmp_path / "runs" / name).iterdir() if d.name.startswith("raydcp-step00000003")]
    assert len(emergency) == 1, list((tmp_path / "runs" / name).iterdir())
    md = raydcp.read_metadata(str(emergency[0]))
    assert md.values["step"] == PREEMPT_AT and md.world_size == 4 and md.extra["lost_ranks"] == gone
    # strict: Ray Train never registered it
    assert (emergency[0].name in _registered(tmp_path, name)) == RELAX[when], _registered(tmp_path, name)

    if when == "during":
        # the run resumes on the 2 remaining workers from the emergency checkpoint and goes on to the end
        _resumed_equals_uninterrupted(tmp_path, name, control, PREEMPT_AT)
    else:  # the same resume as "during" (the test of state that is not replicated resumes too): the
        # checkpoint the survivors wrote alone holds the uninterrupted run's parameters at that step
        _, expected = run.reference(PREEMPT_AT)
        params = {f"model.{k}": torch.zeros(tuple(v.shape)) for k, v in expected.items()}
        raydcp.load(params, str(emergency[0]), strict=False)
        for k, want in expected.items():
            torch.testing.assert_close(params[f"model.{k}"], want, rtol=1e-5, atol=1e-6)


def test_state_only_the_preempted_node_held_commits_nothing_and_the_run_resumes_from_the_previous_checkpoint(
        slots, tmp_path):
    """Each worker holds its own rows of a table: the preempted node's rows are on no survivor. All 4
    are in the emergency save when the node goes (its ranks had rows to write): nothing is committed,
    each survivor gets the error naming the table and the ranks gone, and the run resumes from step
    2's checkpoint, the table resharded to the 2 remaining workers."""
    c, nodes = slots
    name = f"survivors-sharded-{uuid.uuid4().hex[:6]}"
    control, _, gone = _preempted_run(c, nodes, tmp_path, name, "during", sharded=True, save_at=(PREEMPT_AT - 1,))
    survivors = sorted(set(range(4)) - set(gone))
    assert sorted(int(p.name[len("error"):]) for p in control.glob("error*")) == survivors
    for r in survivors:
        err = json.loads((control / f"error{r}").read_text())
        assert err["type"] == "StateNotCoveredError", err
        assert err["keys"] == ["table"] and err["lost_ranks"] == gone, err
        assert "table" in err["message"] and all(f"rank {g}" in err["message"] for g in gone), err
    run_dir = tmp_path / "runs" / name
    previous = [d.name for d in run_dir.iterdir() if d.name.startswith(f"raydcp-step{PREEMPT_AT - 1:08d}")]
    assert len(previous) == 1 and previous[0] in _registered(tmp_path, name), (previous, _registered(tmp_path, name))
    for d in run_dir.iterdir():  # nothing of step 3 committed
        if d.name.startswith(f"raydcp-step{PREEMPT_AT:08d}"):
            with pytest.raises(raydcp.CheckpointError):
                raydcp.read_metadata(str(d))

    result = _resumed_equals_uninterrupted(tmp_path, name, control, PREEMPT_AT - 1, sharded=True)
    for r in range(2):  # step 2's table, rows 4r..4r+3 on rank r of 2
        restored = json.loads((control / f"resume.restored{r}").read_text())
        assert restored["step"] == PREEMPT_AT - 1
        assert restored["table"] == run.table(PREEMPT_AT - 1)[4 * r:4 * r + 4].tolist(), restored
    final = {"table": torch.zeros(run.TABLE_ROWS, 2)}
    raydcp.load(final, result.checkpoint.path, strict=False)
    assert torch.equal(final["table"], run.table(STEPS))
