"""CheckpointPipeline(save_options=..., load_options=...): the saves to tier 0 follow them, the
later tiers receive (and verify) the same files, and a load reads with them. Two local tiers,
the in-process driver."""
from __future__ import annotations

import pytest

import raydcp
from raydcp.errors import CheckpointError
from raydcp.options import IOOptions, LoadOptions, SaveOptions
from raydcp.pipeline import CheckpointPipeline

from .helpers import FAST_RETRY, assert_same, files_of, make_state, zeros_like_state


def pipeline(tmp_path, **kw) -> CheckpointPipeline:
    return CheckpointPipeline([str(tmp_path / "fast"), str(tmp_path / "slow")], driver="local", retry=FAST_RETRY,
                              max_parallel=2, **kw)


@pytest.mark.parametrize("async_save, compression", [(False, None), (True, None), (False, "zstd"), (True, "lz4")])
def test_the_pipeline_saves_with_its_save_options(tmp_path, async_save, compression):
    state = make_state(n=6, numel=4096)  # 16 KiB per weight
    for w in state["model"].values():  # bytes that compress: a few distinct values
        w.copy_(w.round())
    p = pipeline(tmp_path, async_save=async_save,
                 save_options=SaveOptions(max_file_bytes=20 << 10, compression=compression),
                 load_options=LoadOptions(io=IOOptions(read_threads=1)))
    try:
        md = p.save(state, "step-1").result(60)
        record = p.wait("step-1", timeout=60)
        # the copy on tier 1 is verified too: its checksums cover the stored (compressed) bytes
        assert record.state == "complete", [(e.key, e.error) for e in record.failures()]
        assert "verified@1" in [e.key for e in record.stages]
        assert len(md.files) >= 6  # one weight per file under the 20 KiB cap
        assert (compression in md.compressions) if compression else md.compressions == {}
        fast, slow = files_of(str(tmp_path / "fast" / "step-1")), files_of(str(tmp_path / "slow" / "step-1"))
        assert all(slow[n] == b for n, b in fast.items())
        back = zeros_like_state(state)
        result = p.load(back, "step-1")
        assert_same(state, back) and result.tier == 0
    finally:
        p.close()
    slow_md = raydcp.read_metadata(tmp_path / "slow" / "step-1")
    assert len(slow_md.files) == len(md.files) and slow_md.compressions == md.compressions


def test_the_pipeline_refuses_options_of_the_wrong_kind(tmp_path):
    with pytest.raises(CheckpointError, match="save_options must be a raydcp.SaveOptions"):
        pipeline(tmp_path, save_options=LoadOptions(), resume=False)
    with pytest.raises(CheckpointError, match="load_options must be a raydcp.LoadOptions"):
        pipeline(tmp_path, load_options=IOOptions(), resume=False)
