"""Retention (``keep_last``) of the memory and node-local tiers, on the session's single Ray node.

Its scope is the directory beside the checkpoint just committed, the checkpoints there that were
saved with ``keep_last``, and in them raydcp's own files: another run's checkpoints, a save
without ``keep_last`` and a user's files stay.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

import raydcp
from raydcp.storage import list_committed


def _save(url: str, step: int, **options) -> None:
    raydcp.save({"w": torch.full((64,), float(step)), "step": step}, url, storage_options=options or None)


def _step(url: str) -> int:
    out = {"w": torch.zeros(64), "step": -1}
    raydcp.load(out, url)
    assert torch.equal(out["w"], torch.full((64,), float(out["step"])))
    return out["step"]


def _committed(url: str) -> bool:
    try:
        raydcp.read_metadata(url)
        return True
    except raydcp.CheckpointError:
        return False


def test_node_local_keep_last_stays_in_its_own_run(ray_session, tmp_path):
    node = ray_session.get_runtime_context().get_node_id()
    base = f"raynode://{tmp_path}/{{node}}"
    disk = tmp_path / node
    _save(f"{base}/runA/step-1", 1)                       # another run, saved without keep_last
    _save(f"{base}/runB/step-1", 1, keep_last=1)
    (disk / "runB" / "step-1" / "README").write_text("notes beside an older checkpoint")
    (disk / "runB" / "notes.txt").write_text("a user's file in the run's directory")
    (disk / "stray.txt").write_text("a user's file at the tier's root")
    _save(f"{base}/runB/manual", 5, keep_last=0)           # in runB's directory, without keep_last

    _save(f"{base}/runB/step-2", 2, keep_last=1)

    assert _step(f"{base}/runA/step-1") == 1
    assert _step(f"{base}/runB/manual") == 5
    assert _step(f"{base}/runB/step-2") == 2
    assert not _committed(f"{base}/runB/step-1")
    left = [os.path.relpath(os.path.join(d, f), disk / "runB" / "step-1")
            for d, _, files in os.walk(disk / "runB" / "step-1") for f in files]
    assert left == ["README"]  # raydcp's files went, the README stayed
    assert (disk / "runB" / "notes.txt").exists() and (disk / "stray.txt").exists()


def test_retention_scope_is_the_directory_beside_the_checkpoint():
    from raydcp.runtime.memstore.commit import retention_scope

    assert retention_scope("run-7/step-200/raydcp.meta") == "run-7"
    assert retention_scope("/nvme/{node}/run-7/step-200/raydcp.meta") == "/nvme/{node}/run-7"
    assert retention_scope("ckpt/raydcp.meta") is None   # raymem://ckpt: nothing beside it to count
    assert retention_scope("/ckpt/raydcp.meta") is None  # raynode:///ckpt: never the whole disk


def test_node_local_keep_last_counts_only_saves_with_keep_last(ray_session, tmp_path):
    _save(f"raynode://{tmp_path}/{{node}}/one", 1)
    _save(f"raynode://{tmp_path}/{{node}}/two", 2, keep_last=1)
    _save(f"raynode://{tmp_path}/{{node}}/three", 3, keep_last=1)
    # the scope of .../{node}/three is .../{node}: "two" goes, "one" (without keep_last) stays
    assert _step(f"raynode://{tmp_path}/{{node}}/one") == 1
    assert not _committed(f"raynode://{tmp_path}/{{node}}/two")
    assert _step(f"raynode://{tmp_path}/{{node}}/three") == 3


@pytest.mark.parametrize("later_keep_last", [0, 1])
def test_memory_keep_last_counts_only_saves_with_keep_last(ray_session, later_keep_last):
    name = f"h1-retention-{later_keep_last}-{os.getpid()}"
    _save(f"raymem://{name}/other/step-1", 1)              # a deeper directory: another scope
    _save(f"raymem://{name}/run/a", 1, keep_last=0)
    _save(f"raymem://{name}/run/b", 2)                     # keep_last=1 by default
    _save(f"raymem://{name}/run/c", 3)
    _save(f"raymem://{name}/run/a", 4, keep_last=later_keep_last)  # the same path again
    _save(f"raymem://{name}/run/d", 5)
    assert _step(f"raymem://{name}/other/step-1") == 1
    assert not _committed(f"raymem://{name}/run/b") and not _committed(f"raymem://{name}/run/c")
    assert _step(f"raymem://{name}/run/d") == 5
    assert _committed(f"raymem://{name}/run/a") == (later_keep_last == 0)
    kept = [c.name for c in list_committed(f"raymem://{name}/run")]
    assert sorted(kept) == (["a", "d"] if later_keep_last == 0 else ["d"])


def test_node_local_copy_whose_data_links_to_the_original_keeps_it_whole(ray_session, tmp_path):
    node = ray_session.get_runtime_context().get_node_id()
    disk = tmp_path / node
    original, copy = f"raynode://{tmp_path}/{{node}}/original", f"raynode://{tmp_path}/{{node}}/copy"
    _save(original, 1)
    (disk / "copy").mkdir()
    os.symlink(disk / "original" / "data", disk / "copy" / "data")
    shutil.copyfile(disk / "original" / "raydcp.meta", disk / "copy" / "raydcp.meta")
    assert _step(copy) == 1  # the copy reads the original's files through its link

    _save(copy, 2)  # replaces the copy's checkpoint: the files it reaches through the link stay

    assert _step(copy) == 2
    assert _step(original) == 1


def test_a_disk_holder_never_removes_what_it_found_through_a_linked_data_dir(tmp_path):
    from raydcp.runtime.memstore.holder import MemHolder

    sid = "g0-0123456789ab"
    original = tmp_path / "original" / "data" / sid
    original.mkdir(parents=True)
    (original / "r00000-f000.bin").write_bytes(b"the original's bytes")
    (tmp_path / "copy").mkdir()
    os.symlink(tmp_path / "original" / "data", tmp_path / "copy" / "data")
    holder = MemHolder("node-a", kind="disk")  # a plain class: no actor needed
    name = f"{tmp_path}/copy/data/{sid}/r00000-f000.bin"

    assert list(holder.listing(f"{tmp_path}/copy/data/{sid}")) == [name]  # found and readable
    assert holder.read_ranges(name, [4], [12])[0].tobytes() == b"original"
    holder.remove([name])

    assert (original / "r00000-f000.bin").read_bytes() == b"the original's bytes"
