"""``RayTransport``: the transport protocol of ``raydcp.transport`` over Ray.

Ranks are Ray actors or tasks (or the driver); the control plane goes through
one coordinator per operation (``raydcp.runtime.coordinator``), all of them run
by the cluster's one coordinator host (``raydcp.runtime.coordinator_host``), the
data plane through Ray's object store:

1. ``RayTransport(group, op)`` (from :func:`open_transport`, which numbers the
   operation, :mod:`raydcp.runtime.operations`) takes this process's handle of the
   host (:func:`raydcp.runtime.actors.coordinator_host`: looked up once per
   process, started if none runs); the host makes operation ``op``'s coordinator
   on its first call, so a new group costs no actor start. Every call of the
   operation goes to that one host, with the operation's caller (the process that
   numbered it; the first call also carries the object by which the host can tell
   whether that process lives): the host tells a group's restarted ranks from a
   second caller by it (:mod:`raydcp.runtime.coordinator_host`, step 2).
2. ``reduce_scatter``: the rank sends its value to the coordinator and blocks on
   the reply; the coordinator bounds the wait by ``group.timeout_s``. Values and
   replies travel as ``raydcp.transport.Wire`` (plans as their columns; one
   bytes object for Ray to carry), or as themselves where that pickling fails.
3. ``exchange``: the sender puts the buffers for each destination into the
   object store as one list of Arrow buffers and sends only the ObjectRefs, with
   the tags, (nested in lists, so Ray does not resolve them on the way) through
   the coordinator; each receiver fetches all of its refs with one ``ray.get``
   and gets zero-copy ``pyarrow.Buffer`` views of shared memory (buffers to
   itself skip the object store). The sender keeps
   the refs, and so the objects, alive until its next ``reduce_scatter`` returns.
4. ``close`` drops the refs and tells the coordinator without waiting for its
   answer; when every rank closed, the host drops the operation's coordinator.

If the host dies (killed, its process or node lost), every rank's call in flight,
and every later call of the operation, fails with a ``CoordinatorLostError`` at
once; a new host takes over (the first rank to look for one starts it), so the
group's next operation works. A rank whose *first* call finds the host dead
retries that call on the new host: the old one cannot have started the operation
with it, so the operation goes on there (a rank that had got further fails it
there, at once: :mod:`raydcp.runtime.coordinator`, step 1).

A group of one rank needs no coordinator and runs everything in-process.
"""
from __future__ import annotations

from typing import Any

import pyarrow as pa
import ray
import torch
from ray import exceptions as rex

from ..errors import CheckpointError, CoordinatorLostError, RankFailure
from ..group import Group
from ..transport import Transport, decode, encode, run_reduce, unwrap
from . import actors
from .operations import Operation, next_operation, this_caller

__all__ = ["RayTransport", "open_transport"]

# Attempts of a rank's first call of an operation where it finds the host dead (a stale handle
# of a host that was killed or lost: the name may take a moment to be free for a new one).
_FIRST_CALL_ATTEMPTS = 3

# Slack on top of timeout_s for the driver-side wait on the coordinator, which
# itself answers within timeout_s of a rank's arrival; this only catches a
# coordinator that cannot answer at all (e.g. never scheduled).
_REPLY_GRACE_S = 30.0


def _as_buffer(buf: Any) -> pa.Buffer:
    """A zero-copy Arrow view of a contiguous uint8 host tensor (copied to host if needed)."""
    if isinstance(buf, torch.Tensor):
        t = buf.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous().reshape(-1)
        if t.dtype != torch.uint8:
            t = t.view(torch.uint8)
        return pa.py_buffer(t.numpy())
    return pa.py_buffer(buf)


def open_transport(group: Group, *, host: str | None = None, survivors: bool = False,
                   leaving: dict | None = None) -> "RayTransport":
    """The transport of this rank's next operation of ``group`` (numbered per process).
    ``survivors``: the operation goes on without ranks found lost (a survivors save); ``leaving``:
    the ranks announced to go, by node (``SaveOptions.leaving``)."""
    return RayTransport(group, next_operation(group), host=host, survivors=survivors, leaving=leaving)


class RayTransport(Transport):
    """The transport of operation ``op`` of a :class:`raydcp.Group` whose ranks run on Ray.

    ``op``: the operation's number in this process, or an :class:`~raydcp.runtime.operations.Operation`
    that another process numbered (a rank's persister runs the rank's async saves).
    ``host``: the owner of the operation's state in the coordinator host, where it is not the
    group itself: a ShardGroup runs each operation under a fresh group name and releases all
    of them, by its own name, when it shuts down. ``survivors``: every call says the operation goes
    on without ranks the host finds lost (their values stand in as ``raydcp.errors.RankLost``);
    ``leaving`` (``{node id: ranks}``, a survivors operation's): ranks announced to go, which the host
    finds lost as soon as their node is gone, whether or not they called.
    """

    def __init__(self, group: Group, op: int | Operation, *, host: str | None = None, survivors: bool = False,
                 leaving: dict | None = None):
        number, caller = op if isinstance(op, Operation) else (op, this_caller(ray_group=group.world_size > 1))
        self.group = group
        self.op = number
        self._key = (host or group.name, group.name, number)
        self.rank = group.rank
        self.world_size = group.world_size
        self._timeout_s = float(group.timeout_s)
        self._seq = 0
        self._held: list[ray.ObjectRef] = []
        self._closed = False
        self._coord = None
        if self.world_size > 1:
            self._coord = actors.coordinator_host()
            if caller.alive is None and caller.id == this_caller(ray_group=False).id:
                caller = this_caller()  # numbered here before Ray was connected
        self._caller, self._named = caller, caller.named()
        self._extra: dict[str, Any] = {"survivors": True} if survivors else {}
        if survivors and leaving:
            self._extra["leaving"] = {str(node): tuple(ranks) for node, ranks in leaving.items()}

    @property
    def coordinator_name(self) -> str:
        return actors.host_name()

    # -- control plane --------------------------------------------------------
    def reduce_scatter(self, step, local, reduce_fn, *, optional=()):
        """``optional`` (a survivors operation's): ranks the round does not wait for; it completes once
        every other rank arrived, each of these missing then standing in as a ``RankLost`` (one that
        comes later gets its reply all the same). Every rank passes the same."""
        self._check_open(step)
        self._seq += 1
        if self._coord is None:
            value = run_reduce(step, [local], reduce_fn)[0]
        else:
            value = self._call(step, "reduce_scatter", local, reduce_fn,
                               extra={"optional": tuple(sorted(optional))} if optional else None)
        out = unwrap(value)
        # Every rank passed this barrier, so every consumer has copied what we sent.
        self._held.clear()
        return out

    # -- data plane -----------------------------------------------------------
    def exchange(self, step, outgoing):
        self._check_open(step)
        self._seq += 1
        if self._coord is None:
            bad = [d for d in outgoing if d != 0]
            if bad:
                raise CheckpointError(f"{step}: destination ranks {bad} do not exist in a group of 1")
            return [(tag, _as_buffer(buf)) for tag, buf in outgoing.get(0, [])]

        to_self: list[list[pa.Buffer]] = []
        try:
            routed: dict[int, list] = {}
            for dest, items in outgoing.items():
                if not items:
                    continue
                # one object per destination (not per buffer): a put, a ref and a fetch per peer
                tags, bufs = tuple(tag for tag, _ in items), [_as_buffer(buf) for _, buf in items]
                if dest == self.rank:
                    to_self.append(bufs)
                    routed[dest] = [(tags, None)]
                else:
                    ref = ray.put(bufs)
                    self._held.append(ref)
                    routed[dest] = [(tags, ref)]
            payload: Any = routed
        except Exception as exc:  # e.g. object store full: fail every rank together, not by timeout
            payload = RankFailure.from_exception(self.rank, exc)
        inbox = unwrap(self._call(step, "exchange", payload))
        return self._fetch(step, inbox, to_self)

    def _fetch(self, step, inbox, to_self):
        """The (tag, buffer) pairs of ``inbox``, whose entries are (source, tags, ref of their buffers)."""
        remote = [(src, ref) for src, _, ref in inbox if src != self.rank]
        try:
            fetched = ray.get([ref for _, ref in remote], timeout=self._timeout_s) if remote else []
        except (rex.GetTimeoutError, rex.RayError) as exc:
            raise self._fetch_error(step, remote, exc) from None
        fetched_it, self_it = iter(fetched), iter(to_self)
        out = []
        for src, tags, _ in inbox:
            bufs = next(self_it) if src == self.rank else next(fetched_it)
            if len(bufs) != len(tags):
                raise CheckpointError(f"{step}: rank {self.rank} got {len(bufs)} buffers from rank {src} for "
                                      f"{len(tags)} tags")
            out.extend(zip(tags, bufs))
        return out

    def _fetch_error(self, step, remote, exc) -> CheckpointError:
        # Find which senders' buffers are unavailable, to name them.
        bad = []
        for src in sorted({s for s, _ in remote}):
            refs = [r for s, r in remote if s == src]
            try:
                ray.get(refs, timeout=1.0)
            except Exception:
                bad.append(src)
        kind = "did not arrive within %gs" % self._timeout_s if isinstance(exc, rex.GetTimeoutError) else "are lost"
        msg = (
            f"{step}: rank {self.rank} of group '{self.group.name}' could not fetch buffers from ranks "
            f"{bad or sorted({s for s, _ in remote})}: they {kind} (a sending rank probably died or its node "
            f"is unreachable; {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        )
        return CheckpointError(msg, {r: "buffers unavailable" for r in bad})

    # -- end ------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._held.clear()
        if self._coord is None:
            return
        coord, self._coord = self._coord, None
        try:
            coord.close.remote(self._key, self.rank, self._named)  # no wait for the answer: a round trip per operation
        except Exception:  # unreachable: nothing to release
            pass

    # -- helpers ----------------------------------------------------------------
    def _check_open(self, step):
        if self._closed:
            raise CheckpointError(
                f"{step}: the transport of group '{self.group.name}' operation {self.op} is closed")

    def _call(self, step: str, method: str, value, *args, extra: dict | None = None):
        """One call to the coordinator: returns the rank's value (possibly a CheckpointError)."""
        if method == "reduce_scatter":  # exchange values hold ObjectRefs: Ray must see those itself
            try:
                value = encode(value)
            except Exception:  # Ray's own pickling may still manage, or says why not below
                pass
        for attempt in range(_FIRST_CALL_ATTEMPTS):
            ref = self._submit(step, method, value, args, extra)
            try:
                return decode(ray.get(ref, timeout=self._timeout_s + _REPLY_GRACE_S))
            except rex.GetTimeoutError:
                return CoordinatorLostError(
                    f"{step}: the coordinator host {self.coordinator_name!r} did not answer rank {self.rank} of "
                    f"group '{self.group.name}' within {self._timeout_s + _REPLY_GRACE_S:g}s; is the Ray cluster "
                    "overloaded?")
            except rex.ActorDiedError as exc:
                actors.forget_host(self._coord)
                if self._seq != 1 or attempt + 1 == _FIRST_CALL_ATTEMPTS:
                    return self._host_died(step, exc)
                # this rank's first call: the dead host cannot have started the operation with it
                self._coord = actors.coordinator_host()
            except rex.RayActorError as exc:
                actors.forget_host(self._coord)
                return self._host_died(step, exc)
            except rex.RayTaskError as exc:
                return CheckpointError(f"{step}: the coordinator host {self.coordinator_name!r} failed: {exc}")

    def _submit(self, step: str, method: str, value, args, extra: dict | None = None) -> ray.ObjectRef:
        remote = getattr(self._coord, method).remote
        head = (self._key, self._timeout_s, self.rank, self.world_size, self._seq, step)
        caller = self._caller if self._seq == 1 else self._named  # the host binds the rank on its first call
        kwargs = {**self._extra, **(extra or {})}
        try:
            return remote(*head, value, *args, caller=caller, **kwargs)
        except Exception as exc:  # the value could not be serialized: still take part, as a failure
            failure = RankFailure(self.rank, f"could not send its value to the coordinator: {type(exc).__name__}: {exc}")
            no_fn = (None,) if method == "reduce_scatter" else ()  # a failure never reaches reduce_fn
            return remote(*head, failure, *no_fn, caller=caller, **kwargs)

    def _host_died(self, step: str, exc: BaseException) -> CoordinatorLostError:
        cause = str(exc).strip().splitlines()
        return CoordinatorLostError(
            f"{step}: the coordinator host {self.coordinator_name!r} died while rank {self.rank} of group "
            f"'{self.group.name}' was in operation {self.op} (it was killed, or its process or node died), so the "
            "operation fails on every rank; a save either committed whole or not at all, so run it again: the "
            f"next operation starts a new host ({type(exc).__name__}: {cause[-1] if cause else ''})"
        )
