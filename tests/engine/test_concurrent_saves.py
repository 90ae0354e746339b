"""Saves racing to one path: one commits, the other fails with ConcurrentSaveError, and the
checkpoint left loads exactly (threads and processes, on a local disk)."""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import threading
from pathlib import Path

import torch

import raydcp
from raydcp.errors import ConcurrentSaveError

engine_save = importlib.import_module("raydcp.engine.save")


def _state(tag: float) -> dict:
    return {"w": torch.full((64,), tag), "b": torch.arange(8, dtype=torch.float64) + tag, "step": int(tag)}


def _load(path: str) -> dict:
    out = {"w": torch.zeros(64), "b": torch.zeros(8, dtype=torch.float64), "step": None}
    raydcp.load(out, path)
    return out


def _assert_is(state: dict, tag: float) -> None:
    want = _state(tag)
    assert torch.equal(state["w"], want["w"]) and torch.equal(state["b"], want["b"]) and state["step"] == want["step"]


def test_two_saves_written_at_once_one_commits_the_other_fails_clearly(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    raydcp.save(_state(0.0), path)
    both_written = threading.Barrier(2)
    real_commit = engine_save.commit_round

    def commit_after_both_wrote(*args, **kwargs):
        both_written.wait(timeout=60)  # both saves have begun and written their files
        return real_commit(*args, **kwargs)

    monkeypatch.setattr(engine_save, "commit_round", commit_after_both_wrote)
    outcome: dict[float, object] = {}

    def save(tag):
        try:
            outcome[tag] = raydcp.save(_state(tag), path)
        except raydcp.CheckpointError as exc:
            outcome[tag] = exc

    threads = [threading.Thread(target=save, args=(tag,)) for tag in (1.0, 2.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    won = [tag for tag, o in outcome.items() if isinstance(o, raydcp.Metadata)]
    lost = [o for o in outcome.values() if not isinstance(o, raydcp.Metadata)]
    assert len(won) == 1 and len(lost) == 1, outcome
    assert isinstance(lost[0], ConcurrentSaveError) and "another save committed" in str(lost[0])
    _assert_is(_load(path), won[0])
    md = raydcp.read_metadata(path)
    on_disk = {str(p.relative_to(path)) for p in Path(path, "data").rglob("*") if p.is_file()}
    assert on_disk == set(md.files)  # the loser's files and the replaced save's are gone


def _saver(path: str, tag: int, rounds: int, start, results) -> None:
    import raydcp as rd

    start.wait(timeout=120)
    for i in range(rounds):
        value = float(tag * 100 + i)
        try:
            md = rd.save(_state(value), path)
            results.put(("ok", md.save_id, value))
        except rd.errors.ConcurrentSaveError as exc:
            results.put(("lost", exc.save_id, value))
        except Exception as exc:  # anything else is a failure of the test
            results.put(("error", repr(exc), value))


def test_processes_saving_to_one_path_leave_a_checkpoint_that_loads_exactly(tmp_path):
    path = str(tmp_path / "ck")
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(2)
    results = ctx.Queue()
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), env_path]))
    procs = [ctx.Process(target=_saver, args=(path, tag, 4, start, results)) for tag in (1, 2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=300) for _ in range(8)]
    for p in procs:
        p.join(timeout=60)
    assert not [g for g in got if g[0] == "error"], got
    ok = {save_id: value for kind, save_id, value in got if kind == "ok"}
    assert ok, got
    md = raydcp.read_metadata(path)
    assert md.save_id in ok
    _assert_is(_load(path), ok[md.save_id])
    on_disk = {str(p.relative_to(path)) for p in Path(path, "data").rglob("*") if p.is_file()}
    assert on_disk == set(md.files)
