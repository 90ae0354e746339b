"""The checkpoint pipeline: stages, storage tiers, post-commit steps and a durable status record.

A checkpoint goes staged -> persisted -> committed (tier 0) -> replicated -> committed (each
further tier) -> verified -> exported -> hooks -> retained or pruned, each stage recorded in the
JSON status record ``raydcp.status.json`` beside ``raydcp.meta`` in every copy (docs/pipeline.md).

- :class:`CheckpointPipeline`: save / load / status / wait / resume / retry;
- pure parts, usable without Ray or storage: :mod:`.status` (record schema, encoding, state
  machine), :mod:`.policy` (tiers, retention, retries, load order);
- :class:`PipelineDriver` (in :mod:`.driver`): the coordinator as a plain class; the Ray actor
  lives in :mod:`raydcp.runtime.pipeline_actor`, which the API layer picks
  (:func:`raydcp.api.pipeline_driver`) when Ray is used.
"""
from __future__ import annotations


from ..lazy import lazy_attribute
from .policy import CopyInfo, Candidate, Retention, RetryPolicy, Tier, load_order
from .status import STATUS_NAME, StageEntry, StatusRecord, TierCopy, decode_status, encode_status

__all__ = ["CheckpointPipeline", "PipelineSave", "LoadResult", "PipelineConfig", "PipelineDriver", "Tier",
           "Retention", "RetryPolicy", "Candidate", "CopyInfo", "load_order", "STATUS_NAME", "StageEntry",
           "StatusRecord", "TierCopy", "encode_status", "decode_status", "read_status"]

_LAZY = {
    "CheckpointPipeline": ".api", "PipelineSave": ".api", "LoadResult": ".api",
    "PipelineConfig": ".config", "PipelineDriver": ".driver",
}


def __getattr__(name: str):
    return lazy_attribute(__name__, _LAZY, name)


def read_status(checkpoint, storage_options: dict | None = None) -> StatusRecord | None:
    """The status record in one copy of a checkpoint (None if it has none)."""
    from ..storage import CheckpointStorage
    from .record_files import read_record

    return read_record(CheckpointStorage(checkpoint, storage_options))
