"""Fixtures for the Ray Train tests: the example training function and one set of runs per session.

The training function is ``train_loop`` of jobs/train_elastic.py (loaded by path). Ray
workers cannot import it, or the test modules, by name, so both are pickled by value.
"""
from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

_EXAMPLE = Path(__file__).resolve().parents[2] / "jobs" / "train_elastic.py"

# The reference configuration: 6 steps, a global batch of 12 (even over 2, 3 and 4 workers),
# a checkpoint every 3 steps.
BASE = {"seed": 0, "steps": 6, "ckpt_every": 3, "global_batch": 12}


def load_example():
    name = "raydcp_jobs_train_elastic"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def derived_draws(seed: int, step: int, rank: int, steps_after: int) -> list[float]:
    """What ``rank`` draws at the end of a run whose RNG was re-derived at ``step``."""
    from raydcp.train import rng

    ex = load_example()
    keep = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    try:
        rng.reseed(seed, step, rank)
        for _ in range(steps_after):
            ex.consume_rng()
        return ex.draw_rng()
    finally:
        torch.set_rng_state(keep[0])
        random.setstate(keep[1])
        np.random.set_state(keep[2])


# Ray Train's controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by default)
# and a preemption watcher every 5 s: a short poll and no watcher (the example announces its own
# preemptions) make each run end as soon as its workers do. Ray Train hands these to its processes.
RAY_TRAIN_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


@pytest.fixture(scope="module", autouse=True)
def quick_ray_train():
    """RAY_TRAIN_ENV around every module of this package (each run, ``train_runs``' included, is
    fitted inside one of its tests)."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in RAY_TRAIN_ENV.items():
            mp.setenv(k, v)
        yield


@pytest.fixture(scope="session")
def train_runs(ray_session, tmp_path_factory, request):
    """``train_runs(name, config=BASE, workers=2, key=name, **make_trainer_kwargs)``: fit once per key.

    Every run lives under ``train_runs.storage/<name>``. ``train_runs.reference()`` is the
    uninterrupted 6-step run on 2 workers that the other runs are compared with; also
    ``.example`` (the loaded jobs/train_elastic.py), ``.base``, ``.derived_draws`` and
    ``.scaleup()`` (the result of the elastic example, started in the background).
    """
    from ray import cloudpickle

    ex = load_example()
    cloudpickle.register_pickle_by_value(ex)
    storage = str(tmp_path_factory.mktemp("train-runs"))
    cache: dict = {}

    def fit(name, config=BASE, workers=2, *, key=None, **kw):
        key = key or name
        if key not in cache:
            trainer = ex.make_trainer(config, name=name, storage=storage, num_workers=workers,
                                      cpus_per_worker=0.5, **kw)
            cache[key] = trainer.fit()
        return cache[key]

    fit.storage = storage
    fit.reference = lambda: fit("reference", num_to_keep=1, score="loss")
    fit.example, fit.base, fit.derived_draws = ex, BASE, derived_draws

    # The scale-up example runs on its own cluster in a subprocess. When its test is selected it
    # starts now, so that it overlaps with the runs above; test_train_scaleup.py collects it last.
    scaleup_dir = tmp_path_factory.mktemp("scaleup")
    procs: list = []

    def start_scaleup():
        if not procs:
            with open(scaleup_dir / "stdout", "w") as out, open(scaleup_dir / "stderr", "w") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, str(_EXAMPLE), "--json", "--steps", "6", "--ckpt-every", "3",
                     "--pause-at", "3", "--dir", str(scaleup_dir / "runs")],
                    stdout=out, stderr=err, env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
                ))
        return procs[0]

    def scaleup(timeout_s: float = 540):
        """(exit status, stdout, stderr) of ``jobs/train_elastic.py`` (2 -> 4 workers, steps as BASE)."""
        proc = start_scaleup()
        proc.wait(timeout=timeout_s)
        return proc.returncode, (scaleup_dir / "stdout").read_text(), (scaleup_dir / "stderr").read_text()

    fit.scaleup = scaleup
    if any("test_train_scaleup.py" in item.nodeid for item in request.session.items):
        start_scaleup()
    try:
        yield fit
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
