"""The command line and convert take a plain local path literally: a checkpoint at `run::v2#a?b%41`
is inspected, verified, listed and converted (both ways) at exactly that path, and nothing is
written beside it (fsspec alone read `run::v2` as a URL chain naming `run`)."""
from __future__ import annotations

import json
import os

import pytest
import torch

import raydcp
from raydcp.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

NAME = "run::v2#a?b%41 é"


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_and_convert_at_literal_paths(tmp_path, capsys):
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(2), "step": 7}
    src = f"{tmp_path}/{NAME}"
    raydcp.save(state, src)
    assert os.listdir(tmp_path) == [NAME]

    code, out, err = run(capsys, "inspect", src, "--json")
    assert code == 0, err
    assert sorted(json.loads(out)["tensors"]) == ["b", "w"]
    code, out, err = run(capsys, "verify", src)
    assert code == 0 and src in out, err
    code, out, err = run(capsys, "ls", str(tmp_path))
    assert code == 0 and "run::v2#a?b%41" in out, err

    st_dir, back, pt = f"{tmp_path}/st::x#1", f"{tmp_path}/back::y?z", f"{tmp_path}/t::s%20.pt"
    for argv in ((src, st_dir, "--to", "safetensors"), (st_dir, back, "--from", "safetensors"),
                 (src, pt, "--to", "torch-save")):
        code, _, err = run(capsys, "convert", *argv, "--no-progress")
        assert code == 0, (argv, err)
    assert sorted(os.listdir(tmp_path)) == sorted([NAME, "st::x#1", "back::y?z", "t::s%20.pt"])
    assert any(n.endswith(".safetensors") for n in os.listdir(st_dir))

    got = {"w": torch.zeros(2, 3), "b": torch.zeros(2), "step": 0}
    raydcp.load(got, back)
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"]) and got["step"] == 7
    saved = torch.load(pt, weights_only=True)
    assert torch.equal(saved["w"], state["w"]) and saved["step"] == 7
