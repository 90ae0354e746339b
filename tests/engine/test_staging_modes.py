"""Where async_save stages: the private arena read with process_vm_readv, the shared-memory
fallback, the probe that picks between them, and bit-exact round trips through both."""
from __future__ import annotations

import ctypes
import logging
import os

import pytest
import torch

import raydcp
from raydcp import CheckpointError
from raydcp.engine import background as async_mod
from raydcp.engine import persist, persist_worker, procmem, staging

needs_reads = pytest.mark.skipif(not procmem.SUPPORTED or procmem.probe() is not None,
                                 reason="no process_vm_readv from a child here")


@pytest.fixture(autouse=True)
def finish_saves():
    yield
    async_mod._last is None or async_mod._last.wait()


@pytest.fixture
def failing_probe(monkeypatch):
    """The probe says no (as under seccomp or ptrace_scope=3), asked afresh."""
    monkeypatch.setattr(staging, "_probed", [])
    monkeypatch.setattr(procmem, "probe", lambda *a, **k: "simulated: Operation not permitted")
    monkeypatch.delenv("RAYDCP_STAGING", raising=False)


def mixed_state() -> dict:
    g = torch.Generator().manual_seed(3)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45, 3.0])
    big = torch.randn(3 << 20, generator=g)  # 12 MiB: several 4 MiB chunks, the last one short
    return {
        "f32": torch.cat([special, torch.randn(1000, generator=g)]),
        "bf16": torch.randn(300, 70, generator=g).to(torch.bfloat16),
        "f16.t": torch.randn(64, 48, generator=g).half().t(),  # transposed: not contiguous
        "f64.strided": torch.randn(40, 30, generator=g, dtype=torch.float64)[::3, 1::2],
        "i8": torch.randint(-128, 128, (5000,), generator=g, dtype=torch.int8),
        "i8.offset": torch.randint(-128, 128, (4099,), generator=g, dtype=torch.int8)[3:],  # odd start, 4096 B
        "f32.offset": torch.randn(1025, generator=g)[1:],  # starts 4 bytes into its storage
        "i64": torch.randint(-2**62, 2**62, (777,), generator=g, dtype=torch.int64),
        "bool": torch.rand(999, generator=g) > 0.5,
        "c64": torch.randn(100, generator=g, dtype=torch.complex64),
        "mid": torch.randn(100_000, generator=g),  # 400 KB: above the packing size, one block
        "big": big,
        "big.cols": big.view(1024, 3072)[:, :2000],  # 8 MB, rows not contiguous
        "empty": torch.zeros(0, 5),
        "step": 11,
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def load_like(sd: dict, path) -> dict:
    out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in sd.items()}
    raydcp.load(out, path)
    return out


@pytest.mark.parametrize("mode", ["shm", pytest.param("private", marks=needs_reads)])
def test_bit_exact_round_trip_of_many_dtypes_and_layouts(tmp_path, monkeypatch, mode):
    monkeypatch.setenv("RAYDCP_STAGING", mode)
    sd = mixed_state()
    want = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    fut = raydcp.async_save(sd, tmp_path / "ck")
    for v in sd.values():
        if isinstance(v, torch.Tensor) and v.numel():
            v[(0,) * v.dim()] = 1 if v.dtype == torch.bool else 7  # after the call: must not leak in
    fut.result(timeout=120)
    assert persist.local_persister().arena.shared == (mode == "shm")
    got = load_like(want, tmp_path / "ck")
    assert got["step"] == 11
    bad = [k for k, v in want.items() if isinstance(v, torch.Tensor) and not same_bits(got[k], v)]
    assert not bad


@needs_reads
def test_private_arena_is_reused_for_same_size_saves(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYDCP_STAGING", "private")
    sd = {"w": torch.randn(1 << 20), "b": torch.randn(33)}
    raydcp.async_save(sd, tmp_path / "a").result(timeout=120)
    arena = persist.local_persister().arena
    allocations, address = arena.allocations, arena.address
    for i in range(3):
        sd["w"].add_(1)
        raydcp.async_save(sd, tmp_path / "a").result(timeout=120)
    assert persist.local_persister().arena is arena and arena.allocations == allocations and arena.address == address
    assert same_bits(load_like(sd, tmp_path / "a")["w"], sd["w"])


def test_a_failing_probe_falls_back_to_shared_memory_and_says_why_once(tmp_path, failing_probe, caplog):
    with caplog.at_level(logging.INFO, logger="raydcp.engine.staging"):
        for i in range(2):
            raydcp.async_save({"w": torch.full((100,), float(i))}, tmp_path / "ck").result(timeout=120)
    assert persist.local_persister().arena.shared
    said = [r.getMessage() for r in caplog.records if "shared memory" in r.getMessage()]
    assert len(said) == 1 and "simulated: Operation not permitted" in said[0]
    got = {"w": torch.zeros(100)}
    raydcp.load(got, tmp_path / "ck")
    assert torch.equal(got["w"], torch.full((100,), 1.0))


def test_asking_for_private_staging_where_it_cannot_work_fails_at_result(tmp_path, failing_probe, monkeypatch):
    monkeypatch.setenv("RAYDCP_STAGING", "private")
    fut = raydcp.async_save({"w": torch.ones(4)}, tmp_path / "ck")
    with pytest.raises(CheckpointError, match="RAYDCP_STAGING=private.*simulated.*set it to shm"):
        fut.result(timeout=60)
    monkeypatch.setenv("RAYDCP_STAGING", "mmap")
    with pytest.raises(CheckpointError, match="'mmap' is not one of shm, private"):
        raydcp.async_save({"w": torch.ones(4)}, tmp_path / "ck").result(timeout=60)


@needs_reads
def test_a_failed_read_is_an_error_at_result_naming_key_and_file_and_commits_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYDCP_STAGING", "private")
    raydcp.async_save({"w": torch.ones(1000), "step": 1}, tmp_path / "ck").result(timeout=120)
    # the helper is told the arena starts at an address that is not mapped: every read fails
    monkeypatch.setattr(type(persist.local_persister().arena), "address", property(lambda self: 4096))
    fut = raydcp.async_save({"w": torch.full((1000,), 2.0), "step": 2}, tmp_path / "ck")
    with pytest.raises(CheckpointError, match=r"staged bytes of w for data/\S+ from the training process .*"
                                              r"nothing was committed.*RAYDCP_STAGING=shm"):
        fut.result(timeout=120)
    monkeypatch.undo()
    got = {"w": torch.zeros(1000), "step": 0}
    raydcp.load(got, tmp_path / "ck")
    assert got["step"] == 1 and torch.equal(got["w"], torch.ones(1000))


def test_the_helper_reads_only_inside_the_staged_ranges():
    src = ctypes.create_string_buffer(bytes(range(256)), 256)
    job = {"source": {"pid": os.getpid(), "address": ctypes.addressof(src), "size": 256},
           "layout": {0: (0, 100), 1: (128, 64)},
           "local_plan": type("Plan", (), {"items": [type("It", (), {"key": k})() for k in ("a", "b")]})()}
    read = persist_worker._memory_reader(job, job["local_plan"].items)
    dst = ctypes.create_string_buffer(64)
    read("f", 1, 0, 64, ctypes.addressof(dst))
    assert dst.raw == bytes(range(128, 192))
    read("f", 0, 90, 10, ctypes.addressof(dst))
    assert dst.raw[:10] == bytes(range(90, 100))
    for item, start, n in [(0, 90, 11), (1, 0, 65), (0, -1, 2)]:
        with pytest.raises(CheckpointError, match="was refused"):
            read("f", item, start, n, ctypes.addressof(dst))
    job["layout"][1] = (200, 64)  # a staged range past the arena's end
    with pytest.raises(CheckpointError, match="was refused"):
        read("f", 1, 0, 1, ctypes.addressof(dst))


@pytest.mark.skipif(not procmem.SUPPORTED, reason="Linux only")
def test_read_into_copies_every_byte_and_reports_errors():
    src = ctypes.create_string_buffer(os.urandom(1 << 16), 1 << 16)
    dst = ctypes.create_string_buffer(1 << 16)
    procmem.read_into(os.getpid(), ctypes.addressof(src), 1 << 16, ctypes.addressof(dst))
    assert dst.raw == src.raw
    with pytest.raises(OSError):
        procmem.read_into(os.getpid(), 4096, 16, ctypes.addressof(dst))
