"""Multi-round save: one checkpoint written in several rounds, committed once, resumable.

A checkpoint that is not held in memory at once (a streaming reshard, a conversion) is
written in rounds, each holding a bounded part of the state. The protocol:

Steps 1 (plan) and 2 (write) of the save protocol (:mod:`raydcp.engine.protocol`) run once per
round; the commit step runs once, for all rounds:

1. the driver picks the checkpoint's save id ``base`` (a :class:`RoundJournal` begins a new save
   at the path, :func:`~raydcp.storage.commits.begin_save`, or resumes one begun on the current
   commit);
2. for each round ``i``, every rank of a transport calls :func:`write_round` with the pieces
   of this round only. The coordinator plans the round with ``plan_save`` (validation, replicas
   written once, bytes balanced) under the round's own save id ``<base>/<i>``, so its files
   ``data/<base>/<i>/r<rank>-f<n>.bin`` never collide with another round's, nor with the files
   of a checkpoint already committed at that path. Each rank writes its files durably; the
   coordinator gathers the storage records and hands them to rank 0 as one
   :class:`RoundRecords` (the other ranks get None). The driver may journal them
   (:meth:`RoundJournal.record`) so that a rerun skips the round;
3. after the last round the driver calls :func:`commit_rounds` once: it checks that the rounds
   together tile every tensor exactly, commits the metadata last with a compare-and-swap on the
   path's commit log (ConcurrentSaveError if another save committed since the journal began),
   then removes the replaced save's files and this save's journal and leftovers: nothing that
   raydcp did not write (a failed round removes its own files before it raises).

Until step 3 no reader sees anything new: a failure before the commit leaves the previously
committed checkpoint at that path (if any) intact and loadable.

A round may hold part of a tensor (say a block of its rows) under a *round key* of its own:
the round's plan sees it as a whole tensor of the block's shape, and ``commit_rounds`` places
it with ``placement`` (round key -> (key, offsets of the block)).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..errors import CheckpointError, RankFailure
from ..metadata import COMPRESSED_FORMAT_VERSION, COMPRESSIONS, FORMAT_VERSION, ChunkMeta, Metadata, TensorMeta, codec_id
from ..options import DEFAULT_SAVE, SaveOptions
from ..planner import TensorSpec
from ..planner.tiling import piece_problems
from ..state import flatten_state
from ..storage import CheckpointStorage
from ..storage.commits import begin_save, current_generation, save_generation
from ..transport import Transport
from .protocol import commit_checkpoint, name_storage_error, plan_round
from .save_records import StorageRecord
from .save import discard_after_failure, local_save_plan, plan_options, write_rank_files

__all__ = ["RoundRecords", "new_save_id", "round_save_id", "write_round", "commit_rounds", "RoundJournal"]


@dataclass(frozen=True)
class RoundRecords:
    """What one round wrote: its save id, its tensors (by round key) and every rank's storage
    records, as one :class:`~raydcp.engine.save_records.StorageRecord` (keys are round keys)."""

    save_id: str
    tensors: Mapping[str, TensorSpec]
    records: StorageRecord

    @property
    def nbytes(self) -> int:
        return self.records.total_bytes

    def to_json(self) -> dict:
        """The journal's form: one row per piece ``[key, offsets, sizes, file, byte offset, nbytes, crc, blocks]``
        and, where pieces were compressed, each piece's codec name (or None) and stored length."""
        out = {"save_id": self.save_id,
               "tensors": {k: [s.dtype, list(s.shape)] for k, s in self.tensors.items()},
               "records": [[k, list(o), list(s), f, b, n, c, list(bl)]
                           for k, o, s, f, b, n, c, bl in self.records.rows()]}
        if self.records.codec is not None:
            out["codecs"] = [COMPRESSIONS[k - 1] if k else None for k in self.records.codec.tolist()]
            out["stored"] = self.records.stored.tolist()
        return out

    @classmethod
    def from_json(cls, obj: dict) -> "RoundRecords":
        rows = [(k, tuple(o), tuple(s), f, int(b), int(n), int(c), tuple(bl))
                for k, o, s, f, b, n, c, bl in obj["records"]]
        codec = stored = None
        if obj.get("codecs"):
            if len(obj["codecs"]) != len(rows) or len(obj["stored"]) != len(rows):
                raise ValueError("a journal entry's codecs do not match its records")
            codec, stored = [codec_id(k) for k in obj["codecs"]], [int(n) for n in obj["stored"]]
        records = StorageRecord.from_rows(rows, codec, stored)
        return cls(obj["save_id"], {k: TensorSpec(d, tuple(s)) for k, (d, s) in obj["tensors"].items()}, records)


def new_save_id() -> str:
    return uuid.uuid4().hex[:16]


def round_save_id(base: str, index: int) -> str:
    """The save id of round ``index``: its files are ``data/<base>/<index>/...``."""
    return f"{base}/{index:05d}"


def _reduce_round_records(values: Sequence[tuple]) -> list:
    """The round's "commit" on the coordinator: gather every rank's records for rank 0, commit nothing."""
    header = values[0][1]
    records = StorageRecord.concat([recs for recs, _ in values])
    return [RoundRecords(header.save_id, dict(header.tensors), records)] + [None] * (len(values) - 1)


def write_round(transport: Transport, state: dict, checkpoint_id: str, save_id: str, *,
                storage_options: dict | None = None, options: SaveOptions = DEFAULT_SAVE,
                failure: BaseException | None = None) -> RoundRecords | None:
    """Step 2 for one rank (every rank of ``transport`` calls it): write this round's pieces,
    in files of up to ``options.max_file_bytes``, with ``options.io``.

    ``state`` holds tensors only (plain values go to :func:`commit_rounds`). Returns the
    round's records on rank 0, None on the others. Nothing is committed. A rank that failed
    while preparing its pieces still calls, passing the exception as ``failure``: every rank
    then raises one CheckpointError naming it, rather than waiting for it.
    """
    rank = transport.rank
    staged = None
    try:
        if failure is not None:
            raise failure
        if options.base is not None:
            raise CheckpointError("write_round: a save in rounds writes every piece; SaveOptions(base=...) "
                                  "(a delta save) is for raydcp.save, async_save and ShardGroup.save")
        staged = local_save_plan(rank, flatten_state(state), compare_replicas=False)
        if staged.plan.values:
            raise CheckpointError(f"write_round: plain values {sorted(staged.plan.values)[:5]} belong in "
                                  "commit_rounds(values=...), not in a round")
        local: Any = staged.plan
    except Exception as exc:
        local = RankFailure.from_exception(rank, exc)
    plan, header = plan_round(transport, local, plan_options(options, save_id=save_id), step="round: plan")
    storage = CheckpointStorage(checkpoint_id, storage_options)
    try:
        written: Any = (write_rank_files(storage, plan, staged, io=options.io, compression=options.compression),
                        header)
    except Exception as exc:
        written = RankFailure.from_exception(rank, name_storage_error(exc, checkpoint_id))
    try:
        return transport.reduce_scatter("round: written", written, _reduce_round_records)
    except CheckpointError as exc:  # this round's files only: earlier rounds stay for a resume
        discard_after_failure(storage, [plan], exc)
        raise


def commit_rounds(checkpoint_id: str, save_id: str, world_size: int, rounds: Sequence[RoundRecords],
                  tensors: Mapping[str, TensorSpec], values: Mapping[str, Any] | None = None, *,
                  placement: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
                  extra: Mapping[str, Any] | None = None, storage_options: dict | None = None) -> Metadata:
    """Step 3, once, on one process: commit the rounds' pieces as one checkpoint; returns its metadata.

    ``tensors`` are the checkpoint's tensors (key -> dtype and global shape); a round key not
    in ``placement`` is the key itself, at offset 0. Raises CheckpointError, committing
    nothing, if a round belongs to another save or the pieces do not tile every tensor.
    """
    placement = placement or {}
    chunks: dict[str, list[ChunkMeta]] = {k: [] for k in tensors}
    problems: list[str] = []
    for rnd in rounds:
        if not rnd.save_id.startswith(f"{save_id}/"):
            raise CheckpointError(f"commit_rounds: round {rnd.save_id!r} is not a round of save {save_id!r}")
        for rkey, spec in rnd.tensors.items():
            key, base = placement.get(rkey, (rkey, (0,) * len(spec.shape)))
            if key not in tensors or tensors[key].dtype != spec.dtype or len(base) != len(tensors[key].shape):
                problems.append(f"{rkey}: round {rnd.save_id} holds {spec.dtype}{list(spec.shape)}, which is no "
                                f"part of any tensor of the checkpoint")
        codecs = None if rnd.records.codec is None else rnd.records.codec.tolist()
        stored = None if rnd.records.stored is None else rnd.records.stored.tolist()
        for i, (rkey, offsets, sizes, file, off, nbytes, crc, blocks) in enumerate(rnd.records.rows()):
            key, base = placement.get(rkey, (rkey, (0,) * len(offsets)))
            if key not in chunks:
                continue  # reported above
            absolute = tuple(b + o for b, o in zip(base, offsets))
            packed = (COMPRESSIONS[codecs[i] - 1], stored[i]) if codecs and codecs[i] else ()
            chunks[key].append(ChunkMeta(absolute, sizes, file, off, nbytes, crc, blocks, *packed))
    for key, spec in tensors.items():
        problems.extend(piece_problems(key, spec.shape, [(c.offsets, c.sizes) for c in chunks[key]]))
    if problems:
        raise CheckpointError(f"commit_rounds {checkpoint_id}: the rounds do not form the checkpoint, nothing "
                              "committed:\n  " + "\n  ".join(problems[:20]))
    compressed = any(rnd.records.codec is not None for rnd in rounds)
    md = Metadata(
        save_id=save_id,
        world_size=world_size,
        created_at=time.time(),
        tensors={k: TensorMeta(s.dtype, tuple(s.shape), tuple(sorted(chunks[k], key=lambda c: c.offsets)))
                 for k, s in tensors.items()},
        values=dict(values or {}),
        version=COMPRESSED_FORMAT_VERSION if compressed else FORMAT_VERSION,
        extra=dict(extra or {}),
    )
    # a compare-and-swap on the path's commit log; then the replaced save's files, this save's
    # journal and the files of round attempts that did not finish go (nothing raydcp did not write)
    commit_checkpoint(CheckpointStorage(checkpoint_id, storage_options), md, own_leftovers=True)
    return md


class RoundJournal:
    """Durable progress of a multi-round save, beside its data, so a rerun resumes it.

    Files (all under ``data/``, so :func:`commit_rounds` removes them with the leftovers):
    ``data/<base>/journal/job.json`` holds the job's identity (any JSON the caller picks: the
    source, the options); ``data/<base>/journal/<i>.json`` the records of round ``i``, written
    after the round's files are durable. Protocol:

    1. ``RoundJournal(checkpoint_id, job)`` finds the journal of the same ``job`` among the
       uncommitted files at the path (resuming its ``save_id`` and :attr:`done` rounds), or
       starts a new one (:meth:`start` writes ``job.json``);
    2. after each round, :meth:`record` writes the round's records;
    3. :func:`commit_rounds` with ``[*done rounds, *new rounds]``.

    A resumed round's files are checked to exist with at least the recorded size; a round
    whose files are gone is simply run again.
    """

    def __init__(self, checkpoint_id: str, job: Mapping[str, Any], storage_options: dict | None = None):
        self.storage = CheckpointStorage(checkpoint_id, storage_options)
        self.job = json.loads(json.dumps(job, sort_keys=True))
        self.done: dict[int, RoundRecords] = {}
        self.save_id = None
        # only a journal begun on the current commit can still commit (see raydcp.storage.commits)
        generation = current_generation(self.storage)
        for name in self.storage.list_files("data/"):
            parts = name.split("/")
            if len(parts) == 4 and parts[2] == "journal" and parts[3] == "job.json" \
                    and save_generation(parts[1]) == generation:
                try:
                    found = json.loads(self.storage.read_file(name))
                except (CheckpointError, ValueError):
                    continue
                if found == self.job:
                    self.save_id = parts[1]
                    self._load_rounds()
                    break
        self.resumed = self.save_id is not None
        if self.save_id is None:
            self.save_id = begin_save(self.storage)

    def _dir(self) -> str:
        return f"data/{self.save_id}/journal"

    def _load_rounds(self) -> None:
        sizes: dict[str, int | None] = {}
        for name in self.storage.list_files(self._dir() + "/"):
            stem = name.rsplit("/", 1)[1].removesuffix(".json")
            if not stem.isdigit():
                continue
            try:
                rnd = RoundRecords.from_json(json.loads(self.storage.read_file(name)))
            except (CheckpointError, ValueError, KeyError, TypeError):
                continue  # a torn journal entry: run the round again
            need: dict[str, int] = {}
            for file, off, length in zip((rnd.records.files[f] for f in rnd.records.file.tolist()),
                                         rnd.records.byte_offsets.tolist(), rnd.records.stored_lengths.tolist()):
                need[file] = max(need.get(file, 0), off + length)
            if all((sizes.setdefault(f, self.storage.file_size(f)) or 0) >= n for f, n in need.items()):
                self.done[int(stem)] = rnd

    def start(self) -> None:
        if not self.resumed:
            self.storage.write_file(f"{self._dir()}/job.json", json.dumps(self.job, sort_keys=True).encode())

    def record(self, index: int, rnd: RoundRecords) -> None:
        self.storage.write_file(f"{self._dir()}/{index:05d}.json", json.dumps(rnd.to_json()).encode())
        self.done[index] = rnd
