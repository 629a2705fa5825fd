"""DataLoader worker processes: they outlive a preemption signal, and what they draw is exact.

For a training ``DataLoader`` with ``num_workers > 0`` the engine iterates a private copy of it
(the user's loader is left untouched) with two additions:

* **Preemption.** ``scancel`` and a SLURM time limit send SIGTERM to the whole process group,
  workers included. A worker killed by it makes the main process fail with ``RuntimeError:
  DataLoader worker ... killed by signal``, before it can finish its split and commit. The
  engine chains a ``worker_init_fn`` before the user's own that sets the preemption signals to
  ``SIG_IGN`` in the worker. The main process blocks those signals while it starts workers
  (:func:`preemption_signals_blocked`), so a worker inherits them blocked and cannot die of one
  before its init function ignores them; the main process gets its pending signal on unblocking.
* **Random numbers drawn per sample.** Which worker loads a sample, and how many samples that
  worker loaded before, changes when a resume skips the first batches of an epoch. For a
  map-style dataset each index the sampler yields travels as ``(epoch seed, position in the
  epoch, index)``; the worker seeds Python ``random``, torch's CPU generator and NumPy's global
  generator from (epoch seed, position) right before ``dataset[index]``. What a sample draws
  then depends only on the run's random state at the epoch start, the epoch and its position:
  not on the worker, the number of workers, ``persistent_workers`` or a resume. When the engine orders
  the data the global way, the position is the one in the epoch's whole permutation and the
  epoch seed comes from a base fixed once per run (:class:`engine.data.position.EpochData`), so
  the draws do not depend on the rank or the world size either.

The validation data goes through a :class:`PreemptionSafeLoader` (both additions, its samples
seeded per validation pass); a user's own loader can too, through ``engine.preemption_safe``
(the preemption part only).

A loader without workers is iterated as given: the main process's own random streams are
checkpointed and restored, so nothing has to be reseeded (and a plain run draws exactly what a
hand-written loop draws).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import random
import signal
import struct
import weakref
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, IterableDataset

from engine.errors import warn as warn_user
from engine.data.streams import data_name, over_stream_with_state

try:  # NumPy is optional
    import numpy
except ImportError:  # pragma: no cover - numpy is installed in the test environment
    numpy = None  # type: ignore[assignment]

SampleKey = tuple[int, int, Any]  # (epoch seed, position in the epoch, the sampler's index)


def has_workers(loader: Any) -> bool:
    """Whether ``loader`` is a DataLoader that loads in worker processes."""
    return isinstance(loader, DataLoader) and loader.num_workers > 0


def epoch_seed(epoch: int, epoch_start_states: Sequence[torch.Tensor]) -> int:
    """A 64-bit seed for one epoch's samples from the epoch number and the random states the
    epoch started from (they are checkpointed, so a resumed run computes the same seed)."""
    digest = hashlib.blake2b(struct.pack("<Q", epoch), digest_size=8)
    for state in epoch_start_states:
        digest.update(state.numpy().tobytes())
    return int.from_bytes(digest.digest(), "little")


def run_epoch_seed(base: int, epoch: int) -> int:
    """A 64-bit seed for one epoch's samples from the run's fixed ``base`` alone: the same on
    every rank and every world size."""
    digest = hashlib.blake2b(struct.pack("<QQ", base, epoch), digest_size=8, person=b"run-epoch")
    return int.from_bytes(digest.digest(), "little")


def seed_sample(epoch_seed_value: int, position: int) -> None:
    """Seed this process's global random streams for the sample at ``position`` of the epoch."""
    digest = hashlib.blake2b(struct.pack("<QQ", epoch_seed_value, position), digest_size=8).digest()
    seed = int.from_bytes(digest, "little")
    random.seed(seed)
    # The CPU generator only: torch.manual_seed would also queue a (costly) lazy CUDA seeding
    # per sample, and worker processes do not draw on CUDA.
    torch.default_generator.manual_seed(seed)
    if numpy is not None:
        numpy.random.seed([seed & 0xFFFFFFFF, seed >> 32])


class SampleSeededDataset:
    """Wraps a map-style dataset: reads ``(epoch seed, position, index)`` keys, seeds the
    worker's random streams for the sample, then returns ``dataset[index]``. A dataset with a
    batched ``__getitems__`` keeps it: the batch is seeded from its first sample's position."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: SampleKey) -> Any:
        seed_value, position, index = key
        seed_sample(seed_value, position)
        return self.dataset[index]

    def __getitems__(self, keys: list[SampleKey]) -> Any:
        batched = getattr(self.dataset, "__getitems__", None)
        if batched is None or not keys:
            return [self[key] for key in keys]
        seed_sample(keys[0][0], keys[0][1])
        return batched([index for _, _, index in keys])


class SampleKeySampler:
    """Wraps the loader's (batch) sampler: yields each index as a :data:`SampleKey` of the
    current epoch. ``seed`` is set by the engine before each epoch's ``iter``; so are ``first``
    and ``stride``, which map the k-th index this sampler yields to its position ``first + k *
    stride`` (a rank of a run ordered the global way counts positions in the whole permutation).

    ``rewind`` (set per epoch, used once) puts the random streams back before the sampler
    draws. A DataLoader draws its workers' base seed when it starts workers; with
    ``persistent_workers`` a run that never stopped did so only in its first epoch, so a
    resumed run that starts them in a later epoch undoes that draw before its sampler shuffles.
    """

    def __init__(self, inner: Iterable[Any], batched: bool) -> None:
        self.inner = inner
        self.batched = batched
        self.seed = 0
        self.first, self.stride = 0, 1
        self.rewind: Callable[[], None] | None = None

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        # A generator: this body runs at the first next(), after the DataLoader's seed draw.
        rewind, self.rewind = self.rewind, None
        if rewind is not None:
            rewind()
        seed, first, stride, position = self.seed, self.first, self.stride, 0
        if self.batched:
            for batch in self.inner:
                keys = [(seed, first + (position + offset) * stride, index) for offset, index in enumerate(batch)]
                position += len(keys)
                yield keys
        else:
            for index in self.inner:
                yield (seed, first + position * stride, index)
                position += 1


class WorkerInit:
    """The ``worker_init_fn`` the engine installs: ignore the preemption signals, show the
    user's own dataset in ``get_worker_info()``, then call the user's ``worker_init_fn``."""

    def __init__(self, signals: Sequence[int], user_init: Callable[[int], None] | None, unwrap_dataset: bool) -> None:
        self.signals = tuple(signals)
        self.user_init = user_init
        self.unwrap_dataset = unwrap_dataset

    def __call__(self, worker_id: int) -> None:
        for number in self.signals:
            signal.signal(number, signal.SIG_IGN)  # also discards one that arrived while blocked
        if self.signals and hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)
        if self.unwrap_dataset:
            _show_user_dataset_in_worker_info()
        if self.user_init is not None:
            self.user_init(worker_id)


def _show_user_dataset_in_worker_info() -> None:
    """``get_worker_info().dataset`` is the user's dataset, not the engine's wrapper (user code
    commonly opens per-worker files through it)."""
    from torch.utils.data._utils import worker as torch_worker

    # A private torch attribute: if a torch release renames it, the wrapper stays visible.
    info = getattr(torch_worker, "_worker_info", None)
    if info is not None and isinstance(getattr(info, "dataset", None), SampleSeededDataset):
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=info.id, num_workers=info.num_workers, seed=info.seed, dataset=info.dataset.dataset)


class WorkerLoader:
    """The private copy of a DataLoader with workers, and the sampler that seeds its samples
    (None when its samples cannot be seeded: an IterableDataset, a loader with its own state)."""

    def __init__(self, loader: DataLoader[Any], signals: Sequence[int], stateful: bool, seed_samples: bool = True,
                 given: Any = None) -> None:
        """``given``: the data as the user passed it, which warnings name (``loader`` may be the
        StatefulDataLoader the engine built around a plain DataLoader over a stream with state)."""
        private = copy.copy(loader)
        object.__setattr__(private, "_iterator", None)
        self.persistent = bool(loader.persistent_workers)
        self.sampler: SampleKeySampler | None = None
        if seed_samples and not isinstance(loader.dataset, IterableDataset) and not stateful:
            batched = loader.batch_sampler is not None
            inner: Iterable[Any] = loader.batch_sampler if batched else loader.sampler  # type: ignore[assignment]
            self.sampler = SampleKeySampler(inner, batched)
            # DataLoader forbids re-assigning these after construction; this copy is private.
            object.__setattr__(private, "batch_sampler" if batched else "sampler", self.sampler)
            object.__setattr__(private, "dataset", SampleSeededDataset(loader.dataset))
        private.worker_init_fn = WorkerInit(signals, loader.worker_init_fn, unwrap_dataset=self.sampler is not None)
        self.loader = private
        if seed_samples:
            _warn_if_not_exact(loader, stateful, loader if given is None else given)


def _warn_if_not_exact(loader: DataLoader[Any], stateful: bool, given: Any) -> None:
    if stateful and over_stream_with_state(given):
        stream = type(given.dataset).__name__
        warn_user(
            f"{data_name(given)} has num_workers={loader.num_workers} and {stream} has a state_dict(): random numbers "
            f"drawn in its worker processes are restored on resume only as far as {stream}.state_dict() restores them")
    elif stateful:
        warn_user(
            f"{type(given).__name__} has num_workers={loader.num_workers} and its own state_dict(): random numbers "
            "drawn in its worker processes are restored on resume only as far as its state_dict restores them")
    elif isinstance(loader.dataset, IterableDataset) and loader.persistent_workers:
        warn_user(
            f"DataLoader over the IterableDataset {type(loader.dataset).__name__} with persistent_workers=True: "
            "random numbers drawn in its worker processes are not restored on resume (the resumed run starts new "
            "workers); use persistent_workers=False, or draw no random numbers in the workers")


@contextlib.contextmanager
def preemption_signals_blocked(signals: Sequence[int]) -> Iterator[None]:
    """Block ``signals`` in this thread while DataLoader workers are started: a worker
    inherits the mask and cannot die of one before its init function ignores it; a signal
    that arrives meanwhile is delivered to this process when the block ends."""
    if not signals or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def shut_down_workers(iterator: Iterator[Any]) -> None:
    """Stop the worker processes of a DataLoader iterator now (a no-op for other iterators)."""
    shut_down = getattr(iterator, "_shutdown_workers", None)  # torch's multiprocessing iterator
    if callable(shut_down):
        shut_down()


class PreemptionSafeLoader:
    """Iterates ``loader`` so that its worker processes outlive a preemption signal.

    The engine wraps the validation data in one; wrap a DataLoader with workers that your own
    code iterates while ``fit`` runs (an extra evaluation in a callback, say) the same way, with
    :func:`engine.preemption_safe`, or a SIGTERM to the process group kills its workers and the
    run fails instead of committing.

    A loader without worker processes is iterated as given. ``signals`` are the preemption
    signals (those of ``TrainerConfig.preemption_signals``). With ``seed_samples`` (the engine's
    validation data) a map-style loader's samples are seeded like the training data's, from the
    seed given to :meth:`seed_pass` and their position in the pass; otherwise what the loader
    yields is unchanged.
    """

    def __init__(self, loader: Iterable[Any], signals: Sequence[int], seed_samples: bool = False) -> None:
        self.signals = tuple(int(number) for number in signals)
        # A loader with its own state_dict() (torchdata's) keeps its sampler: it tracks it.
        stateful = callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))
        self._workers = (WorkerLoader(loader, self.signals, stateful=False,  # type: ignore[arg-type]
                                      seed_samples=seed_samples and not stateful)
                         if has_workers(loader) else None)
        self.loader: Iterable[Any] = loader if self._workers is None else self._workers.loader
        # The newest iterator, in a list the finalizer shares without keeping this object alive:
        # its persistent workers ignore SIGTERM, so a process exiting with them alive would wait
        # for them forever (multiprocessing ends them with SIGTERM) unless they are stopped first.
        self._last_iterator: list[Iterator[Any]] = []
        self._finalizer = weakref.finalize(self, _shut_down_each, self._last_iterator)

    def seed_pass(self, seed: int) -> None:
        """Seed the samples of the next pass from ``seed`` (call right before ``iter``).

        The DataLoader draws its workers' base seed from the global torch generator (or its own)
        when it starts workers: with ``persistent_workers`` only in the first pass a process
        runs, which a resumed run reaches at another pass. That draw is undone before the sampler
        shuffles, in every pass, so the order does not depend on when workers were started."""
        sampler = None if self._workers is None else self._workers.sampler
        if sampler is None:
            return
        sampler.seed = seed
        own_generator = getattr(self.loader, "generator", None)
        generator = own_generator if isinstance(own_generator, torch.Generator) else torch.default_generator
        state = generator.get_state()

        def rewind() -> None:
            generator.set_state(state)

        sampler.rewind = rewind

    def __iter__(self) -> Iterator[Any]:
        if self._workers is None:
            return iter(self.loader)
        with preemption_signals_blocked(self.signals):
            iterator = iter(self.loader)
        # A persistent loader hands back the same iterator each time; another one's workers are
        # stopped when it is exhausted, or here when it was left early.
        if self._last_iterator and self._last_iterator[0] is not iterator:
            _shut_down_each(self._last_iterator)
        self._last_iterator[:] = [iterator]
        return iterator

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def close(self) -> None:
        """Stop the worker processes now (otherwise when this loader is garbage collected or
        the process exits)."""
        _shut_down_each(self._last_iterator)


def _shut_down_each(iterators: list[Iterator[Any]]) -> None:
    for iterator in iterators:
        shut_down_workers(iterator)
    iterators.clear()
