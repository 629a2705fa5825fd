"""Streams: training data that is not a DataLoader over a map-style dataset.

* **A stream with state** (``state_dict()`` / ``load_state_dict()``: Hugging Face
  ``datasets.IterableDataset``, MosaicML ``StreamingDataset``, your own ``IterableDataset``) in a
  plain ``DataLoader`` is iterated through torchdata's ``StatefulDataLoader`` built with the same
  arguments: with ``num_workers > 0`` each worker's dataset state is saved, and the state saved
  is the one after the batches the training loop consumed (batches the workers prefetched are
  not counted). A resume loads it: nothing is replayed.
* **A stream without state** is replayed: the batches already seen are drawn and dropped, with
  a progress bar and its time estimate (:func:`drop_batches`).
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any, Iterator, TextIO

from torch.utils.data import DataLoader, IterableDataset
from tqdm import tqdm

from engine.errors import DataError

_NO_BATCH = object()


def has_state(value: Any) -> bool:
    """Whether ``value`` follows the ``state_dict()`` / ``load_state_dict()`` protocol."""
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def over_stream_with_state(loader: Any) -> bool:
    """A plain DataLoader (no state of its own) over an IterableDataset that has state."""
    return (isinstance(loader, DataLoader) and not has_state(loader)
            and isinstance(loader.dataset, IterableDataset) and has_state(loader.dataset))


def with_saved_position(loader: Any) -> Any:
    """``loader`` itself, or for a plain DataLoader over a stream with state, a torchdata
    ``StatefulDataLoader`` with the same arguments (it saves the stream's state in each worker)."""
    if not over_stream_with_state(loader):
        return loader
    with warnings.catch_warnings():  # torchdata 0.11 calls a torch function deprecated since
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return _stateful_loader_class()(
            loader.dataset, batch_size=loader.batch_size, num_workers=loader.num_workers, collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory, drop_last=loader.drop_last, timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
            generator=loader.generator, prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
            persistent_workers=loader.persistent_workers, pin_memory_device=loader.pin_memory_device,
            in_order=loader.in_order,
        )


@functools.cache
def _stateful_loader_class() -> type:
    """torchdata's ``StatefulDataLoader``, whose workers that had ended their pass at the saved
    state stay ended when it is loaded.

    torchdata 0.11 saves a worker's end (its fetcher's ``ended``) but starts every worker again
    on load; a stream that resets its position at the end of a pass (most do) then began that
    worker's pass again, and a resume inside an epoch where the workers' shares differ saw its
    batches twice. The loaded iterator now gives no task to those workers, as the interrupted
    one did not."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader import stateful_dataloader as torchdata_loader

    class EndedWorkersStayEnded(torchdata_loader._StatefulMultiProcessingDataLoaderIter):
        def __init__(self, loader: Any, next_iter_state: dict[str, Any] | None) -> None:
            self._ended_at_load = _ended_workers(next_iter_state)
            super().__init__(loader, next_iter_state)

        def _restore_main_state(self, state_dict: dict[str, Any]) -> None:
            # Called after the workers started and before any task is given to them.
            super()._restore_main_state(state_dict)
            for worker in self._ended_at_load:
                self._workers_status[worker] = False

    class Loader(StatefulDataLoader):
        def _get_iterator(self) -> Any:
            if self.num_workers == 0:
                return super()._get_iterator()
            self.check_worker_number_rationality()
            iterator = EndedWorkersStayEnded(self, getattr(self, "next_iter_state"))
            self.next_iter_state = None
            return iterator

    Loader.__name__ = Loader.__qualname__ = "StatefulDataLoader"
    return Loader


def _ended_workers(state: dict[str, Any] | None) -> list[int]:
    """The workers whose pass had ended in a saved multi-worker StatefulDataLoader state."""
    snapshots = ((state or {}).get("_snapshot") or {}).get("_worker_snapshots") or {}
    return [int(key.rsplit("_", 1)[1]) for key, snapshot in snapshots.items()
            if ((snapshot or {}).get("fetcher_state") or {}).get("fetcher_ended")]


def data_name(loader: Any) -> str:
    """How errors name the training data: ``DataLoader over MyStream``, or the loader's type."""
    dataset = getattr(loader, "dataset", None)
    if isinstance(loader, DataLoader) and dataset is not None:
        return f"{type(loader).__name__} over {type(dataset).__name__}"
    return type(loader).__name__


def drop_batches(iterator: Iterator[Any], count: int, show: bool | None = None, file: TextIO | None = None) -> None:
    """Draw and drop ``count`` batches of ``iterator``, with a progress bar that estimates the
    time left ("skipping 12,345 batches already seen"). ``show=None`` shows it on a terminal only.

    Raises:
        DataError: the iterator ends before ``count`` batches.
    """
    with tqdm(total=count, desc=f"skipping {count:,} batches already seen", unit="batch",
              disable=None if show is None else not show, file=file or sys.stderr, leave=False) as bar:
        for dropped in range(count):
            if next(iterator, _NO_BATCH) is _NO_BATCH:
                raise DataError(f"cannot resume at batch {count} of the epoch: the data yields only {dropped} batches")
            bar.update()
