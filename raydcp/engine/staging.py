"""Staging: copying a rank's pieces into a reusable host arena -- the only part of an async
save the training loop waits for.

The arena is kept between saves and grows only when a save needs more, so a steady
training run allocates staging memory once. On CUDA it is pinned and filled with
non-blocking copies on a side stream (synchronized before staging returns, so the
snapshot is complete); on the host the copies are plain memcpys.

Where the arena lives, for ``async_save`` without a group (:func:`staging_mode`,
``AsyncOptions.staging``, ``RAYDCP_STAGING``):

- ``private`` (the default where it works): ordinary private memory of the training
  process, the kind a plain tensor copy writes to, so staging costs what a memcpy costs.
  The helper process copies the staged bytes out a chunk at a time with
  ``process_vm_readv`` (:mod:`raydcp.engine.procmem`), at its lower CPU priority.
  A probe checks once per process that a child may read this process's memory; where it
  may not (not Linux, seccomp, ptrace restrictions) async_save stages in shared memory
  and logs why, once. ``RAYDCP_STAGING=private`` makes such a failure an error instead.
- ``shm``: POSIX shared memory (``shared=True``), which the helper maps and writes from
  without another copy, but the kernel may treat shared memory less well than private
  memory (no transparent huge pages where ``/sys/kernel/mm/transparent_hugepage/
  shmem_enabled`` is ``never``), so staging into it can be slower than a memcpy.

Either way the arena is never written while the helper reads it: async saves are
ordered (a save waits for the previous one to finish before it stages).
"""
from __future__ import annotations

import logging
import mmap
import os
import secrets
from multiprocessing import shared_memory

import torch

from ..errors import CheckpointError
from ..options import STAGING_ENV, STAGING_MODES
from ..planner.save import ALIGN
from . import procmem
from .save import StagedState

_probed: list[str | None] = []  # the probe's answer, once per process
log = logging.getLogger(__name__)


def staging_mode(asked: str | None = None) -> str:
    """``"private"`` or ``"shm"``: where async_save (without a group) stages, as
    ``AsyncOptions.staging`` asks (None: private where the probe passes, else shm)."""
    if asked is not None and asked not in STAGING_MODES:
        raise CheckpointError(f"{STAGING_ENV}={asked!r} is not one of {', '.join(STAGING_MODES)} (or unset)")
    if asked == "shm":
        return "shm"
    if not _probed:
        _probed.append(procmem.probe())
        if _probed[0] is not None and not asked:
            log.info("async_save stages in shared memory: the helper process cannot read this process's "
                     "memory (%s)", _probed[0])
    if _probed[0] is None:
        return "private"
    if asked == "private":
        raise CheckpointError(f"{STAGING_ENV}=private, but the helper process cannot read this process's memory "
                              f"({_probed[0]}); unset {STAGING_ENV} or set it to shm")
    return "shm"


def _anonymous_huge(size: int) -> mmap.mmap:
    """Private anonymous memory that the kernel may back with transparent huge pages (where
    ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``): fewer TLB
    misses and page faults for the staging copies."""
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without THP: ordinary pages
            pass
    return mapping


def _host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the bytes of ``src`` into ``dst`` (flat uint8 tensors of the same length), as
    8-byte words where lengths and offsets allow: torch copies uint8 elements about 15% slower
    than wider ones, and staging is the part of an async save that training waits for."""
    n = dst.numel()
    for dtype, width in ((torch.int64, 8), (torch.int32, 4)):
        if n % width == 0 and dst.storage_offset() % width == 0 and src.storage_offset() % width == 0:
            try:
                dst.view(dtype).copy_(src.view(dtype))
                return
            except RuntimeError:  # a view the dtype cannot take: copy bytes
                break
    dst.copy_(src)


def _register_pinned(buf: torch.Tensor) -> bool:
    """Page-lock a shared-memory arena so device-to-host copies can run asynchronously."""
    return torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0) == 0

__all__ = ["StagingArena", "staging_mode", "staging_bytes", "STAGING_ENV"]


def staging_bytes(state_dict: dict) -> tuple[int, bool]:
    """``(bytes, on a device)``: the arena a rank staging the tensors of ``state_dict`` needs at
    most (each piece at an ``ALIGN`` boundary, with a margin for tensors a save splits into
    several pieces), and whether some of them are on a device (the arena is then pinned)."""
    from ..state import flatten_state

    leaves = flatten_state(state_dict).tensors.values()
    total = sum(-(-leaf.tensor.nbytes // ALIGN) * ALIGN for leaf in leaves)
    return total + total // 64, any(leaf.tensor.device.type != "cpu" for leaf in leaves)


SHM_DIR = "/dev/shm"
ARENA_PREFIX = "raydcp-stage-"  # + the making process's pid + "-" + a token: a shared arena's name


def sweep_arenas(directory: str = SHM_DIR) -> int:
    """Remove the shared arenas whose making process is gone (killed before it removed the name;
    its readers, if any, keep their mappings); returns how many. Run before each new one."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(ARENA_PREFIX):
            continue
        pid = name[len(ARENA_PREFIX):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or another user's)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed += 1
        except OSError:
            pass
    return removed


class StagingArena:
    def __init__(self, *, shared: bool = False, huge_pages: bool = False):
        self.shared = shared
        self.huge_pages = huge_pages  # private host arenas: ask for transparent huge pages
        self.buffer: torch.Tensor | None = None
        self.shm: shared_memory.SharedMemory | None = None
        self.mapping: mmap.mmap | None = None
        self.allocations = 0  # how many times the arena was (re)allocated
        self._named = False  # a shared arena's name is still in /dev/shm (see unlink)

    @property
    def shm_name(self) -> str | None:
        return self.shm.name if self.shm is not None else None

    @property
    def address(self) -> int:
        """Where the arena starts in this process's memory (for a reader in another process)."""
        return self.buffer.data_ptr()

    def _reserve(self, nbytes: int, pin: bool, limit: int | None) -> torch.Tensor:
        fits = self.buffer is not None and nbytes <= self.buffer.numel() <= (limit or self.buffer.numel())
        if fits and (self.pinned or not pin):
            return self.buffer
        self.close()
        size = max(nbytes, ALIGN)
        if self.shared:
            sweep_arenas()
            self.shm = shared_memory.SharedMemory(name=f"{ARENA_PREFIX}{os.getpid()}-{secrets.token_hex(4)}",
                                                  create=True, size=size)
            self._named = True
            self.buffer = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=size)
            self.pinned = pin and _register_pinned(self.buffer)
        elif self.huge_pages and not pin:
            self.mapping = _anonymous_huge(size)
            self.buffer = torch.frombuffer(self.mapping, dtype=torch.uint8, count=size)
            self.pinned = False
        else:
            self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
            self.pinned = pin
        self.allocations += 1
        return self.buffer

    pinned = False

    def reserve(self, nbytes: int, pin: bool = False) -> torch.Tensor:
        """Allocate the arena for ``nbytes`` ahead of the first save that needs them (kept unless
        a save needs more), and write each of its pages once, so that the save's copies find
        them mapped (a first touch of fresh memory costs a page fault per page)."""
        buf = self._reserve(nbytes, pin and torch.cuda.is_available(), None)
        buf.fill_(0)
        return buf

    def close(self) -> None:
        """Free the arena (a later save allocates a new one)."""
        if self.buffer is not None and self.shared and self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
        self.buffer = None
        if self.shm is not None:
            self.unlink()
            try:
                self.shm.close()
            except BufferError:  # views of the old arena are still alive; the mapping goes with them
                pass
            self.shm = None
        if self.mapping is not None:
            try:
                self.mapping.close()
            except BufferError:  # as above
                pass
            self.mapping = None

    def unlink(self) -> None:
        """Remove a shared arena's name from ``/dev/shm`` (once every reader has attached it): the
        memory stays mapped in this process and in theirs, and goes when the last of them unmaps
        it or exits, even killed, so nothing is left behind. Reused by later saves as before."""
        if self.shm is not None and self._named:
            self._named = False
            self.shm.unlink()

    def stage(self, staged: StagedState, indices: list[int], limit: int | None = None) -> dict[int, tuple[int, int]]:
        """Copy pieces ``indices`` into the arena and point ``staged.data`` at the copies.

        ``limit`` shrinks an arena left larger by earlier saves. Returns item
        index -> (offset, nbytes) in the arena.
        """
        layout: dict[int, tuple[int, int]] = {}
        pos = 0
        for i in indices:
            n = staged.data[i].numel()
            layout[i] = (pos, n)
            pos += -(-n // ALIGN) * ALIGN
        on_device = [i for i in indices if staged.data[i].device.type != "cpu"]
        pin = bool(on_device) and torch.cuda.is_available()
        arena = self._reserve(pos, pin, limit)
        stream = None
        if on_device:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
        for i in indices:
            off, n = layout[i]
            dst = arena.narrow(0, off, n)
            src = staged.data[i]
            if src.device.type != "cpu":
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
            else:
                _host_copy(dst, src)
            staged.data[i] = dst
        if stream is not None:
            stream.synchronize()
        return layout
