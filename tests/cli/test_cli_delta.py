"""The command line on delta checkpoints: inspect and ls show what a checkpoint owns and references;
verify, diff, convert and reshard read the referenced bytes; their outputs are full checkpoints."""
from __future__ import annotations

import json

import pytest
import torch

import raydcp
from raydcp import SaveOptions
from raydcp.cli import main


@pytest.fixture
def delta(tmp_path):
    s = {"frozen": torch.randn(64, 32), "adapter": torch.randn(4, 4), "step": 1}
    raydcp.save(s, tmp_path / "step-1", options=SaveOptions(base="previous"))
    s["adapter"] += 1
    s["step"] = 2
    raydcp.save(s, tmp_path / "step-2", options=SaveOptions(base="previous"))
    return tmp_path, s


def test_inspect_and_ls_show_owned_and_referenced_bytes(delta, capsys):
    root, s = delta
    assert main(["inspect", str(root / "step-2"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["format_version"] == "3.0" and got["owned_bytes"] == s["adapter"].nbytes
    assert got["references"] == {"../step-1": s["frozen"].nbytes}
    assert main(["inspect", str(root / "step-2")]) == 0
    assert "delta checkpoint: owns 64 B" in capsys.readouterr().out
    assert main(["ls", str(root), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert rows["step-2"]["references"] == {"../step-1": s["frozen"].nbytes} and not rows["step-1"]["references"]
    assert main(["ls", str(root)]) == 0
    assert "(delta of ../step-1)" in capsys.readouterr().out


def test_verify_diff_convert_and_reshard_read_the_references(delta, tmp_path, capsys):
    root, s = delta
    assert main(["verify", str(root / "step-2")]) == 0
    assert main(["diff", str(root / "step-1"), str(root / "step-2")]) != 0  # the adapter differs
    assert "adapter" in capsys.readouterr().out
    assert main(["convert", str(root / "step-2"), str(tmp_path / "out.safetensors"), "--to", "safetensors"]) == 0
    from safetensors.torch import load_file

    flat = load_file(str(tmp_path / "out.safetensors")) if (tmp_path / "out.safetensors").is_file() else \
        {k: v for f in sorted((tmp_path / "out.safetensors").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert torch.equal(flat["frozen"], s["frozen"]) and torch.equal(flat["adapter"], s["adapter"])
    assert main(["reshard", str(root / "step-2"), str(tmp_path / "resharded"), "--world-size", "2"]) == 0
    md = raydcp.read_metadata(tmp_path / "resharded")
    assert not md.references  # a copy stands alone
    out = {"frozen": torch.zeros(64, 32), "adapter": torch.zeros(4, 4), "step": 0}
    raydcp.load(out, tmp_path / "resharded")
    assert torch.equal(out["frozen"], s["frozen"]) and torch.equal(out["adapter"], s["adapter"]) and out["step"] == 2


def test_ls_and_load_name_a_removed_base_kept_for_its_references(delta, capsys):
    from raydcp.storage import apply_retention

    root, s = delta
    apply_retention(root, 1)
    assert main(["ls", str(root)]) == 0
    text = capsys.readouterr().out
    assert "removed, files kept for delta checkpoints (1): step-1" in text and "not committed" not in text
    with pytest.raises(raydcp.CheckpointNotFoundError, match="delta checkpoints reference them") as err:
        raydcp.load({"frozen": torch.zeros(64, 32)}, root / "step-1")
    assert err.value.reason == "removed-base"
