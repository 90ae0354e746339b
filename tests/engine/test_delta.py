"""Delta saves (``SaveOptions(base=...)``): unchanged pieces referenced, not written; loads equal a
full save's, resharded too; a changed byte is always written; a deleted base is a named error."""
from __future__ import annotations

import logging
import shutil

import pytest
import torch

import raydcp
from raydcp import CheckpointError, SaveOptions, Shard
from raydcp.engine.load import load_with
from raydcp.engine.save import save_with
from raydcp.errors import CheckpointDamagedError, CheckpointNotFoundError
from raydcp.verify import verify_checkpoint

from .helpers import run_ranks

DELTA = SaveOptions(base="previous")


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"frozen": torch.randn(256, 64, generator=g), "emb": torch.randn(64, 32, generator=g),
            "adapter": torch.randn(8, 8, generator=g), "step": seed}


def blank() -> dict:
    return {"frozen": torch.zeros(256, 64), "emb": torch.zeros(64, 32), "adapter": torch.zeros(8, 8), "step": -1}


def own_and_refs(path: str) -> tuple[dict, dict]:
    files = raydcp.read_metadata(path).files
    return ({f: n for f, n in files.items() if not f.startswith("../")},
            {f: n for f, n in files.items() if f.startswith("../")})


def test_unchanged_pieces_are_referenced_and_loads_match(tmp_path):
    s = state()
    raydcp.save(s, tmp_path / "step-1", options=DELTA)
    s["adapter"] += 1
    s["step"] = 2
    raydcp.save(s, tmp_path / "step-2", options=DELTA)
    md = raydcp.read_metadata(tmp_path / "step-2")
    assert md.version == (3, 0)
    own, refs = own_and_refs(tmp_path / "step-2")
    assert all(f.startswith("../step-1/data/") for f in refs)
    assert sum(own.values()) == s["adapter"].nbytes  # only the changed tensor was written
    out = blank()
    raydcp.load(out, tmp_path / "step-2")
    for k in ("frozen", "emb", "adapter"):
        assert torch.equal(out[k], s[k])
    assert out["step"] == 2


@pytest.mark.parametrize("how", ["index", "data", "numpy", "copy_"])
def test_a_changed_byte_is_written_however_it_was_changed(tmp_path, how):
    s = state()
    raydcp.save(s, tmp_path / "a", options=DELTA)
    t = s["frozen"]
    if how == "index":
        t[7, 3] += 1
    elif how == "data":
        t.data[7, 3] = t.data[7, 3] + 1
    elif how == "numpy":
        t.numpy()[7, 3] += 1  # a view torch's version counter does not see
    else:
        with torch.no_grad():
            row = t[7].clone()
            row[3] += 1
            t[7].copy_(row)
    raydcp.save(s, tmp_path / "b", options=SaveOptions(base=str(tmp_path / "a")))
    own, _ = own_and_refs(tmp_path / "b")
    assert sum(own.values()) >= t.nbytes
    out = blank()
    raydcp.load(out, tmp_path / "b")
    assert torch.equal(out["frozen"], t)


def test_deltas_stay_one_hop_deep_and_equal_full_saves(tmp_path):
    s = state()
    for step in range(1, 6):
        s["adapter"] += step
        s["step"] = step
        raydcp.save(s, tmp_path / f"step-{step}", options=DELTA)
    raydcp.save(s, tmp_path / "full")
    _, refs = own_and_refs(tmp_path / "step-5")
    # frozen and emb lie in step-1's file; the adapter was written by step-5 itself
    assert {f.split("/data/")[0] for f in refs} == {"../step-1"}
    a, b = blank(), blank()
    raydcp.load(a, tmp_path / "step-5")
    raydcp.load(b, tmp_path / "full")
    for k in ("frozen", "emb", "adapter"):
        assert torch.equal(a[k], b[k])


def _sharded(rank: int, world: int, full: dict) -> dict:
    rows = full["frozen"].shape[0] // world
    return {"frozen": Shard(full["frozen"][rank * rows:(rank + 1) * rows].clone(), (rank * rows, 0),
                            tuple(full["frozen"].shape)),
            "adapter": full["adapter"].clone(), "step": full["step"]}


def test_group_delta_resharded_load(tmp_path):
    full = state(3)
    ck1, ck2 = str(tmp_path / "s1"), str(tmp_path / "s2")
    _, errs = run_ranks(4, lambda tr: save_with(tr, _sharded(tr.rank, 4, full), ck1, options=DELTA))
    assert errs == [None] * 4
    full["adapter"] += 1
    _, errs = run_ranks(4, lambda tr: save_with(tr, _sharded(tr.rank, 4, full), ck2, options=DELTA))
    assert errs == [None] * 4
    own, refs = own_and_refs(ck2)
    assert sum(refs.values()) >= full["frozen"].nbytes and sum(own.values()) < full["frozen"].nbytes
    outs = [None] * 3

    def load(tr):
        rows = 256 // 3 + (1 if tr.rank < 256 % 3 else 0)
        start = sum(256 // 3 + (1 if r < 256 % 3 else 0) for r in range(tr.rank))
        sd = {"frozen": Shard(torch.zeros(rows, 64), (start, 0), (256, 64)), "adapter": torch.zeros(8, 8), "step": 0}
        load_with(tr, sd, ck2)
        outs[tr.rank] = (start, rows, sd)

    _, errs = run_ranks(3, load)
    assert errs == [None] * 3
    for start, rows, sd in outs:
        assert torch.equal(sd["frozen"].tensor, full["frozen"][start:start + rows])
        assert torch.equal(sd["adapter"], full["adapter"])


def test_previous_is_this_writers_and_falls_back_to_full(tmp_path):
    s = state()
    raydcp.save(s, tmp_path / "other")  # no digests: never a base
    raydcp.save(s, tmp_path / "first", options=DELTA)
    own, refs = own_and_refs(tmp_path / "first")
    assert not refs and sum(own.values()) == sum(t.nbytes for k, t in s.items() if k != "step")


def test_deleted_base_is_a_named_error(tmp_path):
    s = state()
    raydcp.save(s, tmp_path / "base", options=DELTA)
    s["adapter"] += 1
    raydcp.save(s, tmp_path / "delta", options=DELTA)
    shutil.rmtree(tmp_path / "base")
    out = blank()
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
    with pytest.raises(CheckpointDamagedError) as err:
        raydcp.load(out, tmp_path / "delta")
    assert "base checkpoint ../base" in str(err.value) and "deleted or moved" in str(err.value)
    assert torch.equal(out["frozen"], before["frozen"])  # the load left the state as it was
    report = verify_checkpoint(str(tmp_path / "delta"))
    assert not report.ok and any("../base/" in f or "/base/" in f for f in report.damaged_files)


def test_verify_checks_the_referenced_bytes(tmp_path):
    s = state()
    raydcp.save(s, tmp_path / "base", options=DELTA)
    s["adapter"] += 1
    raydcp.save(s, tmp_path / "delta", options=DELTA)
    assert verify_checkpoint(str(tmp_path / "delta")).ok
    (chunk,) = raydcp.read_metadata(tmp_path / "base").tensors["frozen"].chunks
    path = tmp_path / "base" / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.byte_offset + 100] ^= 1
    path.write_bytes(bytes(data))
    report = verify_checkpoint(str(tmp_path / "delta"))
    assert not report.ok and any("base" in f for f in report.damaged_files)


def test_bad_bases_are_refused(tmp_path):
    s = state()
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        raydcp.save(s, tmp_path / "x", options=SaveOptions(base=str(tmp_path / "nothing")))
    raydcp.save(s, tmp_path / "x", options=DELTA)
    with pytest.raises(CheckpointError, match="is the path being saved"):
        raydcp.save(s, tmp_path / "x", options=SaveOptions(base=str(tmp_path / "x")))
    with pytest.raises(CheckpointError, match="another filesystem"):
        raydcp.save(s, "memory://delta-test/y", options=SaveOptions(base=str(tmp_path / "x")))
    with pytest.raises(CheckpointError, match="SaveOptions.base"):
        SaveOptions(base=3)


def test_a_damaged_digest_file_makes_the_pieces_written(tmp_path, caplog):
    s = state()
    raydcp.save(s, tmp_path / "a", options=DELTA)
    md = raydcp.read_metadata(tmp_path / "a")
    (digests,) = [p for p in (tmp_path / "a" / "data" / md.save_id).iterdir() if p.suffix == ".xxh3"]
    data = bytearray(digests.read_bytes())
    data[-1] ^= 1
    digests.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, logger="raydcp.engine.delta")
    raydcp.save(s, tmp_path / "b", options=DELTA)  # nothing of the base is trusted: all written
    own, refs = own_and_refs(tmp_path / "b")
    assert not refs and "digest file" in caplog.text and "damaged" in caplog.text
    out = blank()
    raydcp.load(out, tmp_path / "b")
    assert torch.equal(out["frozen"], s["frozen"])


def test_async_saves_are_deltas_of_this_processes_previous(tmp_path):
    s = state()
    raydcp.save(s, tmp_path / "step-1", options=DELTA)
    s["adapter"] += 1
    raydcp.async_save(s, tmp_path / "step-2", options=DELTA).result()
    own, refs = own_and_refs(tmp_path / "step-2")
    assert sum(own.values()) == s["adapter"].nbytes and all(f.startswith("../step-1/") for f in refs)
    s["adapter"] += 1
    raydcp.async_save(s, tmp_path / "step-3", options=DELTA).result()
    own, refs = own_and_refs(tmp_path / "step-3")
    assert sum(own.values()) == s["adapter"].nbytes
    out = blank()
    raydcp.load(out, tmp_path / "step-3")
    assert torch.equal(out["adapter"], s["adapter"]) and torch.equal(out["frozen"], s["frozen"])


@pytest.mark.parametrize("bad", ["../a/../../etc/data/x.bin", "../data", "..//data/x.bin", "../a/./data/x.bin"])
def test_hostile_references_are_refused_naming_the_file(tmp_path, bad):
    from raydcp.metadata_format import encode_metadata
    from raydcp.storage import CheckpointStorage

    s = state()
    raydcp.save(s, tmp_path / "a")
    md = raydcp.read_metadata(tmp_path / "a")
    CheckpointStorage(str(tmp_path / "a")).commit(encode_metadata(md.with_files(lambda n: bad)))
    with pytest.raises(CheckpointDamagedError, match="invalid"):
        raydcp.load(blank(), tmp_path / "a")
