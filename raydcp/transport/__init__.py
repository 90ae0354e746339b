"""The one seam through which the ranks of a collective save or load talk.

- :mod:`~raydcp.transport.interface`: the :class:`Transport` protocol and its call
  sequence (``reduce_scatter``, ``exchange``), :func:`run_reduce` and :func:`unwrap`,
  which every implementation reduces and answers with;
- :mod:`~raydcp.transport.local`: the in-process :class:`LocalTransport` and
  :class:`ThreadTransport` (the Ray transport lives in ``raydcp.runtime``);
- :mod:`~raydcp.transport.wire`: :func:`encode` / :func:`decode`, control-plane values
  as a :class:`Wire` where they cross processes.
"""
from .interface import Reusing, Transport, run_reduce, unwrap
from .local import LocalTransport, ThreadTransport
from .wire import Wire, decode, encode

__all__ = ["Transport", "LocalTransport", "ThreadTransport", "Reusing", "run_reduce", "unwrap", "Wire", "encode", "decode"]
