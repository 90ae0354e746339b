"""Retention and the commit log's prune with delta checkpoints: nothing a committed checkpoint
references is removed, and it goes once nothing references it (raydcp.storage.references)."""
from __future__ import annotations

import os

import torch

import raydcp
from raydcp import SaveOptions
from raydcp.storage import CheckpointStorage, apply_retention
from raydcp.storage import references as refs

DELTA = SaveOptions(base="previous")


def state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"frozen": torch.randn(128, 64, generator=g), "adapter": torch.randn(4, 4, generator=g), "step": 0}


def loads(path, expect: dict) -> None:
    out = {"frozen": torch.zeros(128, 64), "adapter": torch.zeros(4, 4), "step": -1}
    raydcp.load(out, path)
    assert torch.equal(out["frozen"], expect["frozen"]) and torch.equal(out["adapter"], expect["adapter"])


def files_under(path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def test_keep_last_keeps_what_the_kept_delta_references_then_lets_it_go(tmp_path):
    s = state()
    for step in range(1, 5):
        s["adapter"] += 1
        if step == 4:
            s["frozen"] += 1  # everything changes: step-4 references nothing
        raydcp.save(s, tmp_path / f"step-{step}", options=DELTA)
        apply_retention(tmp_path, 1)
        loads(tmp_path / f"step-{step}", s)
        if step in (2, 3):  # step-1 retired (no metadata), its frozen bytes kept for the newest
            assert not (tmp_path / "step-1" / "raydcp.meta").exists()
            assert any(f.endswith(".bin") for f in files_under(tmp_path / "step-1"))
    assert sorted(os.listdir(tmp_path)) == ["step-4"]  # the retired bases went with their last referrer


def test_a_user_file_in_a_retired_base_stays(tmp_path):
    s = state()
    raydcp.save(s, tmp_path / "a", options=DELTA)
    (tmp_path / "a" / "README").write_text("mine")
    s["adapter"] += 1
    raydcp.save(s, tmp_path / "b", options=DELTA)
    apply_retention(tmp_path, 1)
    s["frozen"] += 1
    raydcp.save(s, tmp_path / "c", options=DELTA)
    apply_retention(tmp_path, 1)
    assert files_under(tmp_path / "a") == ["README"]
    assert not (tmp_path / "b" / "raydcp.meta").exists()  # retired: c references its adapter
    loads(tmp_path / "c", s)


def test_a_delta_save_does_not_reference_a_base_being_removed(tmp_path):
    s = state()
    raydcp.save(s, tmp_path / "a", options=DELTA)
    CheckpointStorage(str(tmp_path / "a")).write_file(refs.TOMBSTONE, [b""])  # a removal in progress
    s["adapter"] += 1
    raydcp.save(s, tmp_path / "b", options=SaveOptions(base=str(tmp_path / "a")))
    files = raydcp.read_metadata(tmp_path / "b").files
    assert not any(f.startswith("../") for f in files)
    loads(tmp_path / "b", s)


def test_a_pin_written_before_a_removal_keeps_the_files(tmp_path):
    """The removal's side of the race: a delta save that pinned before the removal read the pins
    keeps its files, even before it commits (a save in progress)."""
    s = state()
    raydcp.save(s, tmp_path / "a", options=DELTA)
    md = raydcp.read_metadata(tmp_path / "a")
    base = CheckpointStorage(str(tmp_path / "a"))
    (tmp_path / "b" / "_raydcp").mkdir(parents=True)
    (tmp_path / "b" / "_raydcp" / "begun-g1-000000000001").write_bytes(b"")  # its save, begun
    refs.write_pin(base, "../b", "g1-000000000001", 0, list(md.files))
    raydcp.storage.remove_checkpoint(str(tmp_path / "a"))
    assert not (tmp_path / "a" / "raydcp.meta").exists()
    for f in md.files:
        assert (tmp_path / "a" / f).exists()
    assert not (tmp_path / "a" / refs.TOMBSTONE).exists()


def test_resaving_the_base_path_keeps_the_data_a_delta_references(tmp_path):
    s = state()
    raydcp.save(s, tmp_path / "base", options=DELTA)
    s["adapter"] += 1
    raydcp.save(s, tmp_path / "delta", options=SaveOptions(base=str(tmp_path / "base")))
    other = {k: (v + 5 if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
    raydcp.save(other, tmp_path / "base")  # a new save into the base's path prunes its old data
    loads(tmp_path / "delta", s)
    loads(tmp_path / "base", other)


def test_delta_saves_racing_retention_never_lose_a_referenced_byte(tmp_path):
    """A run saving deltas while another process prunes it (keep_last=1) as fast as it can: every
    checkpoint that committed loads, whichever removal it raced, until retention removed it."""
    import threading

    from raydcp.errors import CheckpointError

    s = state()
    done = threading.Event()
    problems: list[str] = []

    def prune() -> None:
        while not done.is_set():
            try:
                apply_retention(tmp_path, 1)
            except CheckpointError as exc:  # a directory removed under its feet: the next pass goes on
                problems.append(f"retention: {exc}") if "is damaged" in str(exc) else None

    pruner = threading.Thread(target=prune, daemon=True)
    pruner.start()
    try:
        for step in range(1, 16):
            s["adapter"] += 1
            path = tmp_path / f"step-{step:02d}"
            raydcp.save(s, path, options=DELTA)
            out = {"frozen": torch.zeros(128, 64), "adapter": torch.zeros(4, 4), "step": -1}
            try:
                raydcp.load(out, path)
            except raydcp.CheckpointNotFoundError:
                continue  # retention removed it already (a newer one exists): not a loss
            assert torch.equal(out["frozen"], s["frozen"]) and torch.equal(out["adapter"], s["adapter"])
    finally:
        done.set()
        pruner.join(30)
    assert not problems
    apply_retention(tmp_path, 1)
    loads(tmp_path / "step-15", s)
