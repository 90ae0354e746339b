"""Lazily conjugated or negated views: saved as the values they show (save and async_save alike),
refused clearly as load targets (their memory does not hold what they show)."""
from __future__ import annotations

import pytest
import torch

import raydcp


def _views():
    base_c = torch.arange(6, dtype=torch.float32).view(3, 2).mul(0.5)
    complex_t = torch.view_as_complex(base_c.contiguous())
    return {
        "conj": complex_t.conj(),                                  # is_conj()
        "neg": torch._neg_view(torch.arange(5, dtype=torch.float64)),  # is_neg()
        "conj_neg": torch._neg_view(complex_t).conj(),
    }


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_lazy_views_are_saved_as_the_values_they_show(tmp_path, how):
    views = _views()
    state = {"model": {k: v for k, v in views.items()}}
    if how == "save":
        raydcp.save(state, str(tmp_path / how))
    else:
        raydcp.async_save(state, str(tmp_path / how)).result(timeout=60)

    out = {"model": {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in views.items()}}
    raydcp.load(out, str(tmp_path / how))
    for k, v in views.items():
        assert torch.equal(out["model"][k], v.resolve_conj().resolve_neg()), k


def test_async_save_stages_the_shown_values_not_later_updates(tmp_path):
    base = torch.arange(4, dtype=torch.float32)
    view = torch._neg_view(base)
    fut = raydcp.async_save({"v": view}, str(tmp_path / "ck"))
    base.add_(100)  # an in-place update after the call returned
    fut.result(timeout=60)
    out = {"v": torch.zeros(4)}
    raydcp.load(out, str(tmp_path / "ck"))
    assert torch.equal(out["v"], -torch.arange(4, dtype=torch.float32))


@pytest.mark.parametrize("kind", ["conj", "neg"])
def test_loading_into_a_lazy_view_is_refused_naming_the_key(tmp_path, kind):
    views = _views()
    raydcp.save({"t": views[kind].resolve_conj().resolve_neg()}, str(tmp_path / "ck"))
    target = views[kind]
    before = target.resolve_conj().resolve_neg().clone()
    with pytest.raises(raydcp.CheckpointError, match=r"t: cannot load in place into a lazily"):
        raydcp.load({"t": target}, str(tmp_path / "ck"))
    assert torch.equal(target.resolve_conj().resolve_neg(), before)
