"""Joint reads: a large stored chunk that several ranks need in disjoint parts covering it is not
read by one rank and forwarded; each rank reads its own part (the rule, shared by the array and
the object paths of the load planner, and the regrouping of the array path's pairs)."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from .boxes import byte_runs, merge_runs

# stored chunks from this size on are read part by part by the ranks that need the parts
SPLIT_MIN_BYTES = 1 << 20
MAX_JOINT_RUNS = 16  # byte runs one rank may read of a split chunk


def splits_jointly(rank_runs: Mapping[int, list], nbytes: int) -> bool:
    """Whether the byte runs the ranks need of one chunk overlap nowhere across ranks and
    together cover the whole chunk (so every checksum block is verified by its readers)."""
    merged = [merge_runs(runs) for runs in rank_runs.values()]
    if any(len(runs) > MAX_JOINT_RUNS for runs in merged):
        return False  # interleaved parts (a column split): one reader, fewer and larger reads
    return sum(e - s for runs in merged for s, e in runs) == nbytes and \
        merge_runs([r for runs in merged for r in runs]) == [(0, nbytes)]


def split_large_chunks(sp, sp_heads, sp_chunk, sp_count, p_rank, s_nbytes, live_chunk, boxes,
                        s_off, s_size, s_key, nd_key, isz):
    """Regroup the pairs of every large stored chunk that several ranks need in disjoint parts
    covering it: one group per rank (in the order the ranks first appear), so each rank reads its
    own part. Also returns, per group, whether it is such a part (a joint read)."""
    cand = np.flatnonzero((s_nbytes[sp_chunk] >= SPLIT_MIN_BYTES) & ~live_chunk[sp_chunk] & (sp_count > 1))
    splits: dict[int, list[list[int]]] = {}
    for j in cand.tolist():
        grp = sp[sp_heads[j]:sp_heads[j] + sp_count[j]]
        ranks = p_rank[grp]
        if (ranks == ranks[0]).all():
            continue
        c = int(sp_chunk[j])
        k = int(s_key[c])
        nd = max(int(nd_key[k]), 0)
        co, cs = tuple(s_off[c, :nd].tolist()), tuple(s_size[c, :nd].tolist())
        glo, gsz = boxes(grp)
        by_rank: dict[int, list[int]] = {}
        runs: dict[int, list] = {}
        for x, r, o, z in zip(grp.tolist(), ranks.tolist(), glo.tolist(), gsz.tolist()):
            by_rank.setdefault(r, []).append(x)
            runs.setdefault(r, []).extend(byte_runs(co, cs, tuple(o[:nd]), tuple(z[:nd]), int(isz[k])))
        if splits_jointly(runs, int(s_nbytes[c])):
            splits[j] = list(by_rank.values())
    if not splits:
        return sp, sp_heads, sp_chunk, sp_count, np.zeros(len(sp_heads), bool)
    groups: list = []
    chunks: list[int] = []
    joint: list[bool] = []
    for j in range(len(sp_heads)):
        parts = splits.get(j) or [sp[sp_heads[j]:sp_heads[j] + sp_count[j]].tolist()]
        groups += parts
        chunks += [int(sp_chunk[j])] * len(parts)
        joint += [j in splits] * len(parts)
    count = np.array([len(g) for g in groups], np.int64)
    heads = np.zeros(len(groups), np.int64)
    np.cumsum(count[:-1], out=heads[1:])
    return (np.array([x for g in groups for x in g], np.int64), heads, np.array(chunks, np.int64), count,
            np.array(joint, bool))
