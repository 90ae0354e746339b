"""`raydcp ls` on real run directories (the step as saved, never digits of a name; checkpoints
found below the directory given; raymem:// roots), and the distinct "no checkpoint here" errors
of a missing path, a file, a directory of checkpoints and a save that has not committed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
import torch

import raydcp
from raydcp import CheckpointNotFoundError
from raydcp.cli import ls_cmd, main

SCRIPT = os.path.join(os.path.dirname(sys.executable), "raydcp")


def cli(*argv) -> subprocess.CompletedProcess:
    """The installed console script, as users run it."""
    return subprocess.run([SCRIPT, *map(str, argv)], capture_output=True, text=True, timeout=300)


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---- a real Ray Train run ---------------------------------------------------------------------

def _two_reports(config):
    import torch

    import raydcp.train
    from raydcp.train import TrainState

    # no step in the state: the directory is named from metrics["step"], Ray Train records it
    raydcp.train.save({"w": torch.ones(4)}, metrics={"step": 5})
    model = torch.nn.Linear(2, 2)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state.step = 6  # saved as train.progress.step
    raydcp.train.save(state, metrics={"loss": 0.5})


@pytest.mark.timeout(600)
def test_ls_of_a_ray_train_run(ray_session, tmp_path):
    from ray import cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raydcp.train.callback import RECORDS_NAME

    assert ls_cmd.CALLBACK_RECORDS == RECORDS_NAME  # ls reads the callback's records without importing Ray
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    storage = tmp_path / "storage"
    TorchTrainer(_two_reports, scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 0.5}),
                 run_config=RunConfig(name="run", storage_path=str(storage))).fit()
    run_dir = storage / "run"
    names = sorted(p.name for p in run_dir.iterdir() if p.name.startswith("raydcp-step"))
    assert [n[:len("raydcp-step00000005")] for n in names] == ["raydcp-step00000005", "raydcp-step00000006"]

    proc = cli("ls", run_dir, "--json")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)["checkpoints"]}
    assert sorted(rows) == names
    assert (rows[names[0]]["step"], rows[names[0]]["step_from"]) == (5, "ray-train")
    assert (rows[names[1]]["step"], rows[names[1]]["step_from"]) == (6, "value train.progress.step")

    proc = cli("ls", storage)  # one level up: the same checkpoints, by their path below it
    assert proc.returncode == 0, proc.stderr
    lines = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in proc.stdout.splitlines()
             if "raydcp-step" in line}
    assert lines == {f"run/{names[0]}": "5", f"run/{names[1]}": "6"}

    proc = cli("inspect", run_dir)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "directory of checkpoints (2 committed below it" in proc.stderr and names[1] in proc.stderr
    assert f"raydcp ls {run_dir}" in proc.stderr


# ---- steps and depth without Ray --------------------------------------------------------------

def test_ls_steps_come_from_what_was_saved(tmp_path, capsys):
    from raydcp.pipeline.record_files import write_record
    from raydcp.pipeline.status import StatusRecord, TierCopy
    from raydcp.storage import CheckpointStorage

    run_dir = tmp_path / "exp" / "run"
    raydcp.save({"w": torch.ones(2), "step": 6}, run_dir / "raydcp-step00000006-1b855de7")  # hex nonce ending in 7
    raydcp.save({"w": torch.ones(2)}, run_dir / "raydcp-step00000005-bdf0f65e")  # nothing says: none
    raydcp.save({"w": torch.ones(2), "t.progress.step": 12}, run_dir / "ckpt-99")
    raydcp.save({"w": torch.ones(2)}, run_dir / "tier" / "p-3")
    write_record(CheckpointStorage(run_dir / "tier" / "p-3"),
                 StatusRecord(name="p-3", seq=1, tiers=[TierCopy(str(run_dir / "tier" / "p-3"))], stages=[],
                              step=8))
    (run_dir / "snapshot").mkdir()
    (run_dir / "checkpoint_manager_snapshot.json").write_text(json.dumps({"checkpoint_results": [
        {"checkpoint_dir_name": "raydcp-step00000006-1b855de7", "metrics": {"raydcp": {"step": 6}}},
        {"checkpoint_dir_name": "ckpt-99", "metrics": {"step": 99}}]}))  # the saved value wins
    raydcp.save({"w": torch.ones(2)}, run_dir / "raydcp-step00000041-aaaaaaa1")
    (run_dir / ls_cmd.CALLBACK_RECORDS).write_text("\n".join([  # RayDCPCallback's records
        json.dumps({"event": "checkpoint", "checkpoint": "raydcp-step00000041-aaaaaaa1", "step": 41}),
        '{"event": "checkpoint", "checkpoint": "cut short by a cra']))

    code, out, err = run(capsys, "ls", tmp_path / "exp", "--json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    steps = {r["name"]: (r["step"], r["step_from"]) for r in doc["checkpoints"]}
    assert steps == {"run/raydcp-step00000006-1b855de7": (6, "value step"),
                     "run/raydcp-step00000005-bdf0f65e": (None, None),
                     "run/ckpt-99": (12, "value t.progress.step"),
                     "run/raydcp-step00000041-aaaaaaa1": (41, "raydcp-callback"),
                     "run/tier/p-3": (8, "pipeline")}
    assert doc["uncommitted"] == [] and doc["incomplete"] is False

    code, out, _ = run(capsys, "ls", tmp_path / "exp", "--depth", "1", "--json")
    doc = json.loads(out)
    assert doc["checkpoints"] == [] and doc["incomplete"] is True
    code, out, _ = run(capsys, "ls", tmp_path / "exp", "--depth", "1")
    assert "no committed checkpoints" in out and "deeper than 1 level were not searched" in out
    code, out, _ = run(capsys, "ls", tmp_path / "exp", "--depth", "2", "--json")
    assert sorted(r["name"] for r in json.loads(out)["checkpoints"]) == [
        "run/ckpt-99", "run/raydcp-step00000005-bdf0f65e", "run/raydcp-step00000006-1b855de7",
        "run/raydcp-step00000041-aaaaaaa1"]

    # a checkpoint given itself lists as "."; a save that has not committed is named, not listed
    code, out, _ = run(capsys, "ls", run_dir / "ckpt-99", "--json")
    assert [(r["name"], r["step"]) for r in json.loads(out)["checkpoints"]] == [(".", 12)]
    os.remove(run_dir / "raydcp-step00000005-bdf0f65e" / "raydcp.meta")
    code, out, _ = run(capsys, "ls", run_dir)
    assert "4 committed checkpoints" in out and "not committed (1): raydcp-step00000005-bdf0f65e" in out


def test_ls_of_raymem(ray_session, capsys):
    name = f"raymem://ls-{uuid.uuid4().hex[:8]}"
    urls = [f"{name}/raydcp-step00000003-0badf00d", f"{name}/raydcp-step00000004-cafe1234"]
    try:
        keep = {"keep_last": 0}  # both kept: by default a commit releases the older ones of the NAME
        raydcp.save({"w": torch.ones(4), "step": 3}, urls[0], storage_options=keep)
        raydcp.save({"w": torch.ones(4), "train.progress.step": 4}, urls[1], storage_options=keep)
        code, out, err = run(capsys, "ls", name, "--json")
        assert code == 0, err
        rows = json.loads(out)["checkpoints"]
        assert [(r["name"], r["step"], r["tensors"]) for r in rows] == [
            ("raydcp-step00000003-0badf00d", 3, 1), ("raydcp-step00000004-cafe1234", 4, 1)]
    finally:
        from raydcp.storage import CheckpointStorage

        for url in urls:
            CheckpointStorage(url).delete()


# ---- what a path holds when it holds no checkpoint -------------------------------------------

def test_distinct_messages_for_paths_without_a_checkpoint(tmp_path):
    raydcp.save({"w": torch.ones(2)}, tmp_path / "run" / "a" / "step-1")
    raydcp.save({"w": torch.ones(2)}, tmp_path / "run" / "b")
    (tmp_path / "notes.txt").write_text("mine")
    raydcp.save({"w": torch.ones(2)}, tmp_path / "unfinished")
    os.remove(tmp_path / "unfinished" / "raydcp.meta")  # the data and the commit log, no metadata
    (tmp_path / "empty").mkdir()
    cases = {
        "missing": (tmp_path / "nope", "no such file or directory"),
        "file": (tmp_path / "notes.txt", "it is a file, not a checkpoint directory"),
        "metadata-file": (tmp_path / "run" / "b" / "raydcp.meta",
                          f"the metadata file of a checkpoint; pass its directory: {tmp_path / 'run' / 'b'}"),
        "checkpoints-below": (tmp_path / "run", f"directory of checkpoints (2 committed below it, newest first: "
                                                f"b, a/step-1); pass one of them (`raydcp ls {tmp_path / 'run'}`"),
        "uncommitted": (tmp_path / "unfinished", "a save there has not committed"),
        "empty": (tmp_path / "empty", "an empty directory"),
    }
    messages = set()
    for case, (path, words) in cases.items():
        with pytest.raises(CheckpointNotFoundError) as info:  # the Python API says it
            raydcp.read_metadata(path)
        err = info.value
        assert words in str(err) and str(err).startswith(f"no committed raydcp checkpoint at {path}: "), case
        assert err.reason == ("file" if case == "metadata-file" else case) and err.path == str(path)
        assert len(str(err).replace(str(path), "PATH")) < 200, str(err)  # short, whatever the path
        messages.add(str(err).split(": ", 1)[1])
        proc = cli("inspect", path)  # and so do the commands
        assert proc.returncode == 2 and proc.stderr == f"raydcp: error: {err}\n"
    assert len(messages) == len(cases)
    assert info.type is CheckpointNotFoundError
    with pytest.raises(CheckpointNotFoundError) as info:
        raydcp.read_metadata(tmp_path / "run")
    assert info.value.below == ("a/step-1", "b")  # oldest first

    proc = cli("ls", tmp_path / "run")  # and ls lists them
    assert proc.returncode == 0 and "2 committed checkpoints" in proc.stdout and "a/step-1" in proc.stdout
