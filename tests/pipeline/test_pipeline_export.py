"""CheckpointPipeline(export="safetensors", export_keys=...): the export keeps, renames and casts the keys
as ``raydcp convert --to safetensors`` does with its key options, so that the folder loads into the
model as is. Two local tiers, the in-process driver."""
from __future__ import annotations

import json
import pickle

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

from raydcp.convert import KeySelection
from raydcp.errors import CheckpointError
from raydcp.pipeline import CheckpointPipeline

from .helpers import FAST_RETRY


def _model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


def _exported(folder) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(folder / shard)))
    assert sorted(index["weight_map"]) == sorted(out)
    return out


@pytest.mark.parametrize("export_keys, dtype", [
    (KeySelection(drop_optimizer=True, strip_prefixes=("model",)), torch.float32),
    ({"drop_optimizer": True, "strip_prefixes": "model", "dtype": "bf16"}, torch.bfloat16),
])
def test_the_export_holds_the_models_own_keys(tmp_path, export_keys, dtype):
    model, opt = _model_and_optimizer()
    p = CheckpointPipeline([str(tmp_path / "fast"), str(tmp_path / "slow")], driver="local", retry=FAST_RETRY,
                           max_parallel=2, export="safetensors", export_keys=export_keys)
    try:
        p.save({"model": model, "optim": opt, "step": 1}, "step-1").result(60)
        record = p.wait("step-1", timeout=60)
    finally:
        p.close()
    assert record.state == "complete", [(e.key, e.error) for e in record.failures()]
    tensors = _exported(tmp_path / "slow" / "step-1" / "export" / "safetensors")
    want = model.state_dict()
    assert sorted(tensors) == sorted(want)  # no "model." prefix, no optimizer state
    for k, v in want.items():
        assert tensors[k].dtype == dtype and torch.equal(tensors[k], v.to(dtype)), k
    fresh = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fresh.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)


def test_without_export_keys_the_export_keeps_every_key(tmp_path):
    model, opt = _model_and_optimizer()
    p = CheckpointPipeline([str(tmp_path / "only")], driver="local", retry=FAST_RETRY, export="safetensors")
    try:
        p.save({"model": model, "optim": opt}, "step-1").result(60)
        assert p.wait("step-1", timeout=60).state == "complete"
    finally:
        p.close()
    keys = _exported(tmp_path / "only" / "step-1" / "export" / "safetensors")
    assert "model.0.weight" in keys and any(k.startswith("optim.") for k in keys)


def test_export_keys_are_checked_when_the_pipeline_is_made(tmp_path):
    def make(**kw):
        return CheckpointPipeline([str(tmp_path / "t")], driver="local", resume=False, **kw)

    with pytest.raises(CheckpointError, match="export_keys selects the keys of an export: it needs export="):
        make(export_keys=KeySelection(drop_optimizer=True))
    with pytest.raises(CheckpointError, match="unknown field.*strip_prefix\\b.*the fields are drop_optimizer"):
        make(export="safetensors", export_keys={"strip_prefix": ["model"]})
    with pytest.raises(CheckpointError, match="export_keys must be a raydcp.convert.KeySelection"):
        make(export="safetensors", export_keys=["model"])
    with pytest.raises(CheckpointError, match="not a floating dtype"):
        make(export="safetensors", export_keys={"dtype": "int8"})
    config = make(export="safetensors", export_keys={"drop_optimizer": True, "strip_prefixes": "model"}).config
    assert config.export_keys == KeySelection(drop_optimizer=True, strip_prefixes=("model",))
    assert pickle.loads(pickle.dumps(config)).export_keys == config.export_keys  # as it travels to the driver actor
