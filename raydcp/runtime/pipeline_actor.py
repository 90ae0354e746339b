"""The pipeline coordinator on Ray: the driver as a named actor, its work as Ray tasks.

``RemoteDriver.start(config)`` gets or creates the coordinator actor of a tier list (one per
cluster and tier list, named ``raydcp-pipeline:<hash>`` in namespace ``raydcp``). The actor is
:class:`raydcp.pipeline.driver.PipelineDriver` with :class:`RayRunner`: replication segments run
as Ray tasks (``num_cpus=0``, at most ``max_parallel`` at a time) placed on the node that wrote
tier 0 (soft affinity), hooks that are Ray remote functions run as tasks, other hooks in the actor.
Ray restarts a crashed actor up to ``max_restarts`` times; each new instance resumes every
unfinished pipeline from the status records.
"""
from __future__ import annotations

import functools
import hashlib
import json
import uuid
from typing import Any, Callable, Sequence

import ray
from ray import exceptions as rex
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..errors import CheckpointError, CoordinatorLostError
from ..pipeline.config import PipelineConfig
from ..pipeline.driver import PipelineDriver
from ..pipeline.status import StatusRecord

__all__ = ["RayRunner", "PipelineCoordinator", "RemoteDriver", "current_node_id", "driver_name"]

NAMESPACE = "raydcp"


def current_node_id() -> str:
    return ray.get_runtime_context().get_node_id()


def _cause(exc: BaseException) -> BaseException:
    if isinstance(exc, rex.RayTaskError):
        cause = exc.cause
        if isinstance(cause, CheckpointError):
            return cause
        return CheckpointError(f"{type(cause).__name__}: {cause}")
    if isinstance(exc, rex.RayActorError):
        return CoordinatorLostError(f"the pipeline coordinator actor died ({type(exc).__name__}); a new one resumes "
                               "from the status records")
    return exc


@functools.lru_cache(maxsize=None)
def _remote(fn: Callable) -> Any:
    return ray.remote(num_cpus=0, max_retries=0)(fn)


class RayRunner:
    """Runs the driver's work items as Ray tasks near the data (see the Runner protocol)."""

    def __init__(self, max_parallel: int = 8):
        self.max_parallel = max_parallel

    def map(self, fn, items: Sequence[Any], on_result=None, *, node_id: str | None = None) -> list:
        remote = _remote(fn)
        if node_id:
            remote = remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=True))
        results: list = [None] * len(items)
        pending: dict[Any, int] = {}
        todo = iter(enumerate(items))
        try:
            while True:
                while len(pending) < self.max_parallel:
                    nxt = next(todo, None)
                    if nxt is None:
                        break
                    pending[remote.remote(nxt[1])] = nxt[0]
                if not pending:
                    return results
                ready, _ = ray.wait(list(pending), num_returns=1)
                i = pending.pop(ready[0])
                try:
                    results[i] = ray.get(ready[0])
                except rex.RayError as exc:
                    raise _cause(exc) from None
                if on_result is not None:
                    on_result(results[i])
        finally:
            for ref in pending:
                try:
                    ray.cancel(ref)
                except Exception:
                    pass

    def call_hook(self, hook, info: dict) -> None:
        if hasattr(hook, "remote"):
            try:
                ray.get(hook.remote(info))
            except rex.RayError as exc:
                raise _cause(exc) from None
        else:
            hook(info)

    def close(self) -> None:
        pass


class PipelineCoordinator(PipelineDriver):
    """The driver as an actor (resumes unfinished pipelines when it starts or restarts)."""

    def __init__(self, config: PipelineConfig, creator: str = ""):
        self._creator = creator
        super().__init__(config, RayRunner(config.max_parallel))

    def ping(self) -> str:
        """The token of the process that created this actor (get_if_exists may return another's)."""
        return self._creator


_CoordinatorRemote = ray.remote(PipelineCoordinator)


def driver_name(config: PipelineConfig) -> str:
    """One coordinator per tier list and plain options (hooks and callbacks excluded)."""
    ident = json.dumps([[t.url, t.retention and [t.retention.keep_last, t.retention.keep_every]] for t in config.tiers]
                       + [config.verify, config.export, config.export_tier])
    return "raydcp-pipeline:" + hashlib.sha1(ident.encode()).hexdigest()[:16]


class RemoteDriver:
    """The driver API (submit, resume, retry, status, progress, wait, wait_idle, shutdown) over
    the coordinator actor, with Ray errors turned into CheckpointError."""

    def __init__(self, handle, owner: bool = False):
        self.handle = handle
        self.owner = owner  # this process created the actor: shutdown() stops it

    @classmethod
    def start(cls, config: PipelineConfig, *, max_restarts: int = 3) -> "RemoteDriver":
        token = uuid.uuid4().hex
        handle = _CoordinatorRemote.options(
            name=driver_name(config), namespace=NAMESPACE, get_if_exists=True, num_cpus=0,
            max_concurrency=64, max_restarts=max_restarts, max_task_retries=3,
        ).remote(config, token)
        driver = cls(handle)
        driver.owner = driver._call("ping") == token
        return driver

    def _call(self, method: str, *args, **kwargs):
        try:
            return ray.get(getattr(self.handle, method).remote(*args, **kwargs))
        except rex.RayError as exc:
            raise _cause(exc) from None

    def submit(self, name: str, record: StatusRecord | None = None) -> None:
        self._call("submit", name, record)

    def resume(self, name: str | None = None) -> list[str]:
        return self._call("resume", name)

    def retry(self, name: str) -> list[str]:
        return self._call("retry", name)

    def status(self, name: str) -> StatusRecord:
        return self._call("status", name)

    def progress(self, name: str) -> dict:
        return self._call("progress", name)

    def wait(self, name: str, timeout: float | None = None) -> StatusRecord:
        return self._call("wait", name, timeout)

    def wait_idle(self, timeout: float | None = None) -> None:
        self._call("wait_idle", timeout)

    def shutdown(self) -> None:
        """Stop the coordinator if this process created it (other users of it keep it)."""
        if not self.owner:
            return
        try:
            self._call("shutdown")
        finally:
            try:
                ray.kill(self.handle, no_restart=True)
            except Exception:
                pass
