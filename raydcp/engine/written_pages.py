"""Which pages of this process's memory were written since a given moment, as the kernel saw it.

A delta save must hash every byte it could reuse, unless it *knows* that nobody wrote them since
they were hashed. The kernel knows: memory registered with userfaultfd for write-protection in
asynchronous mode (``UFFD_FEATURE_WP_ASYNC``, Linux 6.7) is write-protected page by page, the
first write to a page after that lifts the protection in the kernel itself (no handler thread, no
signal), and the ``PAGEMAP_SCAN`` ioctl of ``/proc/self/pagemap`` reports the pages written since
and protects them again, atomically. Every write by this process's CPU is seen, whatever its
route: ``.data``, a numpy view, ``copy_`` under ``no_grad``, C extensions, a ``read()`` into the
buffer, ``MADV_DONTNEED`` (a zapped page counts as written), a mapping replaced (the scan fails:
the region is forgotten).

What it cannot see is a write that does not go through this process's page tables: another process
writing shared memory, or a device writing page-locked memory by DMA. So only private anonymous
memory is tracked (``/proc/self/maps`` says so before a range is registered: no file's pages, no
shared mapping, which a forked child could write), and only pageable tensors (:func:`trackable`:
CPU tensors that are neither shared nor pinned); anything else is hashed.

:class:`WrittenPages` keeps, for every page it tracks, the number of the last scan that found it
written (scans are numbered, one per delta save that asks). A digest taken after scan ``e`` of
bytes whose pages all had their last write at or before ``e`` still describes them after any later
scan that finds them unwritten. Registration costs one fault per page on its first write after each
scan (a few microseconds); pages never written cost nothing. ``RAYDCP_WRITE_TRACKING=0`` turns it
off (every piece is then hashed); where the kernel lacks the features it is off by itself.
"""
from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import platform
import threading
from dataclasses import dataclass

import numpy as np

__all__ = ["WrittenPages", "tracker", "trackable"]

_log = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
_SYSCALL = {"x86_64": 323, "aarch64": 282}  # userfaultfd(2)
_USER_MODE_ONLY = 1
_UFFD_API = 0xAA
_FEATURE_WP_UNPOPULATED, _FEATURE_WP_ASYNC = 1 << 13, 1 << 15
_REGISTER_MODE_WP, _WRITEPROTECT_MODE_WP = 1 << 1, 1 << 0
_PM_SCAN_WP_MATCHING, _PM_SCAN_CHECK_WPASYNC = 1 << 0, 1 << 1
_PAGE_IS_WRITTEN = 1 << 1


def _pages(address: int, nbytes: int) -> tuple[int, int]:
    """The page-aligned range holding ``[address, address + nbytes)``."""
    return address // _PAGE * _PAGE, -(-(address + max(nbytes, 1)) // _PAGE) * _PAGE


def _iowr(kind: int, nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (kind << 8) | nr


class _Api(ctypes.Structure):
    _fields_ = [("api", ctypes.c_uint64), ("features", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class _Range(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Register(ctypes.Structure):
    _fields_ = [("range", _Range), ("mode", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class _WriteProtect(ctypes.Structure):
    _fields_ = [("range", _Range), ("mode", ctypes.c_uint64)]


class _ScanArg(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages", "category_inverted",
        "category_mask", "category_anyof_mask", "return_mask")]


class _PageRegion(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


_UFFDIO_API = _iowr(_UFFD_API, 0x3F, ctypes.sizeof(_Api))
_UFFDIO_REGISTER = _iowr(_UFFD_API, 0x00, ctypes.sizeof(_Register))
_UFFDIO_UNREGISTER = (2 << 30) | (ctypes.sizeof(_Range) << 16) | (_UFFD_API << 8) | 0x01  # _IOR
_UFFDIO_WRITEPROTECT = _iowr(_UFFD_API, 0x06, ctypes.sizeof(_WriteProtect))
_PAGEMAP_SCAN = _iowr(ord("f"), 16, ctypes.sizeof(_ScanArg))


@dataclass
class _Region:
    start: int          # page-aligned address
    end: int
    last: np.ndarray    # per page: the scan that last found it written


class WrittenPages:
    """The kernel's record of which tracked pages were written, numbered by scan (see the module)."""

    def __init__(self, uffd: int, pagemap: int, libc: ctypes.CDLL):
        self._uffd, self._pagemap, self._libc = uffd, pagemap, libc
        self._lock = threading.Lock()
        self._regions: list[_Region] = []  # disjoint, by start
        self._starts: list[int] = []
        self.epoch = 0
        self._maps: list[tuple[int, int, bool]] | None = None  # this process's mappings, read after the last scan
        self._vec = (_PageRegion * 256)()

    @classmethod
    def open(cls) -> "WrittenPages | None":
        """Write tracking for this process, or None where the kernel or the platform lacks it."""
        nr = _SYSCALL.get(platform.machine())
        if nr is None or not os.path.exists("/proc/self/pagemap"):
            return None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.syscall.restype = ctypes.c_long
            libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
            libc.ioctl.restype = ctypes.c_int
        except (OSError, AttributeError):
            return None
        uffd = libc.syscall(nr, os.O_CLOEXEC | os.O_NONBLOCK | _USER_MODE_ONLY)
        if uffd < 0:
            _log.debug("userfaultfd not available (%s): delta saves hash every piece",
                       os.strerror(ctypes.get_errno()))
            return None
        api = _Api(_UFFD_API, _FEATURE_WP_ASYNC | _FEATURE_WP_UNPOPULATED, 0)
        if libc.ioctl(uffd, _UFFDIO_API, ctypes.byref(api)) < 0:
            _log.debug("userfaultfd without asynchronous write-protection (%s): delta saves hash every piece",
                       os.strerror(ctypes.get_errno()))
            os.close(uffd)
            return None
        try:
            pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            os.close(uffd)
            return None
        tracker = cls(uffd, pagemap, libc)
        if not tracker._works():
            tracker.close()
            return None
        return tracker

    def _works(self) -> bool:
        """Whether a write to a tracked page is reported by the next scan (a page of our own)."""
        probe = mmap.mmap(-1, 2 * _PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf = np.frombuffer(probe, np.uint8)
        buf[:] = 1
        start = buf.ctypes.data
        try:
            if not self.track(start, 2 * _PAGE):
                return False
            epoch = self.scan()
            buf[_PAGE] = 2
            later = self.scan()
            return self.unchanged_since(start, _PAGE, epoch) and not self.unchanged_since(start + _PAGE, 1, epoch) \
                and later > epoch
        finally:
            with self._lock:
                self._drop([r for r in self._regions if r.start == start])
            del buf
            probe.close()

    def close(self) -> None:
        for fd in (self._uffd, self._pagemap):
            try:
                os.close(fd)
            except OSError:
                pass
        self._regions, self._starts = [], []

    def scan(self) -> int:
        """A new scan: every tracked page written since the last one is marked with this scan's
        number (and protected again); a region whose mapping changed is forgotten. Returns the number."""
        with self._lock:
            self.epoch += 1
            self._maps = None
            gone = [r for r in self._regions if not self._scan_region(r)]
            self._drop(gone)
            return self.epoch

    def _scan_region(self, region: _Region) -> bool:
        start = region.start
        while start < region.end:
            arg = _ScanArg(ctypes.sizeof(_ScanArg), _PM_SCAN_WP_MATCHING | _PM_SCAN_CHECK_WPASYNC, start, region.end,
                           0, ctypes.addressof(self._vec), len(self._vec), 0, 0, _PAGE_IS_WRITTEN, 0, _PAGE_IS_WRITTEN)
            n = self._libc.ioctl(self._pagemap, _PAGEMAP_SCAN, ctypes.byref(arg))
            if n < 0:
                return False  # no longer registered: unmapped, replaced, or never ours
            for k in range(n):
                v = self._vec[k]
                region.last[(v.start - region.start) // _PAGE:(v.end - region.start) // _PAGE] = self.epoch
            if arg.walk_end <= start:
                return False
            start = arg.walk_end
        return True

    def _drop(self, regions: list[_Region]) -> None:
        for r in regions:
            k = self._regions.index(r)
            del self._regions[k], self._starts[k]

    def track(self, address: int, nbytes: int) -> bool:
        """Track the pages of ``[address, address + nbytes)`` from now on (those not tracked yet are
        registered and write-protected, their pages marked as written at the current scan). False
        when some of them are not private anonymous memory, or the kernel refuses them. Call it
        after a :meth:`scan`, for memory that stays mapped (a tensor being saved): the scan is what
        forgets the regions of mappings that were replaced."""
        lo, hi = _pages(address, nbytes)
        with self._lock:
            todo = self._uncovered(lo, hi)
            if todo:
                if self._maps is None:  # read once per scan: a save asks for many pieces
                    self._maps = _mappings()
                if not _private_anonymous(self._maps, todo):
                    return False
            for s, e in todo:
                reg = _Register(_Range(s, e - s), _REGISTER_MODE_WP, 0)
                if self._libc.ioctl(self._uffd, _UFFDIO_REGISTER, ctypes.byref(reg)) < 0:
                    return False
                wp = _WriteProtect(_Range(s, e - s), _WRITEPROTECT_MODE_WP)
                if self._libc.ioctl(self._uffd, _UFFDIO_WRITEPROTECT, ctypes.byref(wp)) < 0:
                    return False
                k = bisect.bisect(self._starts, s)
                self._regions.insert(k, _Region(s, e, np.full((e - s) // _PAGE, self.epoch, np.int32)))
                self._starts.insert(k, s)
            return True

    def untrack(self, address: int, nbytes: int) -> None:
        """Stop tracking the regions that lie within ``[address, address + nbytes)`` (their pages
        no longer fault on a write; a region shared with memory around it stays)."""
        lo, hi = _pages(address, nbytes)
        with self._lock:
            inside = [r for r in self._overlapping(lo, hi) if r.start >= lo and r.end <= hi]
            for r in inside:
                rng = _Range(r.start, r.end - r.start)
                self._libc.ioctl(self._uffd, _UFFDIO_UNREGISTER, ctypes.byref(rng))  # gone already: nothing to do
            self._drop(inside)

    def _overlapping(self, lo: int, hi: int) -> list[_Region]:
        """The tracked regions overlapping ``[lo, hi)``, in address order."""
        k = max(0, bisect.bisect(self._starts, lo) - 1)
        out = []
        for r in self._regions[k:]:
            if r.start >= hi:
                break
            if r.end > lo:
                out.append(r)
        return out

    def _uncovered(self, lo: int, hi: int) -> list[tuple[int, int]]:
        out, pos = [], lo
        for r in self._overlapping(lo, hi):
            if r.start > pos:
                out.append((pos, r.start))
            pos = max(pos, r.end)
        if pos < hi:
            out.append((pos, hi))
        return out

    def tracks(self, address: int, nbytes: int) -> bool:
        """Whether every page of ``[address, address + nbytes)`` is tracked."""
        lo, hi = _pages(address, nbytes)
        with self._lock:
            return not self._uncovered(lo, hi)

    def unchanged_since(self, address: int, nbytes: int, epoch: int) -> bool:
        """Whether every page of ``[address, address + nbytes)`` is tracked and was last written at
        or before scan ``epoch`` (as of the latest scan)."""
        lo, hi = _pages(address, nbytes)
        with self._lock:
            if self._uncovered(lo, hi):
                return False
            for r in self._overlapping(lo, hi):
                a, b = (max(lo, r.start) - r.start) // _PAGE, (min(hi, r.end) - r.start) // _PAGE
                if r.last[a:b].max(initial=0) > epoch:
                    return False
            return True


def _mappings() -> list[tuple[int, int, bool]]:
    """This process's mappings in address order (``/proc/self/maps``): start, end, and whether it
    is private anonymous memory (no file's pages, nothing another process may map and write)."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                out.append((lo, hi, fields[1][3] == "p" and fields[4] == "0"))
    except (OSError, ValueError, IndexError):
        return []
    return out


def _private_anonymous(maps: list[tuple[int, int, bool]], ranges: list[tuple[int, int]]) -> bool:
    """Whether every range lies in private anonymous mappings of ``maps``."""
    for s, e in ranges:
        pos = s
        k = max(0, bisect.bisect(maps, (s, float("inf"), True)) - 1)
        for lo, hi, ok in maps[k:]:
            if hi <= pos:
                continue
            if lo > pos or not ok:
                return False
            pos = hi
            if pos >= e:
                break
        if pos < e:
            return False
    return True


_tracker: WrittenPages | None = None
_opened = False
_open_lock = threading.Lock()


def tracker() -> WrittenPages | None:
    """This process's write tracking (opened on first use), or None: off, or not possible here."""
    global _tracker, _opened
    if os.environ.get("RAYDCP_WRITE_TRACKING", "1") == "0":
        return None
    with _open_lock:
        if not _opened:
            _opened = True
            _tracker = WrittenPages.open()
        return _tracker


def _forget_in_child() -> None:
    global _tracker, _opened
    _tracker, _opened = None, False  # a forked child's memory is not registered; it opens its own


os.register_at_fork(after_in_child=_forget_in_child)


def trackable(tensor) -> bool:
    """Whether ``tensor``'s bytes can be tracked: contiguous, in this process's private pageable
    host memory (not shared with other processes, not page-locked for a device's DMA)."""
    import torch

    if not tensor.is_cpu or not tensor.is_contiguous() or tensor.untyped_storage().is_shared():
        return False
    return not (torch.cuda.is_initialized() and tensor.is_pinned())
