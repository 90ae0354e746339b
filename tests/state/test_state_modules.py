"""nn.Module and Optimizer leaves (raydcp/state_modules.py): DCP's FQN layout, fresh optimizers,
strict=False reporting, and checkpoints with integer-keyed optimizer state. One process, no Ray."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import raydcp
from raydcp.state import flatten_state
from raydcp.state_modules import legacy_optimizer_renames


def _trained(seed=0, steps=2):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model.register_buffer("scale", torch.tensor([2.0]))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
    return model, opt


def _fresh(seed=1):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model.register_buffer("scale", torch.tensor([0.0]))
    return model, torch.optim.AdamW(model.parameters(), lr=0.5)


def _assert_same(model, opt, model2, opt2):
    for (k, a), (k2, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    assert len(opt2.state) == len(opt.state) == 4
    for p, p2 in zip(model.parameters(), model2.parameters()):
        s, s2 = opt.state[p], opt2.state[p2]
        assert sorted(s) == sorted(s2) == ["exp_avg", "exp_avg_sq", "step"]
        for name in s:
            assert torch.equal(s[name], s2[name]), name
    assert opt2.param_groups[0]["lr"] == 0.01


def test_keys_are_dcp_fqns_and_a_fresh_optimizer_is_restored_fully(tmp_path):
    model, opt = _trained()
    md = raydcp.save({"model": model, "optim": opt, "step": 100}, tmp_path / "c")
    assert sorted(md.tensors) == sorted(
        ["model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias", "model.scale"]
        + [f"optim.state.{p}.{n}" for p in ("0.weight", "0.bias", "2.weight", "2.bias")
           for n in ("exp_avg", "exp_avg_sq", "step")])
    assert md.values["optim.param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]

    model2, opt2 = _fresh()
    assert not opt2.state  # no step taken: nothing to fill until raydcp initialises it
    state = {"model": model2, "optim": opt2, "step": 0}
    stats = raydcp.load(state, tmp_path / "c")
    assert state["step"] == 100 and not stats.skipped
    _assert_same(model, opt, model2, opt2)
    # and training continues identically
    for m, o in ((model, opt), (model2, opt2)):
        torch.manual_seed(5)
        o.zero_grad()
        m(torch.randn(3, 4)).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_strict_false_reports_every_skipped_key_and_never_skips_a_fresh_optimizers_state(tmp_path, caplog):
    model, opt = _trained()
    raydcp.save({"model": model, "optim": opt, "epoch": 3}, tmp_path / "c")
    torch.manual_seed(2)
    model2 = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Linear(2, 2))  # one layer more
    model2.register_buffer("scale", torch.tensor([0.0]))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    extra = model2[3].weight.detach().clone()
    state = {"model": model2, "optim": opt2, "note": "kept"}
    with caplog.at_level(logging.WARNING, logger="raydcp"):
        stats = raydcp.load(state, tmp_path / "c", strict=False)
    assert stats.skipped.checkpoint_only == ("epoch",)
    assert stats.skipped.state_dict_only == (
        "model.3.bias", "model.3.weight", "note", "optim.state.3.bias.exp_avg", "optim.state.3.bias.exp_avg_sq",
        "optim.state.3.bias.step", "optim.state.3.weight.exp_avg", "optim.state.3.weight.exp_avg_sq",
        "optim.state.3.weight.step")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "strict=False" in r.getMessage()]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    for key in stats.skipped.checkpoint_only + stats.skipped.state_dict_only:
        assert key in msg
    # the layers both have are loaded, moments included; the new one keeps its values
    for i in (0, 2):
        for a, b in zip(model[i].parameters(), model2[i].parameters()):
            assert torch.equal(a, b)
            assert torch.equal(opt.state[a]["exp_avg"], opt2.state[b]["exp_avg"])
            assert torch.equal(opt.state[a]["step"], opt2.state[b]["step"])
    assert torch.equal(model2[3].weight, extra) and state["note"] == "kept"


def test_strict_false_with_nothing_skipped_logs_nothing(tmp_path, caplog):
    model, opt = _trained()
    raydcp.save({"model": model, "optim": opt}, tmp_path / "c")
    model2, opt2 = _fresh()
    with caplog.at_level(logging.WARNING, logger="raydcp"):
        stats = raydcp.load({"model": model2, "optim": opt2}, tmp_path / "c", strict=False)
    assert not stats.skipped and not [r for r in caplog.records if "strict=False" in r.getMessage()]
    _assert_same(model, opt, model2, opt2)


def _save_integer_keyed(model, opt, path):
    """A checkpoint as raydcp wrote one before FQN keys: the optimizer's own state_dict() expanded."""
    raydcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 7}, path)
    md = raydcp.read_metadata(path)
    assert "optim.state.0.exp_avg" in md.tensors and md.values["optim.param_groups"][0]["params"] == [0, 1, 2, 3]


def test_integer_keyed_optimizer_state_loads_by_parameter_order(tmp_path):
    model, opt = _trained()
    _save_integer_keyed(model, opt, tmp_path / "c")
    model2, opt2 = _fresh()
    state = {"model": model2, "optim": opt2, "step": 0}
    stats = raydcp.load(state, tmp_path / "c")  # strict: every old key accounted for
    assert state["step"] == 7 and not stats.skipped
    _assert_same(model, opt, model2, opt2)
    assert opt2.state_dict()["param_groups"][0]["params"] == [0, 1, 2, 3]


def test_integer_keyed_state_for_another_optimizer_shape_names_the_fix(tmp_path):
    model, opt = _trained()
    _save_integer_keyed(model, opt, tmp_path / "c")
    torch.manual_seed(1)
    model2 = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model2.register_buffer("scale", torch.tensor([0.0]))
    opt2 = torch.optim.AdamW(model2[0].parameters())  # two parameters, the checkpoint has four
    for strict in (True, False):
        with pytest.raises(raydcp.CheckpointError,
                           match=r"optim: the checkpoint keeps this optimizer's state by parameter id \(ids 0\.\.3\) "
                                 r"and the optimizer has 2 parameters.*same order"):
            raydcp.load({"model": model2, "optim": opt2, "step": 0}, tmp_path / "c", strict=strict)


def test_legacy_renames_need_the_integer_marker():
    order = ("0.weight", "0.bias")
    keys = ["optim.state.0.weight.exp_avg", "optim.state.1.exp_avg"]
    fqn_keyed = {"optim.param_groups": [{"lr": 1, "params": ["0.weight", "0.bias"]}]}
    assert legacy_optimizer_renames(keys, fqn_keyed, {"optim": order}) == {}
    old = {"optim.param_groups": [{"lr": 1, "params": [0, 1]}], "optim.state.1.step": 3.0}
    assert legacy_optimizer_renames(["optim.state.0.exp_avg", "optim.state.1.exp_avg"], old, {"optim": order}) == {
        "optim.state.0.exp_avg": "optim.state.0.weight.exp_avg", "optim.state.1.exp_avg": "optim.state.0.bias.exp_avg",
        "optim.state.1.step": "optim.state.0.bias.step"}
    with pytest.raises(raydcp.CheckpointError, match=r"ids 0\.\.7\) and the optimizer has 2 parameters"):
        legacy_optimizer_renames(["optim.state.7.exp_avg"], old, {"optim": order})


def test_an_optimizer_needs_its_model_in_the_state_dict(tmp_path):
    model, opt = _trained()
    with pytest.raises(raydcp.CheckpointError, match=r"opt: the optimizer's parameters belong to no nn\.Module"):
        raydcp.save({"opt": opt}, tmp_path / "c")
    with pytest.raises(raydcp.CheckpointError, match=r"opt: 2 of the optimizer's 4 parameters .*belong to no nn\.Module"):
        flatten_state({"head": model[2], "opt": opt})


def test_an_optimizer_over_several_modules_is_keyed_by_the_parameters_keys(tmp_path):
    torch.manual_seed(0)
    enc, dec = nn.Linear(3, 4), nn.Linear(4, 2)
    opt = torch.optim.Adam([*enc.parameters(), *dec.parameters()], lr=0.1)
    dec(enc(torch.randn(2, 3))).sum().backward()
    opt.step()
    md = raydcp.save({"nets": {"enc": enc, "dec": dec}, "optim": opt}, tmp_path / "c")
    assert "optim.state.nets.enc.weight.exp_avg" in md.tensors and "optim.state.nets.dec.bias.step" in md.tensors
    enc2, dec2 = nn.Linear(3, 4), nn.Linear(4, 2)
    opt2 = torch.optim.Adam([*enc2.parameters(), *dec2.parameters()], lr=0.1)
    raydcp.load({"nets": {"enc": enc2, "dec": dec2}, "optim": opt2}, tmp_path / "c")
    for p, p2 in zip([*enc.parameters(), *dec.parameters()], [*enc2.parameters(), *dec2.parameters()]):
        assert torch.equal(p, p2) and torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[p2]["exp_avg_sq"])


def test_a_stateful_holding_model_and_optimizer_gets_its_state_after_them(tmp_path):
    order = []

    class Holder:
        def __init__(self, model, opt):
            self.model, self.opt, self.n = model, opt, 0

        def state_dict(self):
            return {"model": self.model, "optim": self.opt, "n": self.n}

        def load_state_dict(self, sd):
            order.append(("holder", len(self.opt.state), sd["n"]))
            self.n = sd["n"]

    model, opt = _trained()
    h = Holder(model, opt)
    h.n = 4
    raydcp.save({"h": h}, tmp_path / "c")
    model2, opt2 = _fresh()
    raydcp.load({"h": Holder(model2, opt2)}, tmp_path / "c")
    assert order == [("holder", 4, 4)]  # the optimizer was loaded before the holder got its state
    _assert_same(model, opt, model2, opt2)


def test_strict_false_in_a_group_each_rank_gets_its_own_keys_and_rank_0_warns_once_for_all(tmp_path, caplog):
    from raydcp.engine.load import load_with
    from tests.engine.helpers import run_ranks

    raydcp.save({"w": torch.ones(4), "old": torch.zeros(2), "epoch": 1}, tmp_path / "c")
    states = [{"w": torch.zeros(4), "new0": torch.ones(1)}, {"w": torch.zeros(4), "new1": 5}]
    with caplog.at_level(logging.WARNING, logger="raydcp"):
        out, errs = run_ranks(2, lambda tp: load_with(tp, states[tp.rank], str(tmp_path / "c"), strict=False))
    assert errs == [None, None]
    assert [s.skipped.checkpoint_only for s in out] == [("epoch", "old")] * 2
    assert [s.skipped.state_dict_only for s in out] == [("new0",), ("new1",)]
    assert all(torch.equal(s["w"], torch.ones(4)) for s in states) and states[1]["new1"] == 5
    warnings = [r.getMessage() for r in caplog.records if "strict=False" in r.getMessage()]
    assert len(warnings) == 1 and all(k in warnings[0] for k in ("epoch", "old", "new0", "new1"))
