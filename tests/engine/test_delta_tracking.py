"""The kernel's write tracking (raydcp.engine.written_pages) and the delta saves that use it: a piece
nobody wrote since this process hashed it is not hashed again, and any write, whatever its route,
makes it hashed (and written) again."""
from __future__ import annotations

import ctypes
import mmap
import os
import threading

import pytest
import torch

import raydcp
from raydcp import SaveOptions
from raydcp.engine import delta as delta_mod
from raydcp.engine import written_pages

MIB = 1 << 20
tracking = written_pages.tracker()
needs_tracking = pytest.mark.skipif(tracking is None, reason="the kernel has no asynchronous userfaultfd "
                                                             "write-protection (Linux >= 6.7) here")


def _madvise_dontneed(address: int, nbytes: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.madvise(address, nbytes, 4) == 0  # MADV_DONTNEED: the page reads as zeros from now on


def _write(t: torch.Tensor, how: str, tmp_path) -> None:
    """Change bytes of ``t`` in place by route ``how``."""
    if how == "index":
        t[1000] += 1
    elif how == "data":
        t.data[1000] = t.data[1000] + 1
    elif how == "numpy":
        t.numpy()[1000] += 1
    elif how == "copy_":
        with torch.no_grad():
            t[1000:1001].copy_(t[1000:1001] + 1)
    elif how == "ctypes":
        ctypes.memmove(t.data_ptr() + 4000, b"\x01\x02\x03\x04", 4)
    elif how == "readv":  # the kernel writes the buffer, not this process's code
        src = tmp_path / "bytes"
        src.write_bytes(b"\x07" * 8192)
        fd = os.open(src, os.O_RDONLY)
        try:
            os.readv(fd, [memoryview(t.view(torch.uint8).numpy())[mmap.PAGESIZE * 3:mmap.PAGESIZE * 5]])
        finally:
            os.close(fd)
    elif how == "madvise":
        page = (t.data_ptr() // mmap.PAGESIZE + 2) * mmap.PAGESIZE
        _madvise_dontneed(page, mmap.PAGESIZE)
    else:
        raise AssertionError(how)


@needs_tracking
def test_the_kernel_reports_written_pages_and_forgets_a_replaced_mapping():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page, n = mmap.PAGESIZE, 8 * mmap.PAGESIZE
    start = libc.mmap(None, n, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert start not in (None, ctypes.c_void_p(-1).value)
    ctypes.memset(start, 1, n)
    assert tracking.track(start, n)
    e1 = tracking.scan()
    assert tracking.unchanged_since(start, n, e1)
    ctypes.memset(start + 5 * page + 17, 9, 1)
    e2 = tracking.scan()
    assert not tracking.unchanged_since(start, n, e1)
    assert tracking.unchanged_since(start, 5 * page, e1)       # the pages before it: not written
    assert tracking.unchanged_since(start + 6 * page, 2 * page, e1)
    assert tracking.unchanged_since(start, n, e2)              # nothing since the scan that saw it
    _madvise_dontneed(start + page, page)
    tracking.scan()
    assert not tracking.unchanged_since(start + page, page, e2)
    assert not tracking.unchanged_since(start + n, page, e2)   # never tracked
    # the mapping replaced by another at the same address: forgotten, never "unchanged"
    assert libc.munmap(start, n) == 0
    again = libc.mmap(start, n, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10, -1, 0)
    try:
        assert again == start  # MAP_FIXED
        e3 = tracking.scan()
        assert not tracking.unchanged_since(start, page, e3)
    finally:
        libc.munmap(start, n)


def test_shared_and_small_tensors_are_not_tracked():
    shared = torch.zeros(MIB).share_memory_()
    assert not written_pages.trackable(shared)
    assert not written_pages.trackable(torch.zeros(64, 64).t())  # not contiguous
    assert written_pages.trackable(torch.zeros(MIB))


def test_tracking_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("RAYDCP_WRITE_TRACKING", "0")
    assert written_pages.tracker() is None


def _hashed_counter(monkeypatch) -> list[int]:
    """Counts the bytes delta saves hash (every block of a piece in memory goes through
    ``_hash_blocks``); what this process remembered of earlier saves is forgotten."""
    monkeypatch.setattr(delta_mod, "_KNOWN", {})
    monkeypatch.setattr(delta_mod, "_HOT", {})
    hashed = [0]
    real = delta_mod._hash_blocks
    lock = threading.Lock()

    def counting(view, first, last):
        with lock:
            hashed[0] += min(len(view), last * delta_mod.DIGEST_BLOCK) - first * delta_mod.DIGEST_BLOCK
        return real(view, first, last)

    monkeypatch.setattr(delta_mod, "_hash_blocks", counting)
    return hashed


def _own_bytes(path) -> int:
    return sum(n for f, n in raydcp.read_metadata(path).files.items() if not f.startswith("../"))


def _pages_of_its_own(nbytes: int, seed: int) -> torch.Tensor:
    """A float32 tensor on pages no other object shares (a heap allocation's first and last pages
    may hold other objects, whose writes make those pages, and so the piece, hashed again)."""
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(mem, dtype=torch.float32)
    t.copy_(torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(seed)))
    return t


@needs_tracking
@pytest.mark.parametrize("how", ["index", "data", "numpy", "copy_", "ctypes", "readv", "madvise"])
def test_an_unwritten_piece_is_not_hashed_and_any_write_is_seen(tmp_path, monkeypatch, how):
    hashed = _hashed_counter(monkeypatch)
    frozen, small = _pages_of_its_own(3 * MIB, 3), torch.randn(64)
    s = {"frozen": frozen, "small": small}
    raydcp.save(s, tmp_path / "step-1", options=SaveOptions(base="previous"))
    assert hashed[0] == frozen.nbytes + small.nbytes
    hashed[0] = 0
    small += 1
    raydcp.save(s, tmp_path / "step-2", options=SaveOptions(base="previous"))
    assert hashed[0] == small.nbytes  # the frozen bytes: known unchanged, not read
    assert _own_bytes(tmp_path / "step-2") == small.nbytes

    _write(frozen, how, tmp_path)
    expected = frozen.clone()
    raydcp.save(s, tmp_path / "step-3", options=SaveOptions(base="previous"))
    assert _own_bytes(tmp_path / "step-3") == frozen.nbytes  # written again (the small one: unchanged)
    out = {"frozen": torch.zeros_like(frozen), "small": torch.zeros_like(small)}
    raydcp.load(out, tmp_path / "step-3")
    assert torch.equal(out["frozen"], expected) and torch.equal(out["small"], small)


@needs_tracking
def test_only_the_written_blocks_of_a_piece_are_hashed_again(tmp_path, monkeypatch):
    hashed = _hashed_counter(monkeypatch)
    monkeypatch.setattr(delta_mod, "DIGEST_BLOCK", MIB)
    t = _pages_of_its_own(4 * MIB, 5)
    raydcp.save({"t": t}, tmp_path / "step-1", options=SaveOptions(base="previous"))
    assert hashed[0] == 4 * MIB
    hashed[0] = 0
    t[(2 * MIB + 100) // 4] += 1  # in the third block
    raydcp.save({"t": t}, tmp_path / "step-2", options=SaveOptions(base="previous"))
    assert hashed[0] == MIB
    assert _own_bytes(tmp_path / "step-2") == t.nbytes  # one piece, changed: written whole
    hashed[0] = 0
    raydcp.save({"t": t}, tmp_path / "step-3", options=SaveOptions(base="previous"))
    assert hashed[0] == 0 and _own_bytes(tmp_path / "step-3") == 0
    out = {"t": torch.zeros_like(t)}
    raydcp.load(out, tmp_path / "step-3")
    assert torch.equal(out["t"], t)


@needs_tracking
def test_memory_another_process_can_write_is_hashed_every_time(tmp_path, monkeypatch):
    """A shared mapping (which a forked child, e.g. a DataLoader worker, shares) is never tracked."""
    hashed = _hashed_counter(monkeypatch)
    mem = mmap.mmap(-1, 2 * MIB)  # MAP_SHARED | MAP_ANONYMOUS
    t = torch.frombuffer(mem, dtype=torch.float32)
    t.fill_(1.0)
    tracking.scan()  # forgets any region an earlier mapping at this address left
    assert not tracking.track(t.data_ptr(), t.nbytes)
    for step in (1, 2):
        raydcp.save({"t": t}, tmp_path / f"step-{step}", options=SaveOptions(base="previous"))
    assert hashed[0] == 2 * t.nbytes  # hashed by both saves
    assert _own_bytes(tmp_path / "step-2") == 0  # and found unchanged by its content


def test_every_file_decided_at_once_finds_the_bases_digests(tmp_path):
    """Many files of one rank decided in parallel threads all read the base's digests: each
    unchanged piece is referenced (none written again because a lookup ran before they were read)."""
    g = torch.Generator().manual_seed(4)
    s = {f"w{i}": torch.randn(64 * 1024, generator=g) for i in range(12)}
    opts = SaveOptions(base="previous", max_file_bytes=256 * 1024)
    raydcp.save(s, tmp_path / "step-1", options=opts)
    for step in range(2, 6):
        raydcp.save(s, tmp_path / f"step-{step}", options=opts)
        assert _own_bytes(tmp_path / f"step-{step}") == 0, f"step {step} wrote unchanged pieces"


@needs_tracking
def test_digests_known_to_another_tracker_are_not_trusted(tmp_path, monkeypatch):
    """A forked child opens its own tracking (its parent's is forgotten at fork): what the parent's
    scans knew says nothing of memory the child may have written before registering it."""
    hashed = _hashed_counter(monkeypatch)
    t = _pages_of_its_own(2 * MIB, 6)
    first = written_pages.WrittenPages.open()
    monkeypatch.setattr(written_pages, "tracker", lambda: first)
    raydcp.save({"t": t}, tmp_path / "step-1", options=SaveOptions(base="previous"))
    first.close()  # its registrations end with it, as a parent's do for a forked child
    t[12345] += 1  # before the next tracker registers the pages: only hashing can see it
    second = written_pages.WrittenPages.open()
    try:
        monkeypatch.setattr(written_pages, "tracker", lambda: second)
        hashed[0] = 0
        raydcp.save({"t": t}, tmp_path / "step-2", options=SaveOptions(base="previous"))
        assert hashed[0] == t.nbytes and _own_bytes(tmp_path / "step-2") == t.nbytes
        out = {"t": torch.zeros_like(t)}
        raydcp.load(out, tmp_path / "step-2")
        assert torch.equal(out["t"], t)
    finally:
        second.close()


@needs_tracking
def test_a_piece_rewritten_at_every_save_is_hashed_untracked_for_a_while(tmp_path, monkeypatch):
    """Tracking a tensor trained at every step would cost a fault per page per checkpoint and spare
    no hashing: rewritten whole since the last save, it is untracked for the next saves, then tried again."""
    hashed = _hashed_counter(monkeypatch)
    monkeypatch.setattr(delta_mod, "_HOT_SCANS", 2)
    t = _pages_of_its_own(2 * MIB, 7)
    tracked = []
    for step in range(1, 6):
        if step > 1:
            t.add_(1.0)
        raydcp.save({"t": t}, tmp_path / f"step-{step}", options=SaveOptions(base="previous"))
        tracked.append(tracking.tracks(t.data_ptr(), t.nbytes))
        out = {"t": torch.zeros_like(t)}
        raydcp.load(out, tmp_path / f"step-{step}")
        assert torch.equal(out["t"], t) and _own_bytes(tmp_path / f"step-{step}") == t.nbytes
    assert hashed[0] == 5 * t.nbytes
    # saves 1: tracked; 2: found rewritten, untracked; 3: still untracked; 4: tried again; 5: rewritten, untracked
    assert tracked == [True, False, False, True, False]


def test_digests_made_another_way_are_not_compared(tmp_path, monkeypatch):
    """A base whose digest file says its digests were made otherwise (an older layout: whole pieces
    hashed) is not compared with: its pieces are written, and the next delta references those."""
    s = {"w": torch.randn(300_000), "b": torch.randn(10)}
    monkeypatch.setattr(delta_mod, "DIGEST", "xxh3-128")
    raydcp.save(s, tmp_path / "step-1", options=SaveOptions(base="previous"))
    monkeypatch.undo()
    raydcp.save(s, tmp_path / "step-2", options=SaveOptions(base="previous"))
    assert _own_bytes(tmp_path / "step-2") == s["w"].nbytes + s["b"].nbytes
    raydcp.save(s, tmp_path / "step-3", options=SaveOptions(base="previous"))
    assert _own_bytes(tmp_path / "step-3") == 0
    assert set(raydcp.read_metadata(tmp_path / "step-3").references) == {"../step-2"}
