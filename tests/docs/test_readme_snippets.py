"""README.md's "Using it" snippets, executed as written (only their paths are the tests' own)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import raydcp
from tests.readme_snippets import actors_snippet, single_process_snippet, using_it_snippets

ROOT = Path(__file__).resolve().parents[2]


def test_readme_has_the_snippets_the_tests_run():
    blocks = using_it_snippets()
    assert len(blocks) == 3
    assert 'raydcp.save({"model": model, "optim": optimizer, "step": 100}, path)' in blocks[0]
    assert "raydcp.load(state, path)" in blocks[0]


def test_first_snippet_restores_a_fresh_model_and_adamw_exactly(tmp_path):
    ns: dict = {}
    exec(compile(single_process_snippet(str(tmp_path / "step-100")), "README.md:Using it", "exec"), ns)
    model, optimizer, model2, optimizer2, state = (ns[k] for k in ("model", "optimizer", "model2", "optimizer2", "state"))
    assert state["step"] == 100
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, p2)
        s, s2 = optimizer.state[p], optimizer2.state[p2]
        assert sorted(s2) == ["exp_avg", "exp_avg_sq", "step"]
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s[name], s2[name]), name
        assert torch.count_nonzero(s2["exp_avg_sq"]) > 0  # the moments came from the checkpoint
    assert float(optimizer2.state[next(iter(model2.parameters()))]["step"]) == 1.0
    assert isinstance(ns["md"], raydcp.Metadata) and "optim.state.weight.exp_avg" in ns["md"].tensors
    saved = ns["fut"].result(timeout=120)
    assert saved.tensors.keys() == ns["md"].tensors.keys()


def test_actors_example_saves_on_two_and_loads_on_three(ray_session, tmp_path):
    """The complete example, as a script of its own, connected to the session's cluster by RAY_ADDRESS
    (what its bare ``ray.init()`` does on a cluster)."""
    script = tmp_path / "example.py"
    script.write_text(actors_snippet(str(tmp_path / "actors")))
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address,
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("100 ")]
    assert lines == ["100 [[0.0, 1.0], [2.0, 3.0]]", "100 [[4.0, 5.0], [6.0, 7.0]]", "100 [[8.0, 9.0], [10.0, 11.0]]"]
    md = raydcp.read_metadata(str(tmp_path / "actors"))
    assert md.world_size == 2 and md.tensors["weight"].shape == (6, 2)
