"""README.md's first "Using it" snippet, executed as written (only its path is the test's own)."""
from __future__ import annotations

import torch

import raydcp
from tests.readme_snippets import single_process_snippet, using_it_snippets


def test_readme_has_the_snippets_the_tests_run():
    blocks = using_it_snippets()
    assert len(blocks) == 2
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
