"""``DataCursor``: the data position of a run, saved with the model and resumed exactly on any
number of ranks.

The samples of a map-style dataset of ``num_samples`` are read in a *global order*: per epoch ``e``
the permutation ``torch.randperm(num_samples, generator=manual_seed(seed + e))`` (the one
``torch.utils.data.DistributedSampler`` draws), or ``0..num_samples-1`` without shuffling. One
optimizer step consumes the next ``global_batch_size`` samples of that order, whatever the world
size: rank ``r`` of ``W`` takes every ``W``-th of them from position ``r`` (as a
``DistributedSampler`` does, so a run that switches to the cursor sees the samples it saw
before). The cursor's state is global -- the epoch and the samples of it consumed -- so a run
restored on another number of ranks goes on with exactly the samples the uninterrupted run
would have seen next: none skipped, none repeated.

Use::

    cursor = raydcp.data.DataCursor(len(dataset), global_batch_size=64, seed=seed)
    raydcp.train.restore({"train": state, "data": cursor})        # or raydcp.load
    loader = cursor.loader(dataset, rank, world_size)             # a DataLoader over the rest of the epoch
    while not done:
        for batch in loader:                                      # every epoch from where the cursor stands
            ...; optimizer.step(); cursor.step()                  # one global batch consumed
        raydcp.train.save({"train": state, "data": cursor})

``cursor.sampler(rank, world_size)`` is the ``torch.utils.data.Sampler`` alone (for a DataLoader of
your own, or torchdata's ``StatefulDataLoader``: the cursor then holds the position, not the
loader), and ``cursor.batch_indices(rank, world_size)`` the sample indices of this rank's part of
the next global batch (for code that indexes the dataset itself). The cursor moves only when
:meth:`DataCursor.step` is called, never as a loader prefetches.

The end of an epoch: with ``drop_last=True`` (the default) an epoch is its whole global batches
(``num_samples // global_batch_size`` steps), so every step has the same batch on any world size;
with ``drop_last=False`` the last, shorter global batch is taken too, and split between the ranks
as above (ranks may then get one sample more than others).
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

from .errors import CheckpointError

__all__ = ["DataCursor", "CursorSampler"]


def _count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CheckpointError(f"DataCursor: {name} must be an int >= {minimum}, got {value!r}")
    return value


class DataCursor:
    """The position in a run's global sample order (module doc); a Stateful for raydcp's state dicts.

    ``num_samples``: the dataset's length; ``global_batch_size``: the samples one step consumes on
    all ranks together; ``seed`` and ``shuffle`` as for ``DistributedSampler``.
    """

    def __init__(self, num_samples: int, global_batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True):
        self.num_samples = _count("num_samples", num_samples, 1)
        self.global_batch_size = _count("global_batch_size", global_batch_size, 1)
        if self.global_batch_size > self.num_samples and drop_last:
            raise CheckpointError(f"DataCursor: global_batch_size {global_batch_size} is larger than the dataset "
                                  f"({num_samples} samples), so with drop_last=True an epoch has no step")
        self.seed = _count("seed", seed, 0)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.consumed = 0  # samples of this epoch's order consumed (a multiple of global_batch_size)
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, its order), cached

    # -- where the cursor stands ------------------------------------------------------------------
    @property
    def epoch_samples(self) -> int:
        """The samples one epoch consumes (its whole global batches only, with ``drop_last``)."""
        if self.drop_last:
            return self.num_samples - self.num_samples % self.global_batch_size
        return self.num_samples

    @property
    def samples_seen(self) -> int:
        """Samples consumed since the run began."""
        return self.epoch * self.epoch_samples + self.consumed

    def order(self, epoch: int | None = None) -> torch.Tensor:
        """The global sample order of ``epoch`` (the current one by default): sample indices."""
        epoch = self.epoch if epoch is None else epoch
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + epoch)
                order = torch.randperm(self.num_samples, generator=g)
            else:
                order = torch.arange(self.num_samples)
            self._order = (epoch, order[: self.epoch_samples])
        return self._order[1]

    def step(self, samples: int | None = None) -> None:
        """Count one step: ``global_batch_size`` samples consumed (``samples``: the last, shorter
        batch of an epoch without ``drop_last`` counts what it had; by default what is left of it)."""
        left = self.epoch_samples - self.consumed
        n = min(self.global_batch_size, left) if samples is None else _count("samples", samples, 1)
        if n > left:
            raise CheckpointError(f"DataCursor.step({samples}): only {left} samples are left in epoch {self.epoch}")
        self.consumed += n
        if self.consumed >= self.epoch_samples:
            self.epoch, self.consumed = self.epoch + 1, 0

    # -- this rank's samples ----------------------------------------------------------------------
    def rank_indices(self, rank: int, world_size: int) -> list[int]:
        """This rank's samples of the rest of the current epoch, in the order it reads them."""
        _check_rank(rank, world_size, self.global_batch_size)
        rest = self.order()[self.consumed:]
        out: list[int] = []
        gb = self.global_batch_size
        for start in range(0, len(rest), gb):  # batch by batch, so that a short last batch splits evenly
            out.extend(rest[start:start + gb][rank::world_size].tolist())
        return out

    def batch_indices(self, rank: int, world_size: int) -> list[int]:
        """This rank's part of the next global batch (empty at no step left in the epoch)."""
        _check_rank(rank, world_size, self.global_batch_size)
        batch = self.order()[self.consumed:self.consumed + self.global_batch_size]
        return batch[rank::world_size].tolist()

    def sampler(self, rank: int, world_size: int) -> "CursorSampler":
        """A Sampler over the rest of the epoch the cursor stands in when iteration begins."""
        _check_rank(rank, world_size, self.global_batch_size)
        return CursorSampler(self, rank, world_size)

    def loader(self, dataset: Any, rank: int, world_size: int, **kwargs) -> torch.utils.data.DataLoader:
        """A DataLoader of ``dataset`` for this rank: batches of ``global_batch_size / world_size``
        samples from :meth:`sampler` (``kwargs``: the DataLoader's other arguments, e.g. num_workers)."""
        if self.global_batch_size % world_size:
            raise CheckpointError(f"DataCursor.loader: global_batch_size {self.global_batch_size} does not split "
                                  f"evenly over {world_size} ranks; choose a world size that divides it, or index "
                                  "the dataset with batch_indices()")
        for bad in ("sampler", "batch_sampler", "shuffle", "batch_size", "drop_last"):
            if bad in kwargs:
                raise CheckpointError(f"DataCursor.loader: {bad}= is the cursor's to set")
        try:
            length = len(dataset)
        except TypeError:
            length = None
        if length is not None and length != self.num_samples:
            raise CheckpointError(f"DataCursor.loader: the dataset has {length} samples, the cursor {self.num_samples}")
        return torch.utils.data.DataLoader(dataset, batch_size=self.global_batch_size // world_size,
                                           sampler=self.sampler(rank, world_size), drop_last=False, **kwargs)

    # -- Stateful -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain, global values (the same on every rank)."""
        return {"num_samples": self.num_samples, "global_batch_size": self.global_batch_size, "seed": self.seed,
                "shuffle": self.shuffle, "drop_last": self.drop_last, "epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Take the saved position. The order must be the same one: the same dataset length, seed,
        shuffling and end of epoch; the global batch size may change only at an epoch boundary."""
        for key in ("num_samples", "seed", "shuffle", "drop_last"):
            if key in sd and sd[key] != getattr(self, key):
                raise CheckpointError(
                    f"DataCursor: the checkpoint's data cursor has {key}={sd[key]!r}, this one {getattr(self, key)!r}: "
                    "the saved position is in another sample order; build the cursor as the run that saved it did")
        epoch, consumed = _count("epoch", sd["epoch"], 0), _count("consumed", sd["consumed"], 0)
        if consumed >= self.epoch_samples:
            raise CheckpointError(f"DataCursor: the checkpoint's position {consumed} is past the end of an epoch "
                                  f"({self.epoch_samples} samples)")
        if consumed % self.global_batch_size and consumed != self.epoch_samples:
            saved = sd.get("global_batch_size")
            raise CheckpointError(
                f"DataCursor: the checkpoint consumed {consumed} samples of epoch {epoch}, not a whole number of "
                f"global batches of {self.global_batch_size} (it saved with {saved}); change global_batch_size "
                "only at an epoch boundary")
        self.epoch, self.consumed = epoch, consumed

    def __repr__(self) -> str:
        return (f"DataCursor(epoch={self.epoch}, consumed={self.consumed}/{self.epoch_samples}, "
                f"global_batch_size={self.global_batch_size})")


class CursorSampler(torch.utils.data.Sampler):
    """This rank's samples of the rest of its cursor's epoch, read when iteration begins."""

    def __init__(self, cursor: DataCursor, rank: int, world_size: int):
        self.cursor, self.rank, self.world_size = cursor, rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(self.cursor.rank_indices(self.rank, self.world_size))

    def __len__(self) -> int:
        return len(self.cursor.rank_indices(self.rank, self.world_size))


def _check_rank(rank: int, world_size: int, global_batch_size: int) -> None:
    _count("world_size", world_size, 1)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise CheckpointError(f"DataCursor: rank {rank!r} is outside a world of {world_size}")
    if world_size > global_batch_size:
        raise CheckpointError(f"DataCursor: {world_size} ranks share global batches of {global_batch_size} samples: "
                              "some rank would get none; raise global_batch_size")
