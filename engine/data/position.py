"""The training data as epochs of batches, with a position that survives a restart.

Resuming inside an epoch replays the epoch's opening under the random state it had (so a
shuffling sampler draws the same permutation), then moves past the batches already consumed:

* ``DataLoader`` over a map-style dataset: the batch sampler is advanced, no sample is loaded;
* a loader with ``state_dict()``/``load_state_dict()`` (torchdata's StatefulDataLoader), or a
  DataLoader over an IterableDataset with them (iterated through a StatefulDataLoader, see
  :mod:`engine.data.streams`): its saved state is loaded;
* any other iterable: batches are drawn and dropped, with a progress bar (one warning says so).

The batch in flight at a checkpoint is stored in the checkpoint itself, so the interrupted
batch is re-split exactly as it was, whatever the loader does. A DataLoader with worker
processes is iterated through a private copy that seeds each sample and keeps its workers
alive through a preemption signal (see :mod:`engine.data.workers`).
"""

from __future__ import annotations

import collections
import copy
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, IterableDataset

from engine.data.hf_streams import repair_state_loading
from engine.data.streams import data_name, drop_batches, has_state, over_stream_with_state, with_saved_position
from engine.data.workers import (WorkerLoader, epoch_seed, has_workers, preemption_signals_blocked, run_epoch_seed,
                                 shut_down_workers)
from engine.errors import DataError, warn as warn_user
from engine.data.rng import RngSnapshot, capture_global_rng, restore_global_rng

EXHAUSTED = object()
_NO_BATCH = object()


class _SkippingIterator:
    """Iterates ``source`` after dropping its first ``skip`` items. The drop happens on the
    first ``next()`` or on ``prime()``, whichever comes first, so the random draws of the
    source happen at the same point of the run as without skipping."""

    def __init__(self, source: Iterable[Any], skip: int) -> None:
        self._source = source
        self._skip = skip
        self._iterator: Iterator[Any] | None = None

    def prime(self) -> None:
        if self._iterator is not None:
            return
        self._iterator = iter(self._source)
        for dropped in range(self._skip):
            if next(self._iterator, _NO_BATCH) is _NO_BATCH:
                raise DataError(
                    f"cannot resume at batch {self._skip} of the epoch: the sampler yields only {dropped} batches"
                )
        forget = getattr(self._source, "forget_queued", None)
        if callable(forget):  # the dropped batches were trained before the resume: not drawn again
            forget()

    def __iter__(self) -> "_SkippingIterator":
        return self

    def __next__(self) -> Any:
        self.prime()
        assert self._iterator is not None  # prime() opened it
        return next(self._iterator)


class _SkippingSampler:
    """A (batch) sampler that yields ``inner``'s items from index ``skip`` on."""

    def __init__(self, inner: Any, skip: int) -> None:
        self.inner = inner
        self.skip = skip
        self.last_iterator: _SkippingIterator | None = None

    def __iter__(self) -> _SkippingIterator:
        self.last_iterator = _SkippingIterator(self.inner, self.skip)
        return self.last_iterator

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.skip)


class _RecordingSampler:
    """A (batch) sampler that queues each item it yields: the sample ids of the batches the
    loader will return, in order (the DataLoader draws from its sampler in the main process,
    ahead of the batches its workers deliver). engine.goodput's ledger reads them."""

    def __init__(self, inner: Any, queue: collections.deque[Any]) -> None:
        self.inner = inner
        self.queue = queue

    def __iter__(self) -> Iterator[Any]:
        for item in self.inner:
            self.queue.append(item)
            yield item

    def __len__(self) -> int:
        return len(self.inner)

    def forget_queued(self) -> None:
        self.queue.clear()


def _recording_copy(loader: DataLoader[Any], queue: collections.deque[Any]) -> DataLoader[Any]:
    """A copy of ``loader`` whose (batch) sampler queues what it yields in ``queue``."""
    recording = copy.copy(loader)
    object.__setattr__(recording, "_iterator", None)
    field = "batch_sampler" if loader.batch_sampler is not None else "sampler"
    object.__setattr__(recording, field, _RecordingSampler(getattr(loader, field), queue))
    return recording


def _sample_ids(item: Any) -> list[int] | None:
    """The sample ids in a (batch) sampler's item: a list of indices, or one index."""
    if isinstance(item, int):
        return [item]
    if isinstance(item, (list, tuple)) and all(isinstance(index, int) for index in item):
        return list(item)
    return None


def _is_map_style_loader(loader: Any) -> bool:
    return isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset)


def _open_skipping_loader(loader: DataLoader[Any], skip: int) -> Iterator[Any]:
    """Iterate a copy of ``loader`` whose (batch) sampler skips ``skip`` batches without
    loading them. DataLoader forbids re-assigning its sampler after construction, so the copy
    is patched with object.__setattr__; re-instantiating it would lose subclass arguments."""
    resumed = copy.copy(loader)
    object.__setattr__(resumed, "_iterator", None)
    if loader.batch_sampler is not None:
        sampler = _SkippingSampler(loader.batch_sampler, skip)
        object.__setattr__(resumed, "batch_sampler", sampler)
    else:
        sampler = _SkippingSampler(loader.sampler, skip)
        object.__setattr__(resumed, "sampler", sampler)
    iterator = iter(resumed)
    if sampler.last_iterator is not None:
        sampler.last_iterator.prime()
    return iterator


def _generators_of(loader: Any) -> list[torch.Generator]:
    """The torch generators a loader and its samplers draw from (deduplicated)."""
    found: list[torch.Generator] = []
    candidates = [getattr(loader, "generator", None)]
    for sampler in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        candidates.append(getattr(sampler, "generator", None))
        candidates.append(getattr(getattr(sampler, "sampler", None), "generator", None))
    for candidate in candidates:
        if isinstance(candidate, torch.Generator) and not any(candidate is g for g in found):
            found.append(candidate)
    return found


def _samplers_with_epoch(loader: Any) -> list[Any]:
    found: list[Any] = []
    # A stream's own set_epoch too (Hugging Face's IterableDataset reshuffles by it).
    for sampler in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                    getattr(getattr(loader, "batch_sampler", None), "sampler", None), getattr(loader, "dataset", None)):
        if callable(getattr(sampler, "set_epoch", None)) and not any(sampler is s for s in found):
            found.append(sampler)
    return found


class EpochData:
    """Epochs of batches from ``loader`` with a resumable position (see the module docstring).

    ``worker_signals`` are the preemption signals: DataLoader worker processes ignore them, so
    that only the main process reacts (it finishes the split and commits).

    ``seed_of_rank_zero`` gives rank 0's value of an int on every rank (a collective in a
    torchrun job). A loader ordered the global way (engine.distributed.global_order) with
    workers seeds its samples from a base fixed once per run (rank 0's first epoch seed, through
    it) and their position in the epoch's whole permutation, so what a sample draws in a worker
    does not depend on the rank or the world size. A run resumed from a checkpoint without a
    base keeps the earlier per-rank scheme (its epoch seed, its position in the rank's shard).
    """

    def __init__(self, loader: Iterable[Any], worker_signals: Sequence[int] = (),
                 seed_of_rank_zero: Callable[[int], int] | None = None) -> None:
        if not hasattr(loader, "__iter__"):
            raise DataError(f"the training data must be iterable (a DataLoader or any iterable), got {type(loader).__name__}")
        self.source: Any = loader  # as given (self.loader may be a private copy that runs workers)
        self.length = _length_or_none(loader)
        if self.length == 0:
            raise DataError("the training data is empty: len(train_data) is 0")
        self.name = data_name(loader)
        repair_state_loading(getattr(loader, "dataset", loader))
        # A stream with state in a DataLoader: inside an epoch the StatefulDataLoader's state
        # (each worker's stream state) resumes it. Between epochs only the main process's stream
        # carries over: each epoch's workers start from it, and without workers it is the one
        # iterated. Loading the loader's state there would skip the DataLoader's seed draw.
        self._stream = getattr(loader, "dataset", None) if over_stream_with_state(loader) else None
        self._stream_carries_over = self._stream is not None and not has_workers(loader)
        loader = with_saved_position(loader)
        self._stateful = has_state(loader)
        self._map_style = _is_map_style_loader(loader) and not self._stateful
        self._generators = _generators_of(loader)
        self._epoch_samplers = _samplers_with_epoch(loader)
        self._worker_signals = tuple(worker_signals)
        self._seed_of_rank_zero = seed_of_rank_zero or (lambda seed: seed)
        self._sample_seed_base: int | None = None
        self._per_rank_seeds = False  # resumed from a checkpoint written before the base existed
        self._workers: WorkerLoader | None = None
        if has_workers(loader):
            self._workers = WorkerLoader(loader, self._worker_signals, self._stateful,  # type: ignore[arg-type]
                                         given=self.source)
            loader = self._workers.loader
        # The sample ids of each batch drawn, for the goodput ledger (docs/goodput.md): a map-style
        # loader's sampler indices; for other data, the batch's position in its epoch.
        self.loader: Any = loader
        # What an epoch iterates: for map-style data, a copy of the loader whose sampler queues
        # the sample ids of each batch (the loader itself is left as given).
        self._queued_ids: collections.deque[Any] | None = None
        self._iterated: Any = loader
        if self._map_style:
            self._queued_ids = collections.deque()
            self._iterated = _recording_copy(loader, self._queued_ids)  # type: ignore[arg-type]
        self.sample_id_kind = "sample indices" if self._map_style else "batch positions"
        self._drawn: list[tuple[int, list[int]]] = []
        self._epoch = 0
        self._worker_iterators: list[Iterator[Any]] = []
        self._warned_fast_forward = False
        self.batches_consumed = 0
        self.pending_batch: Any = _NO_BATCH
        self._epoch_start_rng: RngSnapshot | None = None
        self._epoch_start_generators: list[torch.Tensor] = []
        self._loader_state: Any = None

    def use_loader(self, loader: Iterable[Any]) -> None:
        """Read from ``loader`` instead, before any epoch opens (a resume on another world size
        re-partitions the data: engine.distributed.global_order)."""
        self.close()
        EpochData.__init__(self, loader, self._worker_signals, self._seed_of_rank_zero)

    def open_epoch(self, epoch: int) -> Iterator[Any]:
        """An iterator over the epoch's batches from the current position."""
        for sampler in self._epoch_samplers:
            sampler.set_epoch(epoch)
        self._epoch = epoch
        if self._queued_ids is not None:
            self._queued_ids.clear()  # what an earlier iterator drew ahead is not trained
        if self.batches_consumed == 0:
            self._epoch_start_rng = capture_global_rng()
            self._epoch_start_generators = [g.get_state() for g in self._generators]
            self._seed_samples(epoch)
            with preemption_signals_blocked(self._signals_to_block()):
                return self._track_workers(iter(self._iterated))
        if self._epoch_start_rng is None:
            raise DataError(f"cannot resume inside epoch {epoch}: the data position holds no random state of the epoch start")
        now = capture_global_rng()
        restore_global_rng(self._epoch_start_rng)
        for generator, state in zip(self._generators, self._epoch_start_generators):
            generator.set_state(state)
        self._seed_samples(epoch)
        try:
            with preemption_signals_blocked(self._signals_to_block()):
                return self._track_workers(self._open_at(self.batches_consumed))
        finally:
            restore_global_rng(now)

    def _seed_samples(self, epoch: int) -> None:
        """Give this epoch's samples their seed (loaders with workers over map-style data).
        Called right before the epoch's ``iter``."""
        if self._workers is None or self._workers.sampler is None or self._epoch_start_rng is None:
            return
        sampler = self._workers.sampler
        seed = epoch_seed(epoch, [self._epoch_start_rng.torch_cpu, *self._epoch_start_generators])
        place = _place_in_global_order(self.source)
        if place is not None and self._sample_seed_base is None and not self._per_rank_seeds:
            # Fixed once per run (at its first epoch), so the same on every rank and after any resume.
            self._sample_seed_base = self._seed_of_rank_zero(seed >> 1)  # an int64 travels
        if place is not None and self._sample_seed_base is not None:
            seed = run_epoch_seed(self._sample_seed_base, epoch)
            sampler.first, sampler.stride = place
        sampler.seed = seed
        if self._workers.persistent and epoch > 0:
            torch_state = torch.get_rng_state()
            generator_states = [g.get_state() for g in self._generators]

            def rewind() -> None:
                torch.set_rng_state(torch_state)
                for generator, state in zip(self._generators, generator_states):
                    generator.set_state(state)

            sampler.rewind = rewind

    def _track_workers(self, iterator: Iterator[Any]) -> Iterator[Any]:
        """Remember the iterator that runs worker processes, and stop those of earlier epochs
        (a resumed epoch's persistent workers would otherwise live on beside the next ones)."""
        if self._workers is not None:
            for earlier in self._worker_iterators:
                if earlier is not iterator:
                    shut_down_workers(earlier)
            self._worker_iterators = [iterator]
        return iterator

    def close(self) -> None:
        """Stop the worker processes now. Persistent workers would otherwise live until the
        loader is garbage collected, and a process exiting with them alive waits forever:
        multiprocessing terminates them with SIGTERM, which they ignore."""
        for iterator in self._worker_iterators:
            shut_down_workers(iterator)
        self._worker_iterators = []
        close_sources = getattr(self.source, "close_sources", None)  # engine.data.Mixture, several loaders
        if callable(close_sources):
            close_sources()

    def _signals_to_block(self) -> tuple[int, ...]:
        # Only while worker processes may be started: blocking costs two system calls.
        return self._worker_signals if self._workers is not None else ()

    def _open_at(self, skip: int) -> Iterator[Any]:
        if self._stateful:
            self.loader.load_state_dict(self._loader_state)
            if self.length is not None and skip >= self.length:
                # The epoch's iterator was exhausted; a new iter() would start the next epoch.
                return iter(())
            return iter(self.loader)
        if self._map_style:
            return _open_skipping_loader(self._iterated, skip)
        if not self._warned_fast_forward:
            warn_user(
                f"resuming {self.name} by drawing and dropping {skip:,} batches (it costs as long as reading "
                "them): it is neither a DataLoader over a map-style dataset nor a loader or IterableDataset with "
                "state_dict() (docs/data.md)")
            self._warned_fast_forward = True
        iterator = iter(self.loader)
        drop_batches(iterator, skip)
        return iterator

    def next_batch(self, iterator: Iterator[Any]) -> Any:
        """The batch in flight (restored from a checkpoint) or the next one; EXHAUSTED at the end."""
        if self.pending_batch is not _NO_BATCH:
            return self.pending_batch
        batch = next(iterator, EXHAUSTED)
        if batch is not EXHAUSTED:
            self.batches_consumed += 1
            self.pending_batch = batch
            self._record_drawn()
        return batch

    def _record_drawn(self) -> None:
        ids = None
        if self._queued_ids:
            ids = _sample_ids(self._queued_ids.popleft())
        self._drawn.append((self._epoch, ids if ids is not None else [self.batches_consumed - 1]))

    def epoch_samples(self) -> int | None:
        """How many ids a whole epoch draws (see :meth:`take_drawn`); None when unknown."""
        if not self._map_style:
            return self.length
        batch_sampler = getattr(self.source, "batch_sampler", None)
        if isinstance(batch_sampler, torch.utils.data.BatchSampler):
            if batch_sampler.drop_last:
                return len(batch_sampler) * batch_sampler.batch_size
            return _length_or_none(batch_sampler.sampler)
        return _length_or_none(getattr(self.source, "sampler", None)) if batch_sampler is None else None

    def drawn_count(self) -> int:
        """How many batches were drawn since the last :meth:`take_drawn` (a mark for it)."""
        return len(self._drawn)

    def take_drawn(self, count: int | None = None) -> list[tuple[int, list[int]]]:
        """The (epoch, sample ids) of the first ``count`` batches drawn since the last call (all
        by default), removed from the record; ids are ``sample_id_kind``."""
        count = len(self._drawn) if count is None else count
        taken, self._drawn = self._drawn[:count], self._drawn[count:]
        return taken

    def batch_done(self) -> None:
        self.pending_batch = _NO_BATCH

    def epoch_done(self) -> None:
        self.batches_consumed = 0

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "batches_consumed": self.batches_consumed,
            "has_pending_batch": self.pending_batch is not _NO_BATCH,
            "pending_batch": None if self.pending_batch is _NO_BATCH else self.pending_batch,
            "generators_now": [g.get_state() for g in self._generators],
            "epoch_start_generators": list(self._epoch_start_generators),
            "epoch_start_rng": None if self._epoch_start_rng is None else self._epoch_start_rng.to_state(),
            "loader_state": self.loader.state_dict() if self._stateful else None,
            "stream_state": self._stream.state_dict() if self._stream_carries_over else None,  # type: ignore[union-attr]
            # Absent (older checkpoints): worker samples stay seeded per rank for the whole run.
            "sample_seed_base": self._sample_seed_base,
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["generators_now"]) != len(self._generators):
            raise DataError(
                f"the checkpoint's data uses {len(state['generators_now'])} random generators, "
                f"the current data {len(self._generators)}"
            )
        self.batches_consumed = int(state["batches_consumed"])
        self.pending_batch = state["pending_batch"] if state["has_pending_batch"] else _NO_BATCH
        for generator, generator_state in zip(self._generators, state["generators_now"]):
            generator.set_state(generator_state)
        self._epoch_start_generators = list(state["epoch_start_generators"])
        rng = state["epoch_start_rng"]
        self._epoch_start_rng = None if rng is None else RngSnapshot.from_state(rng)
        self._loader_state = state["loader_state"]
        self._per_rank_seeds = "sample_seed_base" not in state
        self._sample_seed_base = state.get("sample_seed_base")
        if self.batches_consumed > 0 or self._loader_state is None:
            return
        if self._stream is None:
            self.loader.load_state_dict(self._loader_state)
        elif self._stream_carries_over:
            self._stream.load_state_dict(state["stream_state"])


def _place_in_global_order(loader: Any) -> tuple[int, int] | None:
    """(rank, world size) when the engine orders ``loader`` the global way (its sampler, a
    GlobalOrderSampler, says so; duck-typed: engine.data does not import engine.distributed):
    the rank's k-th sample is at position ``rank + k * world size`` of the epoch's permutation."""
    sampler = getattr(loader, "sampler", None)
    if not getattr(sampler, "orders_globally", False):
        return None
    return int(sampler.rank), int(sampler.num_replicas)  # type: ignore[union-attr]


def _length_or_none(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None
