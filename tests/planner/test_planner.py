"""Global save planning and N -> M load planning, simulated in one process (no Ray, no I/O)."""
from __future__ import annotations

import pytest
import torch

from raydcp import CheckpointError
from raydcp.codec import checksum, tensor_bytes
from raydcp.planner import (LocalLoadPlan, LocalSavePlan, ReadItem, SavePlanOptions, SourceChunk, TensorSpec,
                            WriteItem, byte_runs, merge_runs, plan_load, plan_save)
from raydcp.planner.load import check_requests

from .layouts import blocks, cols, piece, replicated, rows

GLOBALS = {
    "w": torch.arange(7 * 10, dtype=torch.float32).reshape(7, 10),
    "e": torch.arange(5 * 3 * 2, dtype=torch.int16).reshape(5, 3, 2),
    "b": torch.arange(9, dtype=torch.float64),
}


def local_save_plans(world, layout, tensors=GLOBALS, rep_keys=()):
    plans, data = [], []
    for r in range(world):
        items, mine = [], []
        for key, t in tensors.items():
            lay = replicated if key in rep_keys or (t.dim() < 2 and layout is not rows) else layout
            off, size = lay(tuple(t.shape), world, r)
            p = piece(t, off, size)
            raw = tensor_bytes(p)
            items.append(WriteItem(key, tuple(off), tuple(size), raw.numel(), checksum(raw)))
            mine.append(raw)
        specs = {k: TensorSpec(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in tensors.items()}
        plans.append(LocalSavePlan(r, specs, tuple(items), {"step": 3}))
        data.append(mine)
    return plans, data


def stored(plans, data, options=SavePlanOptions(max_file_bytes=256)):
    """Run the global save plan and 'write' files into a dict: returns (files, sources)."""
    gp = plan_save(plans, options)
    files: dict[str, bytearray] = {}
    sources: dict[str, list[SourceChunk]] = {}
    for rp in gp.ranks:
        for name, slots in rp.files:
            buf = files.setdefault(name, bytearray())
            for slot in slots:
                it = plans[rp.rank].items[slot.item]
                buf.extend(b"\0" * (slot.byte_offset - len(buf)))
                buf.extend(bytes(data[rp.rank][slot.item].numpy()))
                sources.setdefault(it.key, []).append(SourceChunk(
                    it.key, gp.tensors[it.key].dtype, it.offsets, it.sizes, name, slot.byte_offset, it.nbytes))
    return gp, files, sources


def run_load(files, sources, world, layout, tensors=GLOBALS):
    """Plan a load for `world` ranks and execute it against the in-memory files."""
    plans = []
    for r in range(world):
        items, specs = [], {}
        for key, t in tensors.items():
            lay = replicated if t.dim() < 2 and layout is not rows else layout
            off, size = lay(tuple(t.shape), world, r)
            items.append(ReadItem(key, tuple(off), tuple(size)))
            specs[key] = TensorSpec(str(t.dtype).removeprefix("torch."), tuple(t.shape))
        plans.append(LocalLoadPlan(r, specs, tuple(items), ("step",)))
    itemsizes = {k: t.element_size() for k, t in tensors.items()}
    out = plan_load(sources, plans, {"step": 3}, itemsizes)
    result = [{it.key: torch.full(it.sizes, -1, dtype=tensors[it.key].dtype) for it in p.items} for p in plans]
    total_read = 0
    for rp in out:
        for cr in rp.reads:
            ch = cr.source
            runs = merge_runs([x for d in cr.deliveries for x in byte_runs(ch.offsets, ch.sizes, d.offsets, d.sizes, itemsizes[ch.key])])
            total_read += sum(e - s for s, e in runs)
            whole = torch.frombuffer(bytearray(files[ch.file][ch.byte_offset:ch.byte_offset + ch.nbytes]),
                                     dtype=tensors[ch.key].dtype).reshape(ch.sizes)
            for d in cr.deliveries:
                item = plans[d.rank].items[d.item]
                src = piece(whole, [o - c for o, c in zip(d.offsets, ch.offsets)], d.sizes)
                piece(result[d.rank][item.key], [o - i for o, i in zip(d.offsets, item.offsets)], d.sizes).copy_(src)
    for r, p in enumerate(plans):
        assert out[r].values == {"step": 3}
        for it in p.items:
            assert torch.equal(result[r][it.key], piece(tensors[it.key], it.offsets, it.sizes)), (r, it.key)
    return out, total_read, plans


def unique_needed_bytes(plans, tensors=GLOBALS):
    seen = set()
    for p in plans:
        for it in p.items:
            t = tensors[it.key]
            idx = torch.arange(t.numel()).reshape(t.shape)
            seen.update((it.key, int(i)) for i in piece(idx, it.offsets, it.sizes).reshape(-1))
    return sum(tensors[k].element_size() for k, _ in seen)


@pytest.mark.parametrize("n_save,save_layout,n_load,load_layout", [
    (8, rows, 4, rows), (4, rows, 3, rows), (3, rows, 5, rows), (4, blocks((2, 2)), 3, rows),
    (6, blocks((2, 3)), 4, cols), (2, replicated, 3, rows), (3, rows, 2, replicated), (1, rows, 6, cols),
    (5, cols, 1, rows),
])
def test_n_to_m_is_exact_and_reads_each_needed_byte_once(n_save, save_layout, n_load, load_layout):
    plans, data = local_save_plans(n_save, save_layout)
    _, files, sources = stored(plans, data)
    out, total_read, load_plans = run_load(files, sources, n_load, load_layout)
    assert total_read == sum(p.bytes_read for p in out)
    assert total_read == unique_needed_bytes(load_plans)  # read amplification exactly 1.0


def test_replicas_written_once_and_bytes_balanced():
    plans, data = local_save_plans(4, replicated)
    gp, files, sources = stored(plans, data, SavePlanOptions(max_file_bytes=1 << 20))
    for key, t in GLOBALS.items():
        assert len(sources[key]) == 1  # each replicated tensor written by exactly one rank
    written = [sum(plans[rp.rank].items[s.item].nbytes for _, slots in rp.files for s in slots) for rp in gp.ranks]
    assert written == list(gp.bytes_per_rank)
    assert sum(1 for w in written if w) == 3  # three tensors spread over three ranks


def test_small_pieces_coalesce_into_few_aligned_files():
    many = {f"t{i}": torch.full((4,), float(i)) for i in range(100)}
    plans, data = local_save_plans(1, rows, many)
    gp = plan_save(plans, SavePlanOptions(max_file_bytes=1 << 20))
    (name, slots), = gp.ranks[0].files
    assert len(slots) == 100 and all(s.byte_offset % 64 == 0 for s in slots)


def test_plan_rejects_shape_disagreement_overlap_gap_and_divergence():
    plans, data = local_save_plans(2, rows)
    bad = LocalSavePlan(1, {**plans[1].tensors, "w": TensorSpec("float32", (8, 10))}, plans[1].items, plans[1].values)
    with pytest.raises(CheckpointError, match=r"w: float32\[7, 10\] on ranks \[0\]; float32\[8, 10\] on ranks \[1\]"):
        plan_save([plans[0], bad])
    over = LocalSavePlan(1, plans[1].tensors, (WriteItem("w", (3, 0), (4, 10), 160),) + plans[1].items[1:], {})
    with pytest.raises(CheckpointError, match="w: pieces at .* overlap"):
        plan_save([plans[0], over])
    gap = LocalSavePlan(1, plans[1].tensors, (WriteItem("w", (5, 0), (2, 10), 80),) + plans[1].items[1:], {})
    with pytest.raises(CheckpointError, match="w: pieces cover 60 of 70 elements"):
        plan_save([plans[0], gap])
    rplans, _ = local_save_plans(3, replicated)
    diverged = LocalSavePlan(2, rplans[2].tensors, tuple(
        WriteItem(i.key, i.offsets, i.sizes, i.nbytes, (i.checksum or 0) + (i.key == "b")) for i in rplans[2].items), {})
    with pytest.raises(CheckpointError, match=r"b: replicas on ranks \[0, 1, 2\] differ"):
        plan_save([rplans[0], rplans[1], diverged])
    other = LocalSavePlan(1, plans[1].tensors, plans[1].items, {"step": 4})
    with pytest.raises(CheckpointError, match="step: rank 0 has 3, rank 1 has 4"):
        plan_save([plans[0], other])


def test_check_requests_names_every_offending_key():
    avail = {"a": TensorSpec("float32", (2,)), "b": TensorSpec("float32", (3,)), "c": TensorSpec("int64", (1,))}
    want = LocalLoadPlan(0, {"a": TensorSpec("float32", (2,)), "b": TensorSpec("float32", (4,)),
                             "c": TensorSpec("float32", (1,)), "z": TensorSpec("float32", (1,))}, (), ("v",))
    with pytest.raises(CheckpointError) as e:
        check_requests(avail, {"u": 1}, [want])
    msg = str(e.value)
    for part in ("missing from the checkpoint (2): v, z", "not in the state dict (1): u",
                 "b: checkpoint has shape [3], rank 0 wants [4]", "c: checkpoint has dtype int64, rank 0 wants float32"):
        assert part in msg
    check_requests(avail, {"u": 1}, [LocalLoadPlan(0, {"a": TensorSpec("float32", (2,))}, (), (), strict=False)])
