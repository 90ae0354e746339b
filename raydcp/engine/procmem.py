"""Reading another process's memory (Linux ``process_vm_readv``), for async_save's helper process.

async_save stages into private memory of the training process (a plain memcpy's
destination; shared memory may get worse page treatment, e.g. no transparent huge pages
where ``shmem_enabled`` is ``never``), and its helper process copies the staged bytes out
with ``process_vm_readv``, a chunk at a time. Who calls what:

1. The trainer calls :func:`probe` once: a tiny child process (no imports beyond the
   standard library) reads a known buffer of the trainer. ``None`` means reads work;
   otherwise the reason they do not (not Linux, the call is blocked by seccomp, ptrace
   restrictions...), and async_save stages in shared memory instead.
2. After starting the helper, the trainer calls :func:`allow_reader` with the helper's
   pid: with Yama's ``ptrace_scope=1`` a child may not read its parent's memory unless
   the parent names it (``PR_SET_PTRACER``). Without Yama this is a harmless no-op.
3. The helper calls :func:`read_into` for each chunk it writes.

Run as a script (``python -I -S procmem.py PID ADDR NBYTES``) this module is the probe's
child: it waits for a line on stdin, reads NBYTES at ADDR of PID and prints them in hex.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

__all__ = ["SUPPORTED", "read_into", "allow_reader", "probe"]

PR_SET_PTRACER = 0x59616D61

_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _readv = _libc.process_vm_readv
    except (OSError, AttributeError):  # a libc without the wrapper (glibc < 2.15)
        _libc = None

SUPPORTED = _libc is not None


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


if SUPPORTED:
    _readv.restype = ctypes.c_ssize_t
    _readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                       ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]


def read_into(pid: int, remote_addr: int, nbytes: int, dst_addr: int) -> None:
    """Copy ``nbytes`` at ``remote_addr`` in process ``pid`` to ``dst_addr`` here.

    Raises OSError (errno of the call: EPERM, ESRCH, EFAULT, ENOSYS...) unless every byte
    was copied; the kernel may copy less than asked, so this loops until done.
    """
    if not SUPPORTED:
        raise OSError(38, "process_vm_readv is not available on this platform")
    local, remote = _IOVec(), _IOVec()
    done = 0
    while done < nbytes:
        local.iov_base, local.iov_len = dst_addr + done, nbytes - done
        remote.iov_base, remote.iov_len = remote_addr + done, nbytes - done
        got = _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        if got == 0:  # the remote range ends early: never spin
            raise OSError(14, f"{os.strerror(14)} (read stopped after {done} of {nbytes} bytes)")
        done += got


def allow_reader(pid: int) -> bool:
    """Let process ``pid`` read this process's memory where Yama restricts it to ancestors.

    Yama keeps one such pid per process, so this replaces an earlier one. Returns whether
    the call succeeded (it fails, harmlessly, where Yama is not in the kernel).
    """
    if not SUPPORTED:
        return False
    return _libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0) == 0


def probe(timeout: float = 30.0) -> str | None:
    """Whether a child process can read this process's memory: None if so, else why not."""
    if not SUPPORTED:
        return f"process_vm_readv is not available on {sys.platform}"
    token = os.urandom(32)
    buf = ctypes.create_string_buffer(token, len(token))
    try:
        child = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()),
             str(ctypes.addressof(buf)), str(len(token))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:
        return f"the probe process did not start ({exc})"
    allow_reader(child.pid)
    try:
        out, err = child.communicate(b"go\n", timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return f"the probe process did not answer within {timeout:.0f} s"
    answer = out.decode(errors="replace").strip()
    if child.returncode == 0 and answer == token.hex():
        return None
    if answer.startswith("error "):
        return f"process_vm_readv from a child process failed: {answer[6:]}"
    detail = (answer or err.decode(errors="replace").strip())[-300:]
    return f"the probe process read wrong bytes or failed (exit status {child.returncode}: {detail})"


def _child(argv: list[str]) -> int:
    pid, addr, nbytes = (int(a) for a in argv)
    sys.stdin.readline()  # the parent names this process as its reader before answering
    dst = ctypes.create_string_buffer(nbytes)
    try:
        read_into(pid, addr, nbytes, ctypes.addressof(dst))
    except OSError as exc:
        print(f"error {exc}")
        return 0
    print(dst.raw.hex())
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
