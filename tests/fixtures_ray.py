"""One local Ray instance per test session, started only when a test asks for it.

``ray_session`` starts Ray with 8 logical CPUs and 4 logical GPUs (so that
``num_gpus=1`` placement is exercised on a CPU-only machine), quietly and
without the dashboard. Workers import raydcp from this checkout.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

REPO_ROOT = str(Path(__file__).resolve().parents[1])


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if ray.is_initialized():  # started by the caller (e.g. a debugging session): reuse it
        yield ray
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    pythonpath = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    ray.init(
        address="local",  # a fresh instance of our own, even where another (e.g. a `ray start` head) runs
        num_cpus=8,
        num_gpus=4,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.ERROR,
        object_store_memory=512 * 1024 * 1024,
        namespace="raydcp-tests",
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
    )
    try:
        yield ray
    finally:
        ray.shutdown()
