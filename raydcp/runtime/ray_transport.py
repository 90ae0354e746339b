"""``RayTransport``: the transport protocol of ``raydcp.transport`` over Ray.

Ranks are Ray actors or tasks (or the driver); the control plane goes through
one coordinator per operation (``raydcp.runtime.coordinator``), hosted by one
long-lived actor per group, the data plane through Ray's object store:

1. ``RayTransport(group, op)`` (from :func:`open_transport`, which numbers the
   operation, :mod:`raydcp.runtime.groups`) gets or creates
   the group's coordinator host ``raydcp:<group>`` in namespace ``raydcp`` (the
   first rank to get there creates it; later operations reuse it, so an
   operation costs no actor start); the host makes operation ``op``'s
   coordinator on its first call.
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
   answer (the next operation of the group checks it); when every rank closed,
   the host drops the operation's coordinator (a failed one is remembered for
   ``timeout_s``, so a late rank learns at once that the others ended it).

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
from ..transport import Transport, _unwrap, decode, encode, run_reduce
from . import actors
from .groups import next_operation

__all__ = ["RayTransport", "open_transport"]

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


# group name -> the ObjectRef of this process's last close() to that group's coordinator host
_LAST_CLOSE: dict[str, ray.ObjectRef] = {}


def _check_last_close(group_name: str) -> None:
    """If this process's last close to the group's host found it dead, forget the host (a new one is made)."""
    ref = _LAST_CLOSE.get(group_name)
    if ref is None:
        return
    ready, _ = ray.wait([ref], timeout=0)
    if not ready:
        return
    del _LAST_CLOSE[group_name]
    try:
        ray.get(ref, timeout=0)
    except rex.RayActorError:  # the host died (its creator's process ended)
        actors.forget_coordinator(group_name)
    except Exception:
        pass


def open_transport(group: Group, *, host: str | None = None) -> "RayTransport":
    """The transport of this rank's next operation of ``group`` (numbered per process)."""
    return RayTransport(group, next_operation(group), host=host)


class RayTransport(Transport):
    """The transport of operation ``op`` of a :class:`raydcp.Group` whose ranks run on Ray.

    ``host``: run the operation in the coordinator host of that (long-lived) group name rather
    than in the group's own: a ShardGroup runs each operation under a fresh group name and all
    of them in one host, started once.
    """

    def __init__(self, group: Group, op: int, *, host: str | None = None):
        self.group = group
        # A group hosted by another group's host is told apart there by its name.
        self._host_name = host or group.name
        self.op = op if host is None else (group.name, op)
        self.rank = group.rank
        self.world_size = group.world_size
        self._timeout_s = float(group.timeout_s)
        self._seq = 0
        self._held: list[ray.ObjectRef] = []
        self._closed = False
        self._creator: int | None = None
        self._coord = None
        if self.world_size > 1:
            _check_last_close(self._host_name)
            self._coord = actors.get_or_create_coordinator(self._host_name, self.world_size, self.rank)

    @property
    def coordinator_name(self) -> str:
        return actors.coordinator_name(self._host_name)

    @property
    def _op_number(self) -> int:
        return self.op[1] if isinstance(self.op, tuple) else self.op

    # -- control plane --------------------------------------------------------
    def reduce_scatter(self, step, local, reduce_fn):
        self._check_open(step)
        self._seq += 1
        if self._coord is None:
            value = run_reduce(step, [local], reduce_fn)[0]
        else:
            value = self._call(step, "reduce_scatter", local, reduce_fn)
        out = _unwrap(value)
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
        inbox = _unwrap(self._call(step, "exchange", payload))
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
            # no wait for the answer (a round trip per operation): the next operation of the group checks it
            _LAST_CLOSE[self._host_name] = coord.close.remote(self.op, self.rank)
        except Exception:  # unreachable: nothing to release
            pass

    # -- helpers ----------------------------------------------------------------
    def _check_open(self, step):
        if self._closed:
            raise CheckpointError(
                f"{step}: the transport of group '{self.group.name}' operation {self._op_number} is closed")

    def _call(self, step: str, method: str, value, *args):
        """One call to the coordinator: returns the rank's value (possibly a CheckpointError)."""
        remote = getattr(self._coord, method).remote
        if method == "reduce_scatter":  # exchange values hold ObjectRefs: Ray must see those itself
            try:
                value = encode(value)
            except Exception:  # Ray's own pickling may still manage, or says why not below
                pass
        try:
            ref = remote(self.op, self._timeout_s, self.rank, self.world_size, self._seq, step, value, *args)
        except Exception as exc:  # the value could not be serialized: still take part, as a failure
            failure = RankFailure(self.rank, f"could not send its value to the coordinator: {type(exc).__name__}: {exc}")
            extra = (None,) if method == "reduce_scatter" else ()  # a failure never reaches reduce_fn
            ref = remote(self.op, self._timeout_s, self.rank, self.world_size, self._seq, step, failure, *extra)
        try:
            self._creator, value = ray.get(ref, timeout=self._timeout_s + _REPLY_GRACE_S)
            return decode(value)
        except rex.GetTimeoutError:
            return CoordinatorLostError(
                f"{step}: the coordinator {self.coordinator_name!r} did not answer rank {self.rank} within "
                f"{self._timeout_s + _REPLY_GRACE_S:g}s; is the Ray cluster overloaded?"
            )
        except rex.RayActorError as exc:
            actors.forget_coordinator(self._host_name)
            return self._coordinator_died(step, exc)
        except rex.RayTaskError as exc:
            return CheckpointError(f"{step}: the coordinator {self.coordinator_name!r} failed: {exc}")

    def _coordinator_died(self, step: str, exc: BaseException) -> CoordinatorLostError:
        where = f"group '{self.group.name}' (operation {self._op_number})"
        cause = str(exc)
        if "killed by `ray.kill`" in cause or "killed by ray.kill" in cause:
            # The other ranks closed the operation without this rank: it failed while this rank was late.
            return CoordinatorLostError(
                f"{step}: the coordinator of {where} is gone: the other ranks already ended the operation "
                f"(it failed while rank {self.rank} was late; see their errors), or it was killed"
            )
        if "owner has died" in cause:
            if self._creator is not None and self._creator != self.rank:
                msg = (
                    f"{step}: the coordinator of {where} died with the rank that created it: rank "
                    f"{self._creator} died; check rank {self._creator}'s log"
                )
                return CoordinatorLostError(msg, dead_rank=self._creator, failures={self._creator: "died (its coordinator died with it)"})
            return CoordinatorLostError(
                f"{step}: the coordinator of {where} died with the rank that created it, which died "
                f"before rank {self.rank} learned which rank that was; check the ranks' logs"
            )
        return CoordinatorLostError(
            f"{step}: the coordinator of {where} died (rank {self.rank} was waiting); a rank or node of the "
            f"group probably died; check the ranks' logs ({cause.splitlines()[-1] if cause else type(exc).__name__})"
        )
