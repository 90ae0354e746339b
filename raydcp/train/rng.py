"""Random number generator states as checkpointable tables, one row per rank.

raydcp stores tensors and plain values only (no pickle), and a plain value under
one key must be equal on every rank, so each generator's per-rank state becomes
one row of a global 2-D tensor (row ``r`` written by rank ``r`` as a
:class:`raydcp.Shard`):

==================  ===============  =====================================================
key                 dtype, shape     row ``r`` holds
==================  ===============  =====================================================
``torch``           uint8 [W, n]     ``torch.get_rng_state()`` (the CPU generator)
``cuda``            uint8 [W, n]     ``torch.cuda.get_rng_state()`` (current device; only
                                     saved where CUDA is initialized)
``python``          int64 [W, 625]   the Mersenne Twister words of ``random.getstate()``
``python_gauss``    float64 [W, 2]   (has ``gauss_next``, ``gauss_next``)
``numpy``           int64 [W, 624]   the MT19937 key of ``numpy.random.get_state()``
``numpy_extra``     float64 [W, 3]   (pos, has_gauss, cached_gaussian)
``python_version``  plain int        the version field of ``random.getstate()``
==================  ===============  =====================================================

Restoring (see :class:`raydcp.train.TrainState`): when the world size is the one
the tables were saved with, rank ``r`` reads row ``r`` back and every stream
continues exactly where it stopped. When it differs, a rank's old row has no
meaning (there is no "rank 3" of a 2-rank run), so each rank asks for an empty
piece of every table (nothing is read) and re-seeds all of its generators with
:func:`derive_seed` ``(seed, step, rank)``.
"""
from __future__ import annotations

import hashlib
import random
from typing import Any

import torch

from ..codec import dtype_from_name
from ..errors import CheckpointError
from ..state import Shard

try:  # numpy is optional: its table is saved only where it is installed
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with the test and train extras
    np = None

__all__ = ["derive_seed", "reseed", "capture", "empty_request", "row_request", "apply", "TABLES"]

TABLES = ("torch", "cuda", "python", "python_gauss", "numpy", "numpy_extra")


def derive_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit seed for ``rank`` at ``step`` of a run seeded with ``seed`` (stable across versions)."""
    digest = hashlib.sha256(f"raydcp-rng:{int(seed)}:{int(step)}:{int(rank)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def reseed(seed: int, step: int, rank: int) -> int:
    """Seed torch (CPU and every CUDA device), Python's ``random`` and NumPy's global generator."""
    s = derive_seed(seed, step, rank)
    torch.manual_seed(s)  # also seeds every CUDA device
    random.seed(s)
    if np is not None:
        np.random.seed(s % (2**32))
    return s


def _cuda_active() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _rows(rank: int) -> dict[str, torch.Tensor]:
    """This process's generator states, each as one row (a [1, n] tensor)."""
    rows: dict[str, torch.Tensor] = {"torch": torch.get_rng_state().reshape(1, -1).clone()}
    if _cuda_active():
        rows["cuda"] = torch.cuda.get_rng_state().reshape(1, -1).clone()
    _version, words, gauss = random.getstate()
    rows["python"] = torch.tensor([list(words)], dtype=torch.int64)
    rows["python_gauss"] = torch.tensor([[0.0 if gauss is None else 1.0, 0.0 if gauss is None else gauss]],
                                        dtype=torch.float64)
    if np is not None:
        name, key, pos, has_gauss, cached = np.random.get_state()
        if name != "MT19937":  # pragma: no cover - the legacy global generator is always MT19937
            raise CheckpointError(f"rank {rank}: numpy's global generator is {name}, expected MT19937")
        rows["numpy"] = torch.from_numpy(key.astype(np.int64)).reshape(1, -1)
        rows["numpy_extra"] = torch.tensor([[float(pos), float(has_gauss), float(cached)]], dtype=torch.float64)
    return rows


def capture(rank: int, world_size: int) -> dict[str, Any]:
    """This rank's RNG states as rows of the global tables (for saving)."""
    out: dict[str, Any] = {
        name: Shard(row, (rank, 0), (world_size, row.shape[1])) for name, row in _rows(rank).items()
    }
    out["python_version"] = random.getstate()[0]
    return out


def row_request(rank: int, world_size: int, present: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
    """Buffers for rank ``rank``'s row of each saved table (same world size: exact restore).

    ``present`` maps table name -> (dtype name, global shape) as saved. A table this
    process cannot apply (``cuda`` without CUDA) is requested as an empty piece, so
    strict loading still accounts for every saved key.
    """
    out: dict[str, Any] = {}
    for name, (dtype, shape) in present.items():
        if shape[0] != world_size:
            raise CheckpointError(f"RNG table {name!r} has {shape[0]} rows, expected one per rank ({world_size})")
        rows = 0 if (name == "cuda" and not _cuda_active()) else 1
        buf = torch.empty((rows, shape[1]), dtype=dtype_from_name(dtype))
        out[name] = Shard(buf, (rank if rows else 0, 0), shape)
    return out


def empty_request(present: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
    """Empty pieces of every saved table (another world size: nothing is read)."""
    return {
        name: Shard(torch.empty((0, shape[1]), dtype=dtype_from_name(dtype)), (0, 0), shape)
        for name, (dtype, shape) in present.items()
    }


def apply(tables: dict[str, Any], python_version: Any) -> None:
    """Install the rows that :func:`row_request` filled into this process's generators."""
    def row(name: str) -> torch.Tensor | None:
        piece = tables.get(name)
        return piece.tensor[0] if piece is not None and piece.tensor.shape[0] == 1 else None

    if (t := row("torch")) is not None:
        torch.set_rng_state(t.contiguous())
    if (t := row("cuda")) is not None:
        torch.cuda.set_rng_state(t.contiguous())
    words, gauss = row("python"), row("python_gauss")
    if words is not None:
        g = None if gauss is None or gauss[0].item() == 0.0 else float(gauss[1].item())
        random.setstate((int(python_version), tuple(int(w) for w in words.tolist()), g))
    key, extra = row("numpy"), row("numpy_extra")
    if key is not None and np is not None:
        pos, has_gauss, cached = extra.tolist() if extra is not None else (624.0, 0.0, 0.0)
        np.random.set_state(("MT19937", key.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
