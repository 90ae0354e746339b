"""Checkpoints of a Ray Train run kept in the cluster's memory (``raymem://``).

``raydcp.train.save(..., memory=True, persist_every=k)`` saves every checkpoint into the memory
of the run's nodes (each rank's files on its node and on a replica node) and also to the run's
storage at every step that is a multiple of ``k`` (the step of the run, which a restart carries
on from, not a count of saves), and whenever the caller asks with ``persist=True`` (the run's
last checkpoint); ``raydcp.train.restore`` loads from memory when the newest checkpoint of the
run is there (a restart after a failure, an elastic resize), else from storage.

A run's memory checkpoints live under ``raymem://raydcp-train-<run>-<hash of its storage path>/``,
one directory per save named like the storage ones (``raydcp-step00000042-<nonce>``);
``keep_last=1`` there: a new one replaces the previous once it has committed.
"""
from __future__ import annotations

import hashlib
import re
from typing import Any

from ..errors import CheckpointError
from ..storage import METADATA_NAME
from ._context import is_raydcp_dir_name

__all__ = ["memory_root", "latest_in_memory", "step_of_dir", "should_persist"]

_STEP_RE = re.compile(r"^raydcp-step(\d{8})-")


def memory_root(ctx) -> str:
    """``raymem://`` root of this run's memory checkpoints (the same for every attempt of the run)."""
    storage = ctx.get_storage()
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", ctx.get_experiment_name())[:64]
    digest = hashlib.sha1(str(storage.experiment_fs_path).encode()).hexdigest()[:8]
    return f"raymem://raydcp-train-{name}-{digest}"


def step_of_dir(name: str) -> int | None:
    """The step in a checkpoint directory name, or None (a checkpoint saved without a step)."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def latest_in_memory(root: str, storage_options: dict | None = None) -> tuple[str, int | None] | None:
    """(URL, step) of the newest committed checkpoint under ``root``, or None when there is none
    (or no Ray cluster holds any)."""
    import fsspec

    fs = fsspec.filesystem("raymem", **(storage_options or {}))
    base = fs._strip_protocol(root)
    try:
        found = fs.find(base, detail=True)
    except (FileNotFoundError, CheckpointError):
        return None
    best = None
    for path, info in found.items():
        parts = path[len(base) + 1:].split("/")
        if len(parts) == 2 and parts[1] == METADATA_NAME and is_raydcp_dir_name(parts[0]):
            key = (info.get("created", 0.0), parts[0])
            if best is None or key > best[0]:
                best = (key, parts[0])
    if best is None:
        return None
    return f"{root}/{best[1]}", step_of_dir(best[1])


def should_persist(step: int | None, persist_every: Any, persist: bool | None = None) -> bool:
    """Whether the memory save of ``step`` is also written to the run's storage.

    ``persist`` decides when given (True: the run's last checkpoint, or any the caller wants
    kept); otherwise the steps that are multiples of ``persist_every`` are persisted. The step is
    the run's (a restart resumes its count), so every attempt and every world size persists the
    same steps; without a step only ``persist_every=1`` (every save) can be honoured.
    """
    if isinstance(persist_every, bool) or not isinstance(persist_every, int) or persist_every < 1:
        raise CheckpointError(f"persist_every must be an integer >= 1, got {persist_every!r}")
    if persist is not None:
        if not isinstance(persist, bool):
            raise CheckpointError(f"persist must be True, False or None, got {persist!r}")
        return persist
    if persist_every == 1:
        return True
    if step is None:
        raise CheckpointError(
            f"raydcp.train.save(memory=True, persist_every={persist_every}) persists the steps that are multiples "
            f"of {persist_every}, but this save has no step: pass step=, save a raydcp.train.TrainState, or "
            "report metrics['step'] (or pass persist=True/False to decide for this save)")
    return step % persist_every == 0
