"""The save's writer reads one buffer ahead: pieces copied in from another process (``read``)
alternate two buffers, so the buffer being written is never refilled under it."""
from __future__ import annotations

import ctypes

import crc32c
import torch

from raydcp.engine.save import local_save_plan, plan_options, write_rank_files
from raydcp.metadata import BLOCK_BYTES
from raydcp.options import IOOptions, SaveOptions
from raydcp.planner import plan_save
from raydcp.state import flatten_state
from raydcp.storage import CheckpointStorage

MIB = 1 << 20


def test_pieces_read_from_elsewhere_are_written_whole(tmp_path):
    gen = torch.Generator().manual_seed(0)
    sd = {"big": torch.randint(0, 255, (5 * MIB + 123,), dtype=torch.uint8, generator=gen),
          "mid": torch.randint(0, 255, (3 * MIB,), dtype=torch.uint8, generator=gen)}
    staged = local_save_plan(0, flatten_state(sd), compare_replicas=False)
    io = IOOptions(write_bytes=BLOCK_BYTES, write_threads=1)  # 1 MiB chunks: many buffers in turn
    plan = plan_save([staged.plan], plan_options(SaveOptions(io=io))).ranks[0]
    sources = [sd[it.key].numpy() for it in staged.plan.items]

    def read(name: str, item: int, start: int, nbytes: int, address: int) -> None:
        ctypes.memmove(address, sources[item][start:].ctypes.data, nbytes)

    storage = CheckpointStorage(str(tmp_path / "ck"))
    record = write_rank_files(storage, plan, staged, read, io=io)
    assert len(record.key) == 2
    for row in range(len(record.key)):
        key = record.keys[int(record.key[row])]
        start, n = int(record.byte_offsets[row]), int(record.nbytes[row])
        data = storage.read_ranges(record.files[int(record.file[row])], [(start, start + n)])[0]
        assert bytes(data) == sd[key].numpy().tobytes(), key
        assert int(record.crcs[row]) == crc32c.crc32c(sd[key].numpy())
        blocks = record.block_values[record.block_bounds[row]:record.block_bounds[row + 1]]
        assert list(blocks) == [crc32c.crc32c(sd[key].numpy()[b:b + BLOCK_BYTES]) for b in range(0, n, BLOCK_BYTES)]
