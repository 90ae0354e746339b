"""Collective save: flatten -> local plan -> global plan -> parallel writes -> commit last."""
from __future__ import annotations

import time
from functools import partial
from typing import Any, Sequence

import torch

from ..codec import block_checksums, checksum
from ..errors import CheckpointError, RankFailure
from ..metadata import BLOCK_BYTES, ChunkMeta, Metadata, TensorMeta, encode_metadata
from ..planner import LocalSavePlan, RankWritePlan, SavePlanOptions, TensorSpec, WriteItem, plan_save
from ..planner.save import ALIGN
from ..state import FlatState, flatten_state
from ..storage import CheckpointStorage
from ..transport import Transport

__all__ = ["save_with", "local_save_plan", "StagedState"]

_ZEROS = bytes(ALIGN)


class StagedState:
    """A rank's local plan and one flat uint8 view per piece (on the piece's device until staged)."""

    def __init__(self, plan: LocalSavePlan, data: list[torch.Tensor]):
        self.plan = plan
        self.data = data


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def local_save_plan(rank: int, flat: FlatState, *, compare_replicas: bool) -> StagedState:
    """Describe what this rank holds. Replicas get a checksum where that is cheap (host tensors)."""
    tensors, items, data = {}, [], []
    for fqn in sorted(flat.tensors):
        leaf = flat.tensors[fqn]
        tensors[fqn] = TensorSpec(leaf.dtype, leaf.global_shape)
        raw = _byte_view(leaf.tensor)
        crc = checksum(raw) if compare_replicas and leaf.replicable and raw.device.type == "cpu" else None
        items.append(WriteItem(fqn, leaf.offsets, tuple(leaf.tensor.shape), raw.numel(), crc))
        data.append(raw)
    return StagedState(LocalSavePlan(rank, tensors, tuple(items), dict(flat.values)), data)


def _reduce_save_plan(options: SavePlanOptions, local_plans: Sequence[LocalSavePlan]) -> list:
    gp = plan_save(local_plans, options)
    header = (gp.save_id, gp.world_size, dict(gp.tensors), dict(gp.values))
    return [(gp.ranks[r], header if r == 0 else None) for r in range(gp.world_size)]


def write_rank_files(storage: CheckpointStorage, plan: RankWritePlan, staged: StagedState) -> list[tuple]:
    """Write this rank's files (in parallel) and return one storage record per piece."""
    files: dict[str, list[Any]] = {}
    records = []
    for name, slots in plan.files:
        bufs: list[Any] = []
        pos = 0
        for slot in slots:
            if slot.byte_offset > pos:
                bufs.append(_ZEROS[: slot.byte_offset - pos])
            raw = staged.data[slot.item]
            item = staged.plan.items[slot.item]
            buf = (raw if raw.device.type == "cpu" else raw.cpu()).numpy()
            bufs.append(buf)
            crc = item.checksum if item.checksum is not None else checksum(buf)
            blocks = block_checksums(buf, BLOCK_BYTES)
            records.append((item.key, item.offsets, item.sizes, name, slot.byte_offset, item.nbytes, crc, blocks))
            pos = slot.byte_offset + item.nbytes
        files[name] = bufs
    storage.write_files(files)
    return records


def _reduce_commit(checkpoint_id: str, storage_options: dict | None, values: Sequence[tuple]) -> list:
    header = values[0][1]
    save_id, world_size, tensors, plain = header
    chunks: dict[str, list[ChunkMeta]] = {k: [] for k in tensors}
    for records, _ in values:
        for key, offsets, sizes, file, off, nbytes, crc, blocks in records:
            chunks[key].append(ChunkMeta(offsets, sizes, file, off, nbytes, crc, blocks))
    md = Metadata(
        save_id=save_id,
        world_size=world_size,
        created_at=time.time(),
        tensors={k: TensorMeta(s.dtype, s.shape, tuple(sorted(chunks[k], key=lambda c: c.offsets)))
                 for k, s in tensors.items()},
        values=plain,
    )
    storage = CheckpointStorage(checkpoint_id, storage_options)
    storage.commit(encode_metadata(md))
    # the files of earlier saves to this path are unreachable now: remove them
    stale = [f for f in storage.list_files("data/") if not f.startswith(f"data/{save_id}/")]
    if stale:
        storage.remove_files(stale)
    return [md] * len(values)


def save_with(
    transport: Transport,
    state_dict: dict,
    checkpoint_id: str,
    storage_options: dict | None = None,
    options: SavePlanOptions = SavePlanOptions(),
    staged: StagedState | None = None,
) -> Metadata:
    """The save protocol for one rank (every rank of ``transport`` calls it together).

    1. stage: flatten the state and describe it (local plan); 2. reduce_scatter
    "plan": the coordinator validates and builds the global plan; 3. write this
    rank's files; 4. reduce_scatter "commit": the coordinator writes the metadata
    last, atomically, and every rank gets it back. Any failure on any rank fails
    every rank with one CheckpointError and commits nothing.
    """
    rank = transport.rank
    local: Any
    try:
        if staged is None:
            staged = local_save_plan(rank, flatten_state(state_dict), compare_replicas=transport.world_size > 1)
        local = staged.plan
    except Exception as exc:
        local = RankFailure.from_exception(rank, exc)
    plan, header = transport.reduce_scatter("save: plan", local, partial(_reduce_save_plan, options))
    try:
        records: Any = (write_rank_files(CheckpointStorage(checkpoint_id, storage_options), plan, staged), header)
    except Exception as exc:
        records = RankFailure.from_exception(rank, _name_storage_error(exc, checkpoint_id))
    return transport.reduce_scatter("save: commit", records, partial(_reduce_commit, checkpoint_id, storage_options))


def _name_storage_error(exc: Exception, checkpoint_id: str) -> Exception:
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, OSError):
        return CheckpointError(f"writing {checkpoint_id}: {exc}; check the path, permissions and free space")
    return exc
