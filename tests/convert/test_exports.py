"""Exports people use: model-only safetensors and torch DCP with Hugging Face keys, the dtype rules
shared by convert and reshard, --from safetensors, one DCP file per saving rank, and forged DCP
metadata sizes refused before anything is allocated."""
from __future__ import annotations

import json
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import raydcp
from raydcp import CheckpointError
from raydcp.cli import main
from raydcp.convert.keys import KeySelection

from tests.reshard.test_reshard import read_back, reference_state, save_as_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def trained(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def checkpoint(path):
    """A training checkpoint as DCP keeps one: model.*, optim.state.<fqn>.*, a step counter, values."""
    model, opt = trained()
    names = dict(zip(range(len(list(model.parameters()))), (n for n, _ in model.named_parameters())))
    osd = opt.state_dict()
    state = {"model": model.state_dict(),
             "optim": {"state": {names[i]: s for i, s in osd["state"].items()},
                       "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]},
             "step": 100, "counts": torch.arange(3, dtype=torch.int64)}
    raydcp.save(state, path)
    return model, state


def test_safetensors_export_is_model_only_with_hf_keys(tmp_path, capsys):
    from safetensors.torch import load_file

    model, state = checkpoint(tmp_path / "ck")
    out = tmp_path / "hf"
    code, stdout, err = run(capsys, "convert", tmp_path / "ck", out, "--to", "safetensors", "--drop-optimizer",
                            "--strip-prefix", "model.", "--drop", "counts", "--dtype", "bf16")
    assert code == 0, err
    assert "keys dropped" in stdout
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = {}
    for shard in sorted(set(index["weight_map"].values())):
        got.update(load_file(str(out / shard)))
    assert sorted(got) == sorted(model.state_dict())  # "0.weight", ... : the model's own keys
    for k, v in model.state_dict().items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16))
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2)).to(torch.bfloat16)
    model2.load_state_dict(got)  # strict: exactly the model's keys
    assert index["metadata"]["raydcp_values"] == {"step": 100}


def test_torch_dcp_export_with_stripped_keys_loads_in_dcp(tmp_path, capsys):
    model, state = checkpoint(tmp_path / "ck")
    code, _, err = run(capsys, "convert", tmp_path / "ck", tmp_path / "dcp", "--to", "torch-dcp",
                       "--drop-optimizer", "--strip-prefix", "model", "--drop", "step", "--drop", "counts")
    assert code == 0, err
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    sd = fresh.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"))
        md = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    assert sorted(md.state_dict_metadata) == sorted(model.state_dict())  # model-only content
    for k, v in model.state_dict().items():
        assert torch.equal(sd[k], v)


def test_torch_dcp_export_writes_one_file_per_saving_rank(tmp_path):
    full = reference_state()
    save_as_ranks(full, str(tmp_path / "src"), 3)
    result = raydcp.convert.to_torch_dcp(tmp_path / "src", tmp_path / "dcp", budget_bytes=64)
    names = sorted(p.name for p in (tmp_path / "dcp").iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"] and result.tensors == 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        md = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata()
        # each tensor keeps the pieces its ranks saved, each in that rank's file
        assert len(md.state_dict_metadata["model.embed"].chunks) == 3
        files = {info.relative_path for idx, info in md.storage_data.items() if idx.fqn == "model.embed"}
        assert files == {"__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}
        got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in full.items()}
        got["epoch"] = 0
        dcp.load(got, checkpoint_id=str(tmp_path / "dcp"))
    for k, v in full.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k
    assert got["epoch"] == 3


def test_dtype_casts_the_model_only_unless_dtype_all(tmp_path, capsys):
    full = reference_state()
    raydcp.save(full, tmp_path / "src")
    for extra, optim_dtype in (((), torch.float32), (("--dtype-all",), torch.float16)):
        for how in ("convert", "reshard"):
            dst = tmp_path / f"{how}{len(extra)}"
            argv = (["convert", tmp_path / "src", dst, "--to", "torch-save"] if how == "convert"
                    else ["reshard", tmp_path / "src", dst, "-M", "2", "--no-progress", "-q"])
            code, _, err = run(capsys, *argv, "--dtype", "fp16", *extra)
            assert code == 0, err
            got = torch.load(dst, weights_only=True) if how == "convert" else read_back(str(dst))
            assert got["model.embed"].dtype == torch.float16 and got["model.scale"].dtype == torch.float16
            assert got["model.index"].dtype == torch.int64                   # integers never cast
            assert got["optim.state.0.exp_avg"].dtype == optim_dtype         # optimizer only with --dtype-all
            assert got["optim.state.0.step"].dtype == torch.float32          # the step counter never
            assert torch.equal(got["optim.state.0.step"], full["optim.state.0.step"])
    with pytest.raises(CheckpointError, match="--dtype-all needs --dtype"):
        KeySelection(dtype_all=True)


def test_reshard_strips_prefixes_even_in_blocks_of_rows(tmp_path, capsys):
    full = reference_state()
    save_as_ranks(full, str(tmp_path / "src"), 2)
    code, _, err = run(capsys, "reshard", tmp_path / "src", tmp_path / "dst", "-M", "3", "--strip-prefix", "model",
                       "--drop-optimizer", "--memory-budget", "128", "--max-file-size", "64", "-q", "--no-progress")
    assert code == 0, err
    got = read_back(str(tmp_path / "dst"))
    assert sorted(got) == ["embed", "empty", "epoch", "index", "layer.bias", "layer.weight", "scale"]
    for k in ("embed", "layer.weight", "index", "scale"):
        assert torch.equal(got[k], full[f"model.{k}"]), k
    # two keys that would get one name: refused, naming both
    raydcp.save({"model.w": torch.ones(2), "w": torch.zeros(2)}, tmp_path / "clash")
    code, _, err = run(capsys, "reshard", tmp_path / "clash", tmp_path / "clash-out", "-M", "1",
                       "--strip-prefix", "model")
    assert code == 2 and "'model.w'" in err and "'w'" in err


def test_from_safetensors_round_trip(tmp_path, capsys):
    model, state = checkpoint(tmp_path / "ck")
    # several shards and their index, as Hugging Face writes them
    code, _, err = run(capsys, "convert", tmp_path / "ck", tmp_path / "hf", "--to", "safetensors",
                       "--max-shard-size", "100B")
    assert code == 0, err
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 2
    code, out, err = run(capsys, "convert", tmp_path / "hf", tmp_path / "back", "--from", "safetensors")
    assert code == 0, err
    code, out, err = run(capsys, "diff", tmp_path / "ck", tmp_path / "back", "--no-progress")
    assert code == 0, out + err  # every tensor bit for bit, and the plain values
    # one .safetensors file, renamed and cast on the way in
    from safetensors.torch import save_file

    save_file({"model.a": torch.randn(2, 3), "model.n": torch.arange(4)}, str(tmp_path / "one.safetensors"))
    code, _, err = run(capsys, "convert", tmp_path / "one.safetensors", tmp_path / "one", "--from", "safetensors",
                       "--strip-prefix", "model", "--dtype", "bf16")
    assert code == 0, err
    md = raydcp.read_metadata(tmp_path / "one")
    assert {k: t.dtype for k, t in md.tensors.items()} == {"a": "bfloat16", "n": "int64"}


def test_from_safetensors_refuses_a_lying_header(tmp_path, capsys):
    import struct

    header = json.dumps({"w": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 16]}}).encode()
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    code, _, err = run(capsys, "convert", tmp_path / "bad.safetensors", tmp_path / "out", "--from", "safetensors")
    assert code == 2 and "needs 4398046511104 bytes" in err and "damaged" in err


@pytest.mark.parametrize("elements", [1 << 40, 1 << 62])
def test_forged_dcp_sizes_are_refused_before_allocating(tmp_path, capsys, monkeypatch, elements):
    """Issue 16.6: a .metadata claiming 2**40 or 2**62 elements: exit 2 with a clear message."""
    from raydcp.convert import torch_dcp
    from raydcp.convert.dcp_pickle import load_dcp_metadata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "dcp"))
    meta = tmp_path / "dcp" / ".metadata"
    md = load_dcp_metadata(meta.read_bytes())
    entry = md.state_dict_metadata["w"]
    entry.size = torch.Size([elements])
    entry.chunks[0].sizes = torch.Size([elements])
    meta.write_bytes(pickle.dumps(md))
    allocated = []
    real_empty = torch.empty

    def watching(*args, **kwargs):
        allocated.append(args)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch_dcp.torch, "empty", watching)
    code, out, err = run(capsys, "convert", tmp_path / "dcp", tmp_path / "out", "--from", "torch-dcp")
    assert code == 2 and out == "" and "claims" in err and "w" in err and "nothing was read" in err
    assert allocated == []
