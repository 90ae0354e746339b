"""The chunk columns the commit step and the planner build, and how the encoder takes them."""
import sys

import numpy as np
import torch

from raydcp.engine.protocol import tensor_metas
from raydcp.engine.save_records import StorageRecord
from raydcp.metadata import ChunkColumns, Metadata, TensorMeta
from raydcp.metadata_format import decode_metadata, encode_metadata
from raydcp.planner import SavePlanOptions, chunk_tables, plan_save
from raydcp.state import flatten_state

save_engine = sys.modules["raydcp.engine.save"]


def _plans():
    state = {"w": torch.zeros(4, 3), "b": torch.zeros(5), "s": torch.tensor(2.0), "e": torch.zeros(0, 2),
             "m": {"x": torch.zeros(2, 2, 2, dtype=torch.bfloat16)}}
    lp = save_engine.local_save_plan(0, flatten_state(state), compare_replicas=False).plan
    return [lp], plan_save([lp], SavePlanOptions(save_id="t"))


def _records(gp, lps, crcs):
    items = lps[0].items
    layout = save_engine._file_layouts(gp.ranks[0].files)
    order = [(name, i, off) for name, ids, offs in layout for i, off in zip(ids, offs)]
    return [(items[i].key, items[i].offsets, items[i].sizes, name, off, items[i].nbytes, int(c), ())
            for (name, i, off), c in zip(order, crcs)]


def test_planner_tables_view_one_set_of_columns_and_encode_as_the_commit_step_does():
    lps, gp = _plans()
    n = len(lps[0].items)
    crcs = np.arange(100, 100 + n, dtype=np.int64)
    tables = chunk_tables(gp, lps, [crcs])
    cols = {id(t.origin[0]) for t in tables.values()}
    assert len(cols) == 1 and isinstance(next(iter(tables.values())).origin[0], ChunkColumns)
    tensors = {k: TensorMeta(s.dtype, s.shape, tables[k]) for k, s in gp.tensors.items()}
    from_tables = encode_metadata(Metadata("t", 1, 0.0, tensors, {}))
    committed = tensor_metas(dict(gp.tensors), [StorageRecord.from_rows(_records(gp, lps, crcs))])
    assert encode_metadata(Metadata("t", 1, 0.0, committed, {})) == from_tables
    # and the same as encoding per-chunk objects
    objects = {k: TensorMeta(t.dtype, t.shape, tuple(t.chunks)) for k, t in tensors.items()}
    assert encode_metadata(Metadata("t", 1, 0.0, objects, {})) == from_tables
    back = decode_metadata(from_tables)
    assert dict(back.tensors.items()) == objects
    assert back.tensors["s"].chunks[0].offsets == () and len(back.tensors["e"].chunks) == 0


def test_one_table_under_two_names_and_a_table_of_the_wrong_dimension():
    import pytest

    from raydcp import CheckpointError

    lps, gp = _plans()
    tables = chunk_tables(gp, lps)
    tensors = {k: TensorMeta(s.dtype, s.shape, tables[k]) for k, s in gp.tensors.items()}
    tensors["w"] = TensorMeta("float32", (12,), tables["b"])  # another 1-D tensor's chunks: rows taken twice
    back = decode_metadata(encode_metadata(Metadata("t", 1, 0.0, tensors, {})))
    assert back.tensors["w"].chunks == tables["b"] and back.tensors["b"].chunks == tables["b"]
    tensors["w"] = TensorMeta("float32", (4, 3), tables["b"])  # boxes of the wrong dimension: written row by row
    with pytest.raises(CheckpointError, match="does not fit"):
        decode_metadata(encode_metadata(Metadata("t", 1, 0.0, tensors, {})))
