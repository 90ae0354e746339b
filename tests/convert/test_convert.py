"""`raydcp convert`: torch DCP both ways (checked with torch's own dcp.save/dcp.load), safetensors
shards (read back with the safetensors library) and torch.save; malicious DCP metadata is refused."""
from __future__ import annotations

import json
import os
import pickle
import warnings
import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp

import raydcp
from raydcp import CheckpointError
from raydcp.cli import main
from raydcp.codec import decode_value
from raydcp.convert import from_torch_dcp, parse_size, to_safetensors, to_torch_dcp
from raydcp.convert.dcp_pickle import load_dcp_metadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn]


def tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, dt in enumerate(DTYPES):
        raw = torch.randn(3, 5, generator=g) * 50
        out[f"t.{str(dt).removeprefix('torch.')}"] = raw.to(dt) if dt != torch.bool else raw > 0
    out["t.scalar"] = torch.tensor(3.5)
    out["t.empty"] = torch.empty(0, 4)
    return out


def model_and_optim(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * (seed + 1))
    for _ in range(2):
        model(torch.randn(6, 4)).pow(2).sum().backward()
        opt.step()
    return model, opt


def training_state(seed: int) -> dict:
    model, opt = model_and_optim(seed)
    return {"model": model.state_dict(), "optim": opt.state_dict(), "t": tensors() if seed == 0 else
            {k: torch.zeros_like(v) for k, v in tensors().items()}, "step": 10 + seed, "tag": f"s{seed}"}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def assert_same_state(got, want, path="") -> None:
    if isinstance(want, torch.Tensor):
        assert same_bits(got, want), path
    elif isinstance(want, dict):
        assert set(got) == set(want), path
        for k in want:
            assert_same_state(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, (list, tuple)) and any(isinstance(x, (torch.Tensor, dict)) for x in want):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_state(g, w, f"{path}.{i}")
    else:
        assert got == want, path


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_to_torch_dcp_is_read_by_dcp_load(tmp_path, capsys):
    src, dst = tmp_path / "rd", tmp_path / "dcp"
    want = training_state(0)
    raydcp.save(want, src)
    # a 64-byte budget loads the tensors from raydcp a few at a time
    code, out, err = run(capsys, "convert", src, dst, "--to", "torch-dcp", "--memory-budget", "64")
    assert code == 0 and "converted" in out and err == ""
    got = training_state(1)
    dcp.load(got, checkpoint_id=str(dst))
    assert_same_state(got, want)
    code, _, err = run(capsys, "convert", src, dst, "--to", "torch-dcp")
    assert code == 2 and "already exists" in err and "--overwrite" in err
    assert run(capsys, "convert", src, dst, "--to", "torch-dcp", "--overwrite")[0] == 0


def test_from_torch_dcp_with_model_and_optimizer(tmp_path, capsys):
    src, dst = tmp_path / "dcp", tmp_path / "rd"
    want = training_state(0)
    dcp.save(want, storage_writer=dcp.FileSystemWriter(str(src)))
    code, out, err = run(capsys, "convert", src, dst, "--from", "torch-dcp", "--json")
    assert code == 0 and err == ""
    assert json.loads(out)["tensors"] == len(raydcp.read_metadata(dst).tensors)
    got = training_state(1)
    raydcp.load(got, dst)  # strict: the same keys as raydcp's own save of this state dict
    assert_same_state(got, want)
    assert raydcp.read_metadata(dst).keys() == raydcp.save(want, tmp_path / "direct").keys()


def test_round_trip_through_dcp_is_identical(tmp_path, capsys):
    a, mid, b = tmp_path / "a", tmp_path / "dcp", tmp_path / "b"
    raydcp.save(training_state(0), a)
    assert run(capsys, "convert", a, mid, "--to", "torch-dcp")[0] == 0
    assert run(capsys, "convert", mid, b, "--from", "torch-dcp")[0] == 0
    code, out, _ = run(capsys, "diff", a, b)
    assert code == 0 and "identical" in out


def test_from_dcp_assembles_sharded_tensors(tmp_path):
    """A DCP tensor saved as two chunks (as two ranks would) becomes one whole raydcp tensor."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    src = tmp_path / "dcp"
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    dcp.save({"top": full[:4].clone(), "bottom": full[4:].clone()}, storage_writer=dcp.FileSystemWriter(str(src)))
    meta_path = src / ".metadata"
    md = pickle.loads(meta_path.read_bytes())  # our own file, written just now by torch
    top, _bottom = md.state_dict_metadata.pop("top"), md.state_dict_metadata.pop("bottom")
    top.size = torch.Size([6, 4])
    top.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 4])),
                  ChunkStorageMetadata(torch.Size([4, 0]), torch.Size([2, 4]))]
    md.state_dict_metadata["w"] = top
    records = {i.fqn: r for i, r in md.storage_data.items()}
    md.storage_data = {MetadataIndex("w", [0, 0]): records["top"], MetadataIndex("w", [4, 0]): records["bottom"]}
    md.planner_data = {"w": ("w",)}
    meta_path.write_bytes(pickle.dumps(md))
    from_torch_dcp(src, tmp_path / "rd")
    got = {"w": torch.zeros(6, 4)}
    raydcp.load(got, tmp_path / "rd")
    assert torch.equal(got["w"], full)
    del md.storage_data[MetadataIndex("w", [4, 0])]  # a chunk without its storage record
    meta_path.write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"w \(chunk at \[4, 0\]\) has no storage record"):
        from_torch_dcp(src, tmp_path / "rd2")


class Opaque:  # a non-plain value: DCP pickles it, raydcp must not unpickle it
    def __init__(self, x):
        self.x = x


def test_from_dcp_skips_values_it_cannot_read_safely(tmp_path):
    src = tmp_path / "dcp"
    dcp.save({"w": torch.ones(2), "obj": Opaque(1), "n": 5}, storage_writer=dcp.FileSystemWriter(str(src)))
    result = from_torch_dcp(src, tmp_path / "rd")
    assert set(result.skipped) == {"obj"} and "weights_only" in result.skipped["obj"]
    assert raydcp.read_metadata(tmp_path / "rd").keys() == ["n", "w"]


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_dcp_metadata_is_refused_and_not_run(tmp_path, capsys):
    src = tmp_path / "dcp"
    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(src)))
    marker = tmp_path / "pwned"
    (src / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(CheckpointError, match=r"refusing to unpickle the global (posix|nt|os)\.system"):
        from_torch_dcp(src, tmp_path / "rd")
    code, _, err = run(capsys, "convert", src, tmp_path / "rd", "--from", "torch-dcp")
    assert code == 2 and "system" in err and "Traceback" not in err
    # hidden inside otherwise genuine DCP metadata
    md = pickle.loads(pickle.dumps(_plain_dcp_metadata(tmp_path)))
    md.planner_data = {"w": _Evil(marker)}
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        load_dcp_metadata(pickle.dumps(md))
    for payload in (b"cbuiltins\neval\n(S'1'\ntR.", b"garbage", b""):
        with pytest.raises(CheckpointError):
            load_dcp_metadata(payload)
    assert not marker.exists()


def _plain_dcp_metadata(tmp_path):
    path = tmp_path / "plain"
    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(path)))
    return load_dcp_metadata((path / ".metadata").read_bytes())


def test_to_safetensors_shards_and_index(tmp_path, capsys):
    from safetensors import safe_open

    src, dst = tmp_path / "rd", tmp_path / "st"
    want = tensors()
    raydcp.save({"t": want, "step": 7, "cfg": {"name": "x", "dims": (1, 2)}}, src)
    code, out, err = run(capsys, "convert", src, dst, "--to", "safetensors", "--max-shard-size", "100B")
    assert code == 0 and err == ""
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert n > 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(index["weight_map"]) == sorted(f"t.{k}" for k in want)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
    got = {}
    for shard in shards:
        with safe_open(str(dst / shard), framework="pt") as f:
            size, keys = 0, list(f.keys())
            for key in keys:
                assert index["weight_map"][key] == shard
                got[key] = f.get_tensor(key)
                size += got[key].numel() * got[key].element_size()
            if shard == shards[0]:
                values = {k: decode_value(v) for k, v in json.loads(f.metadata()["raydcp_values"]).items()}
                assert values == {"step": 7, "cfg.name": "x", "cfg.dims": (1, 2)}
        assert size <= 100 or len(keys) == 1
    for k, t in want.items():
        assert same_bits(got[f"t.{k}"], t), k
    # exporting again over it, with fewer shards, leaves no shard of the first export behind
    code, _, _ = run(capsys, "convert", src, dst, "--to", "safetensors", "--overwrite")
    assert code == 0 and sorted(os.listdir(dst)) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    code, _, err = run(capsys, "convert", src, dst, "--to", "torch-save", "--max-shard-size", "1GB")
    assert code == 2 and "--max-shard-size" in err


def test_to_safetensors_refuses_unsupported_dtypes(tmp_path):
    raydcp.save({"c": torch.zeros(2, dtype=torch.complex128)}, tmp_path / "rd")
    with pytest.raises(CheckpointError, match=r"c \(complex128\)"):
        to_safetensors(tmp_path / "rd", tmp_path / "st")


def test_to_torch_save(tmp_path, capsys):
    src, dst = tmp_path / "rd", tmp_path / "out" / "state.pt"
    want = training_state(0)
    raydcp.save(want, src)
    code, _, _ = run(capsys, "convert", src, dst, "--to", "torch-save")
    assert code == 0
    flat = torch.load(dst, weights_only=True)
    md = raydcp.read_metadata(src)
    assert sorted(flat) == md.keys()
    assert same_bits(flat["model.0.weight"], want["model"]["0.weight"])
    assert same_bits(flat["t.t.bfloat16"], want["t"]["t.bfloat16"])
    assert flat["optim.param_groups"] == want["optim"]["param_groups"] and flat["step"] == 10


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("100MB") == 10**8 and parse_size("512MiB") == 512 << 20
    assert parse_size("1.5 kb") == 1500 and parse_size(64) == 64 and parse_size("64") == 64
    for bad in ("lots", "5XB", "0", "-1MB"):
        with pytest.raises(CheckpointError, match="invalid size"):
            parse_size(bad)


def test_to_dcp_streams_one_group_at_a_time(tmp_path, monkeypatch):
    from raydcp.convert import torch_dcp

    src = tmp_path / "rd"
    raydcp.save({"a": torch.randn(64), "b": torch.randn(64), "c": torch.randn(8)}, src)
    held, real_load = [], torch_dcp.load_with

    def recording(transport, state, *args, **kwargs):
        assert all(ref() is None for ref in held), "a piece already written to DCP is still alive"
        real_load(transport, state, *args, **kwargs)
        held.extend(weakref.ref(v.tensor if isinstance(v, raydcp.Shard) else v) for v in state.values())

    monkeypatch.setattr(torch_dcp, "load_with", recording)
    seen = []
    result = to_torch_dcp(src, tmp_path / "dcp", budget_bytes=1, progress=lambda done, total: seen.append(done))
    assert result.tensors == 3 and len(held) == 3 and seen[-1] == result.nbytes == (64 + 64 + 8) * 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = {"a": torch.zeros(64), "b": torch.zeros(64), "c": torch.zeros(8)}
        dcp.load(got, checkpoint_id=str(tmp_path / "dcp"))
    ref = {"a": torch.zeros(64), "b": torch.zeros(64), "c": torch.zeros(8)}
    raydcp.load(ref, src)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_fsspec_urls_both_ways(capsys):
    root = "memory://raydcp-test-convert"
    want = {"a": torch.randn(3, 2), "b": torch.arange(4, dtype=torch.int16), "v": [1, "x"]}
    raydcp.save(want, f"{root}/rd")
    for argv in (["convert", f"{root}/rd", f"{root}/dcp", "--to", "torch-dcp"],
                 ["convert", f"{root}/dcp", f"{root}/back", "--from", "torch-dcp"],
                 ["convert", f"{root}/rd", f"{root}/st", "--to", "safetensors"],
                 ["convert", f"{root}/rd", f"{root}/sd.pt", "--to", "torch-save"],
                 ["diff", f"{root}/rd", f"{root}/back"],
                 ["verify", f"{root}/back"]):
        code, _, err = run(capsys, *argv)
        assert code == 0, (argv, err)
