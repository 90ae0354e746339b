"""This process's connection to a Ray cluster: made where raydcp needs one, and known per session.

1. :func:`connect` joins the cluster a ``raymem://`` (or ``raynode://``) path lives in when this
   process is not connected yet: ``RAY_ADDRESS`` where it is set, else the running local one
   (:func:`cluster_address`). An address that does not answer fails within the caller's
   ``timeout_s`` with a :class:`~raydcp.errors.CheckpointError` naming it, rather than Ray
   retrying for minutes: :func:`unreachable` probes it first (also for the memory tier's
   operator commands, :func:`raydcp.runtime.memstore.admin.connect`).
   Nothing process-wide is changed: not ``RAY_ADDRESS``, not any other variable (a later
   ``ray.init(num_cpus=...)`` of the caller's own is not refused because of raydcp).
2. :func:`session` names the connection now in use. Actor handles belong to the session that
   made them: after ``ray.shutdown()`` and ``ray.init()`` in the same process every cached
   handle is stale, so the modules that cache handles (the memory tier's holders, the
   coordinator host) keep them per session and look the detached actors up again by name.
3. :func:`helper_environment` gives a helper process that this process starts (an async save's
   persister) what it needs to reach the same cluster, in its own environment only.
"""
from __future__ import annotations

import logging
import os
import socket

import ray

from ..engine.persist import add_helper_environment
from ..errors import CheckpointError

__all__ = ["ADDRESS_ENV", "connect", "cluster_address", "unreachable", "session", "helper_environment"]

ADDRESS_ENV = "RAY_ADDRESS"


def session() -> tuple[str, str, str] | None:
    """The connection in use (cluster, job, node), or None where this process is not connected."""
    if not ray.is_initialized():
        return None
    ctx = ray.get_runtime_context()
    return ctx.gcs_address, ctx.get_job_id(), ctx.get_node_id()


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of an explicit address (``host:port``, ``ray://host:port``); None for
    Ray's own words (``auto``, ``local``) and anything else it resolves itself."""
    bare = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = bare.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def cluster_address(address: str | None = None) -> str:
    """The address to join: ``address`` where given, else ``RAY_ADDRESS``, else ``auto`` (the
    running local cluster)."""
    return address or os.environ.get(ADDRESS_ENV) or "auto"


def unreachable(address: str, timeout_s: float) -> str | None:
    """Why nothing answers at ``address`` (a TCP connection to it, within ``timeout_s``), in words
    for a message that names the address; None where something listens or the address is not
    one to probe (``auto``, ``local``: Ray resolves them on this machine)."""
    target = _host_port(address)
    if target is None:
        return None
    try:
        with socket.create_connection(target, timeout=max(timeout_s, 0.001)):
            return None
    except socket.timeout:
        return "no answer"
    except ConnectionRefusedError:
        return "connection refused: nothing listens there"
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def connect(url: str, timeout_s: float) -> None:
    """Step 1: connect this process to the Ray cluster of ``url`` if it is not connected yet."""
    if ray.is_initialized():
        return
    address = cluster_address()
    source = f"{ADDRESS_ENV}={address}" if address != "auto" else "the running local cluster (address 'auto')"
    why = unreachable(address, timeout_s)
    if why is not None:
        raise CheckpointError(
            f"{url}: raymem:// checkpoints live in a Ray cluster's memory, and the cluster at {address} (from "
            f"{ADDRESS_ENV}) does not answer ({why}, within {timeout_s:g}s): it is not running, or not reachable "
            f"from here; start it, or point {ADDRESS_ENV} at a running cluster's address")
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
    except Exception as exc:
        raise CheckpointError(
            f"{url}: raymem:// checkpoints live in a Ray cluster's memory, and no cluster is reachable from this "
            f"process through {source} ({type(exc).__name__}: {exc}); run where the cluster is (a Ray job, a Ray "
            f"worker, or a machine with `ray start` running), or set {ADDRESS_ENV}") from exc


def helper_environment() -> dict[str, str]:
    """Step 3: the variables a helper process needs to reach this process's cluster (none where
    this process is not connected)."""
    now = session()
    return {} if now is None else {ADDRESS_ENV: now[0]}


add_helper_environment(helper_environment)
