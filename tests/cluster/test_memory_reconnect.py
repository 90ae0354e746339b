"""raymem:// after this process reconnects: ``ray.shutdown()`` then ``ray.init()`` to the same cluster.

The holders are detached: they and the checkpoints they hold outlive the driver's connection.
Handles cached before the reconnect belong to the old session; raydcp finds the holders (and
the coordinator host) again by name, and leaves no process-wide setting behind.
"""
from __future__ import annotations

import logging
import os

import pytest
import torch

import raydcp

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


def _reconnect(cluster) -> None:
    import ray

    ray.shutdown()
    ray.init(address=cluster.cluster.address, namespace="raydcp-cluster-tests", log_to_driver=False,
             logging_level=logging.ERROR, runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}})


def _state(step: int) -> dict:
    return {"w": torch.arange(512, dtype=torch.float32) * step, "step": step}


def _loaded(url: str, group=None) -> dict:
    back = {"w": torch.zeros(512), "step": -1}
    raydcp.load(back, url, group=group)
    return back


def test_memory_checkpoints_load_and_save_after_a_reconnect(cluster):
    env = dict(os.environ)
    url = "raymem://reconnect/ckpt"
    raydcp.save(_state(1), url)
    assert _loaded(url)["step"] == 1
    assert dict(os.environ) == env  # nothing process-wide changed: RAY_ADDRESS stays as it was
    _reconnect(cluster)
    back = _loaded(url)  # held by the detached holders all along, found again by name
    assert back["step"] == 1 and torch.equal(back["w"], _state(1)["w"])
    raydcp.save(_state(2), url)
    assert _loaded(url)["step"] == 2
    # a group's operations reach the coordinator host of the cluster again, too
    group = raydcp.Group("reconnect", 0, 1)
    raydcp.async_save(_state(3), url, group=group).result(timeout=240)  # through this process's persister
    _reconnect(cluster)
    assert _loaded(url, group=group)["step"] == 3
    raydcp.async_save(_state(4), url, group=group).result(timeout=240)  # a persister of the new session
    assert _loaded(url, group=group)["step"] == 4
    assert dict(os.environ) == env
