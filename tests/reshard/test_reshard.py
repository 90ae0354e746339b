"""Streaming reshard without Ray: planning, the multi-round save, the local engine and `raydcp reshard`.

Sources are saved by N ranks (threads, dim-0 pieces); every destination is read back and
compared bit for bit with the reference, and its pieces with the layout it was asked for.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import raydcp
from raydcp.cli import main as cli_main
from raydcp.engine.rounds import RoundRecords, commit_rounds, new_save_id, round_save_id, write_round
from raydcp.errors import CheckpointError
from raydcp.planner import TensorSpec
from raydcp.reshard import ReshardOptions, ThreadExecutor, plan_reshard, reshard, reshard_with
from raydcp.planner.layouts import piece_box
from raydcp.state import Shard
from raydcp.transport import LocalTransport
from tests.engine.helpers import run_ranks

REPO = Path(__file__).resolve().parents[2]


def reference_state() -> dict:
    """Small, but with every shape the planner must handle: uneven rows, 1-D, 0-D, empty, ints, fp64."""
    g = torch.Generator().manual_seed(7)
    return {
        "model.embed": torch.randn(13, 6, generator=g),
        "model.layer.weight": torch.randn(8, 5, generator=g),
        "model.layer.bias": torch.randn(5, generator=g),
        "model.scale": torch.tensor(2.5, dtype=torch.float64),
        "model.empty": torch.empty(0, 3),
        "model.index": torch.arange(12, dtype=torch.int64).reshape(4, 3),
        "optim.state.0.exp_avg": torch.randn(13, 6, generator=g),
        "optim.state.0.step": torch.tensor(5.0),
        "optim.param_groups": [{"lr": 0.01, "params": [0]}],
        "epoch": 3,
    }


def save_as_ranks(full: dict, path: str, world: int) -> None:
    """Save ``full`` from ``world`` ranks, each holding a dim-0 piece of every tensor (values on all)."""
    def rank_state(rank: int) -> dict:
        out = {}
        for k, v in full.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                (off, size) = piece_box(tuple(v.shape), "dim0", rank, world)
                out[k] = Shard(v.narrow(0, off[0], size[0]).clone(), off, tuple(v.shape))
            else:
                out[k] = v
        return out

    results, errors = run_ranks(world, lambda t: raydcp.engine.save_with(t, rank_state(t.rank), path))
    assert errors == [None] * world, errors


def read_back(path: str) -> dict:
    md = raydcp.read_metadata(path)
    out: dict = {k: torch.empty(t.shape, dtype=getattr(torch, t.dtype)) for k, t in md.tensors.items()}
    out.update({k: None for k in md.values})
    raydcp.load(out, path)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                    b.reshape(-1).view(torch.uint8))


def assert_resharded(dst: str, full: dict, options: ReshardOptions) -> None:
    """DST holds ``full`` (cast, minus dropped keys) bit for bit, in the pieces of the layout."""
    got = read_back(dst)
    want = {k: v for k, v in full.items() if not options.dropped(k)}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            dtype = options.keys.cast(k, str(v.dtype).removeprefix("torch."))  # the model's floats only
            exp = v.to(getattr(torch, dtype))
            assert same_bits(got[k], exp), k
        else:
            assert got[k] == v, k
    md = raydcp.read_metadata(dst)
    assert md.world_size == options.world_size
    for k, t in md.tensors.items():
        boxes = sorted((c.offsets, c.sizes) for c in t.chunks)
        if not t.nbytes:
            assert boxes == [], k
            continue
        if options.consolidate or len(t.shape) == 0 or options.layout == "replicated":
            assert boxes == [((0,) * len(t.shape), tuple(t.shape))], k
            continue
        want_boxes = sorted({piece_box(tuple(t.shape), options.layout, r, options.world_size)
                             for r in range(options.world_size)})
        want_boxes = [b for b in want_boxes if all(b[1])]
        if options.memory_budget >= 1 << 20:  # no row blocks: exactly one piece per rank
            assert boxes == want_boxes, k


# ------------------------------------------------------------------------------ planning (pure)

def test_plan_keeps_every_round_within_the_budget(src):
    md = raydcp.read_metadata(src)
    for per_process in ("sum", "max"):
        for layout in ("dim0", "dim1", "replicated"):
            opts = ReshardOptions(world_size=3, layout=layout, memory_budget=160)
            plan = plan_reshard(md, opts, per_process=per_process)
            assert all(r.peak_bytes <= 160 for r in plan.rounds), (per_process, layout)
            assert len(plan.rounds) > 1
            # every tensor's parts cover its rows exactly once
            for key, spec in plan.tensors.items():
                parts = [p for r in plan.rounds for p in r.parts if p.tensor == key]
                rows = sorted(p.rows or (0, spec.shape[0] if spec.shape else 1) for p in parts)
                if spec.shape and spec.shape[0]:
                    assert rows[0][0] == 0 and rows[-1][1] == spec.shape[0]
                    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:])), key
                # a round never holds two parts of one tensor
                assert all(len({p.tensor for p in r.parts}) == len(r.parts) for r in plan.rounds)


def test_plan_options_and_errors(src):
    md = raydcp.read_metadata(src)
    plan = plan_reshard(md, ReshardOptions(world_size=2, drop_optimizer=True, dtype="bf16", consolidate=True))
    assert plan.dropped == ("optim.param_groups", "optim.state.0.exp_avg", "optim.state.0.step")
    assert plan.tensors["model.embed"].dtype == "bfloat16" and plan.tensors["model.index"].dtype == "int64"
    assert "epoch" in plan.values and "optim.param_groups" not in plan.values
    owners = [p.owner for r in plan.rounds for p in r.parts]
    assert set(owners) == {0, 1}  # whole tensors spread over both ranks
    with pytest.raises(CheckpointError, match="raise --memory-budget"):
        plan_reshard(md, ReshardOptions(world_size=2, consolidate=True, memory_budget=128))
    for bad in (dict(world_size=0), dict(world_size=2, layout="dim7"), dict(world_size=2, dtype="int8"),
                dict(world_size=2, memory_budget=3), dict(world_size=2, drop_prefixes=("",))):
        with pytest.raises(CheckpointError):
            ReshardOptions(**bad)
    assert ReshardOptions(world_size=1, drop_prefixes=("model.layer",)).dropped("model.layer.bias")
    assert not ReshardOptions(world_size=1, drop_prefixes=("model.layer",)).dropped("model.layers.0")


# --------------------------------------------------------------------------- multi-round save

def test_commit_rounds_refuses_gaps_and_foreign_rounds(tmp_path):
    path = str(tmp_path / "ck")
    base = new_save_id()
    rounds = []
    for i, rows in enumerate(((0, 2), (2, 4))):
        t = torch.arange(rows[0] * 3, rows[1] * 3, dtype=torch.float32).reshape(2, 3)
        rounds.append(write_round(LocalTransport(), {f"w#{i}": t}, path, round_save_id(base, i)))
    spec = {"w": TensorSpec("float32", (4, 3))}
    placement = {"w#0": ("w", (0, 0)), "w#1": ("w", (2, 0))}
    with pytest.raises(CheckpointError, match="cover 6 of 12"):
        commit_rounds(path, base, 1, rounds[:1], spec, placement=placement)
    with pytest.raises(CheckpointError, match="not a round of save"):
        commit_rounds(path, new_save_id(), 1, rounds, spec, placement=placement)
    assert not os.path.exists(os.path.join(path, "raydcp.meta"))  # nothing committed
    md = commit_rounds(path, base, 1, rounds, spec, {"step": 1}, placement=placement, extra={"note": "x"})
    assert md.extra == {"note": "x"} and raydcp.read_metadata(path).values == {"step": 1}
    assert same_bits(read_back(path)["w"], torch.arange(12, dtype=torch.float32).reshape(4, 3))
    rt = RoundRecords.from_json(json.loads(json.dumps(rounds[0].to_json())))
    assert rt == rounds[0]


# ------------------------------------------------------------------------ the local engine

CASES = [
    ReshardOptions(world_size=3),                                                  # 2 -> 3, dim0
    ReshardOptions(world_size=4, layout="dim1", memory_budget=200),                # row blocks, many rounds
    ReshardOptions(world_size=1, layout="replicated", dtype="fp16"),               # 2 -> 1, cast
    ReshardOptions(world_size=3, consolidate=True, drop_optimizer=True, memory_budget=800),
]


@pytest.mark.parametrize("options", CASES, ids=["dim0-3", "dim1-4-blocks", "replicated-1-fp16", "consolidate-3"])
def test_reshard_is_bit_exact(tmp_path, src, full, options):
    dst = str(tmp_path / "dst")
    result = reshard(src, dst, options)
    assert not result.noop and result.rounds >= 1 and result.source_world_size == 2
    assert_resharded(dst, full, options)
    md = raydcp.read_metadata(dst)
    assert md.extra["reshard"]["source_save_id"] == raydcp.read_metadata(src).save_id
    assert md.extra["reshard"]["options"] == options.identity()
    assert set(os.listdir(dst)) == {"raydcp.meta", "data", "_raydcp"}  # _raydcp: the commit log
    assert not [f for f in Path(dst, "data").rglob("*") if f.is_file() and f.suffix != ".bin"]  # journal gone
    assert cli_main(["verify", dst]) == 0


class FailingExecutor(ThreadExecutor):
    """Fails the round ``fail_at`` (after writing its files), as a crash there would."""

    def __init__(self, world_size: int, fail_at: int):
        super().__init__(world_size, timeout_s=30)
        self.fail_at = fail_at

    def run(self, task):
        rec = super().run(task)
        if task.round.index == self.fail_at:
            raise CheckpointError("injected failure")
        return rec


def test_failure_keeps_old_destination_and_rerun_resumes(tmp_path, src, full):
    dst = str(tmp_path / "dst")
    old = ReshardOptions(world_size=2)
    reshard(src, dst, old)
    new = ReshardOptions(world_size=3, memory_budget=200)
    with pytest.raises(CheckpointError, match="injected"):
        reshard_with(lambda: FailingExecutor(3, fail_at=2), "sum", src, dst, new, overwrite=True)
    assert_resharded(dst, full, old)  # still the old checkpoint, whole
    # rerun: rounds 0 and 1 were journaled, the rest runs; the old files and the journal are removed
    result = reshard(src, dst, new, overwrite=True)
    assert result.resumed_rounds == 2 and result.rounds > 3
    assert_resharded(dst, full, new)
    md = raydcp.read_metadata(dst)
    on_disk = {str(p.relative_to(dst)) for p in Path(dst, "data").rglob("*") if p.is_file()}
    assert on_disk == set(md.files)
    # a rerun of the finished job does nothing (no file is touched)
    stamp = os.stat(os.path.join(dst, "raydcp.meta")).st_mtime_ns
    again = reshard(src, dst, new)
    assert again.noop and again.save_id == md.save_id
    assert os.stat(os.path.join(dst, "raydcp.meta")).st_mtime_ns == stamp


def test_half_written_destination_is_taken_over(tmp_path, src, full):
    dst = str(tmp_path / "dst")
    # a different job that died before its commit: data files and a journal, no metadata
    with pytest.raises(CheckpointError, match="injected"):
        reshard_with(lambda: FailingExecutor(2, fail_at=0), "sum", src, dst, ReshardOptions(world_size=2, dtype="bf16"))
    assert sorted(os.listdir(dst)) == ["_raydcp", "data"]  # no metadata: nothing committed
    options = ReshardOptions(world_size=2)
    result = reshard(src, dst, options)  # no --overwrite needed: nothing was committed
    assert result.resumed_rounds == 0
    assert_resharded(dst, full, options)
    on_disk = {str(p.relative_to(dst)) for p in Path(dst, "data").rglob("*") if p.is_file()}
    assert on_disk == set(raydcp.read_metadata(dst).files)


def test_destination_checks(tmp_path, src):
    with pytest.raises(CheckpointError, match="same checkpoint"):
        reshard(src, src, ReshardOptions(world_size=2))
    other = str(tmp_path / "other")
    raydcp.save({"x": torch.ones(2)}, other)
    with pytest.raises(CheckpointError, match="already holds a checkpoint.*--overwrite"):
        reshard(src, other, ReshardOptions(world_size=2))
    assert same_bits(read_back(other)["x"], torch.ones(2))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not part of a raydcp checkpoint"):
        reshard(src, str(foreign), ReshardOptions(world_size=2))
    with pytest.raises(CheckpointError, match="no committed raydcp checkpoint"):
        reshard(str(tmp_path / "missing"), str(tmp_path / "d2"), ReshardOptions(world_size=2))


# ------------------------------------------------------------------------------------ CLI

def test_cli_reshard(tmp_path, src, full, capsys):
    dst = str(tmp_path / "dst")
    argv = ["reshard", src, dst, "--world-size", "3", "--layout", "dim1", "--dtype", "bf16", "--drop", "optim",
            "--memory-budget", "300", "--no-progress", "--json"]
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 3 and out["layout"] == "dim1" and out["rounds"] > 1 and out["dropped"] == 3
    assert_resharded(dst, full, ReshardOptions(world_size=3, layout="dim1", dtype="bfloat16",
                                               drop_prefixes=("optim",), memory_budget=300))
    assert cli_main(argv[:-1]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert cli_main(["reshard", src, dst, "-M", "2", "--no-progress"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli_main(["reshard", src, dst, "-M", "2", "--consolidate", "--layout", "dim0"]) == 2
    assert "cannot be combined" in capsys.readouterr().err


def test_console_script_reshard(tmp_path, src, full):
    dst = str(tmp_path / "dst")
    exe = Path(sys.executable).with_name("raydcp")
    proc = subprocess.run([str(exe), "reshard", src, dst, "-M", "2", "--consolidate"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "resharded" in proc.stdout and "2 ranks, consolidated" in proc.stdout
    assert "round 1/" in proc.stderr and "Traceback" not in proc.stderr
    assert_resharded(dst, full, ReshardOptions(world_size=2, consolidate=True))


@pytest.mark.s3
def test_reshard_to_and_from_s3(s3_server, src, full, tmp_path):
    opts = s3_server.storage_options
    dst = s3_server.new_url()
    options = ReshardOptions(world_size=3, memory_budget=200)
    with pytest.raises(CheckpointError, match="injected"):
        reshard_with(lambda: FailingExecutor(3, fail_at=1), "sum", src, dst, options, dst_storage_options=opts)
    result = reshard(src, dst, options, dst_storage_options=opts)  # resumes from the journal on S3
    assert result.resumed_rounds == 1
    back = str(tmp_path / "back")
    reshard(dst, back, ReshardOptions(world_size=2), src_storage_options=opts)  # and back from S3
    assert_resharded(back, full, ReshardOptions(world_size=2))
    assert reshard(src, dst, options, dst_storage_options=opts).noop


def test_reshard_without_overwrite_keeps_files_raydcp_did_not_write(tmp_path, src, full):
    """Item: the commit removed every file under data/ that the new metadata did not reference."""
    dst = tmp_path / "proj"
    (dst / "data" / "notes").mkdir(parents=True)
    (dst / "data" / "labels.csv").write_text("id,label\n1,cat\n")
    (dst / "data" / "notes" / "r00000-f000.bin").write_bytes(b"not raydcp's")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"behind a symlink")
    os.symlink(outside, dst / "data" / "linked")
    options = ReshardOptions(world_size=3)
    reshard(src, str(dst), options)
    assert_resharded(str(dst), full, options)
    reshard(src, str(dst), ReshardOptions(world_size=2), overwrite=True)  # replacing our own checkpoint
    assert_resharded(str(dst), full, ReshardOptions(world_size=2))
    assert (dst / "data" / "labels.csv").read_text() == "id,label\n1,cat\n"
    assert (dst / "data" / "notes" / "r00000-f000.bin").read_bytes() == b"not raydcp's"
    assert (outside / "keep.bin").read_bytes() == b"behind a symlink"
    md = raydcp.read_metadata(str(dst))
    ours = {str(p.relative_to(dst)) for p in (dst / "data").rglob("*.bin") if p.is_file() and "notes" not in p.parts
            and "linked" not in p.parts}
    assert ours == set(md.files)  # the first reshard's files went with the metadata that named them
