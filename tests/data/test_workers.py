"""DataLoader worker processes: random augmentation in ``__getitem__`` is exact after a resume
(in-process from every checkpoint, and after a real SIGKILL of the process group), workers
ignore the preemption signals, the user's worker_init_fn still runs, and setups that cannot be
made exact say so once."""

import os
import random
import signal
import threading
import subprocess
import sys
import time
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

import engine
import forkserver
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.storage import Storage
from engine.data.position import EpochData
from engine.data.workers import preemption_signals_blocked
from kill_helpers import WITH_A_WRITER_PROCESS
from models import Regression
from resume_helpers import assert_resumes_are_exact, assert_same_run, memory_url
from worker_training import AugmentedDataset, make_loader, seed_all, train

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(TESTS, "worker_training.py")


def environment():
    """The tests' environment (as a test may have changed it), with the repository root after
    tests/ on the path, so that tests/progress/ does not hide the package from a script run out
    of tests/."""
    return dict(os.environ, PYTHONPATH=os.path.dirname(TESTS))


def epoch_batches(loader, epoch=0):
    data = EpochData(loader)
    try:
        return list(data.open_epoch(epoch))
    finally:
        data.close()


def assert_same_batches(first, second):
    assert len(first) == len(second)
    for (x1, y1), (x2, y2) in zip(first, second):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


# ---- what a sample draws does not depend on the worker that loads it ----------------------


def test_a_sample_draws_the_same_whatever_worker_loads_it():
    batches = {}
    for workers, persistent in [(1, False), (2, False), (2, True)]:
        seed_all(0)
        batches[workers, persistent] = epoch_batches(make_loader(persistent, workers=workers))
    assert_same_batches(batches[1, False], batches[2, False])
    assert_same_batches(batches[1, False], batches[2, True])


def test_samples_draw_differently_in_each_epoch():
    seed_all(0)
    loader = make_loader(shuffle=False)
    first, second = epoch_batches(loader, 0), epoch_batches(loader, 1)
    assert not torch.equal(torch.cat([x for x, _ in first]), torch.cat([x for x, _ in second]))


def test_a_loader_without_workers_is_iterated_as_given():
    """No reseeding without workers: a plain run draws what a hand-written loop draws."""
    loader = make_loader(workers=0)
    data = EpochData(loader)
    assert data.loader is loader
    seed_all(0)
    by_hand = list(loader)
    seed_all(0)
    assert_same_batches(by_hand, list(data.open_epoch(0)))


@pytest.mark.parametrize("persistent", [False, pytest.param(True, marks=pytest.mark.exhaustive)],  # CI time (17 s)
                         ids=["workers", "persistent_workers"])
def test_resume_from_every_checkpoint_with_augmenting_workers_is_exact(persistent):
    reference = memory_url("workers")
    train(reference, persistent)
    names = CheckpointStore(Storage(reference)).names()
    assert len(names) >= 12
    assert_resumes_are_exact(reference, names[:-1], lambda run_dir: train(run_dir, persistent))


@pytest.mark.slow
@WITH_A_WRITER_PROCESS  # the writer process is in the group: both die, the resume cleans its arena up
def test_sigkill_of_the_process_group_then_resume_is_exact(test_writer, tmp_path):
    reference = str(tmp_path / "reference")
    final = train(reference).cursor
    run_dir = str(tmp_path / "run")
    process = forkserver.popen([sys.executable, SCRIPT, run_dir, "--sleep", "0.2"], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True, start_new_session=True, env=environment())
    try:
        assert process.stdout.readline().strip() == "training"
        while len(CheckpointStore(Storage(run_dir)).committed_names()) < 4:  # mid-epoch 0
            assert process.poll() is None
            time.sleep(0.02)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the main process and its workers, as a lost node
        process.wait(60)
        process.stdout.close()
    assert process.returncode == -signal.SIGKILL
    result = train(run_dir)
    assert result.resumed_from is not None and result.resumed_cursor != final
    assert_same_run(reference, run_dir)


# ---- the engine's worker_init_fn -----------------------------------------------------------


class WorkerReport(Dataset):
    """Each sample reports what its worker saw: the SIGTERM/SIGUSR1 handlers and the value
    the user's worker_init_fn stored on the dataset."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        ignored = [signal.getsignal(number) == signal.SIG_IGN for number in (signal.SIGTERM, signal.SIGUSR1)]
        return torch.tensor(ignored + [getattr(self, "opened_by", -1) + 1])


def user_worker_init(worker_id):
    get_worker_info().dataset.opened_by = worker_id


@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent_workers"])
def test_workers_ignore_the_preemption_signals_and_run_the_users_init(persistent):
    loader = DataLoader(WorkerReport(), batch_size=None, num_workers=2, worker_init_fn=user_worker_init,
                        persistent_workers=persistent)
    data = EpochData(loader, worker_signals=(signal.SIGTERM, signal.SIGUSR1))
    try:
        reports = list(data.open_epoch(0))
    finally:
        data.close()
    assert [report.tolist() for report in reports] == [[1, 1, 1], [1, 1, 2], [1, 1, 1], [1, 1, 2]]
    assert loader.worker_init_fn is user_worker_init and isinstance(loader.dataset, WorkerReport)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # this process is untouched


@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent_workers"])
def test_preemption_safe_loader_workers_ignore_the_signals_and_run_the_users_init(persistent):
    loader = DataLoader(WorkerReport(), batch_size=None, num_workers=2, worker_init_fn=user_worker_init,
                        persistent_workers=persistent)
    safe = engine.preemption_safe(loader)
    try:
        passes = [[report.tolist() for report in safe] for _ in range(2)]
    finally:
        safe.close()
    assert passes[0] == passes[1] == [[1, 1, 1], [1, 1, 2], [1, 1, 1], [1, 1, 2]]
    assert loader.worker_init_fn is user_worker_init and isinstance(loader.dataset, WorkerReport)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # this process is untouched


EXIT_WITH_PERSISTENT_WORKERS_OPEN = """
import torch, engine
from torch.utils.data import DataLoader, TensorDataset
loader = engine.preemption_safe(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, num_workers=2,
                                           persistent_workers=True))
print(sum(len(batch) for batch in loader), flush=True)
"""


@pytest.mark.slow
def test_a_process_exits_with_a_preemption_safe_loaders_persistent_workers_never_closed():
    # Its workers ignore SIGTERM, which multiprocessing sends them at exit: they are stopped first.
    completed = subprocess.run([sys.executable, "-c", EXIT_WITH_PERSISTENT_WORKERS_OPEN], capture_output=True,
                               text=True, timeout=120, env=environment())
    assert completed.returncode == 0 and completed.stdout.strip() == "4", completed.stderr[-2000:]


def test_resume_after_each_validation_with_persistent_validation_workers_is_exact():
    """Validation samples drawn in persistent workers: the resumed run starts them in another
    pass than the run that never stopped, and still validates on the same values."""
    from validated_worker_training import train as train_validated

    reference = memory_url("workers")
    train_validated(reference, persistent=True)
    names = CheckpointStore(Storage(reference)).names()
    assert len(names) >= 3  # one after each validation pass
    assert_resumes_are_exact(reference, names[:-1], lambda run_dir: train_validated(run_dir, persistent=True))


def test_a_batched_getitems_dataset_keeps_its_fast_path():
    class Batched(AugmentedDataset):
        calls = 0

        def __getitems__(self, indices):
            return [self[index] for index in indices]

    seed_all(0)
    first = epoch_batches(DataLoader(Batched(), batch_size=2, num_workers=1))
    seed_all(0)
    second = epoch_batches(DataLoader(Batched(), batch_size=2, num_workers=2))
    assert_same_batches(first, second)


# ---- setups that cannot be made exact warn once --------------------------------------------


class RandomStream(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        for index in range(info.id, 8, info.num_workers):
            yield torch.tensor([index + random.random()])


class StatefulDataLoader(DataLoader):
    """A DataLoader subclass with its own state, as torchdata's StatefulDataLoader."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


NOT_EXACT = {
    "iterable_persistent": (lambda: DataLoader(RandomStream(), batch_size=2, num_workers=2, persistent_workers=True),
                            "RandomStream with persistent_workers=True"),
    "stateful": (lambda: StatefulDataLoader(AugmentedDataset(), batch_size=4, num_workers=2),
                 "StatefulDataLoader has num_workers=2 and its own state_dict()"),
}


@pytest.mark.parametrize("setup", sorted(NOT_EXACT))
def test_a_setup_that_cannot_be_exact_warns_once_per_fit(setup):
    make, message = NOT_EXACT[setup]
    model = Regression(features=1, lr=0.01) if setup == "iterable_persistent" else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if model is not None:
            engine.Trainer(engine.TrainerConfig(max_epochs=3, progress_bar="off")).fit(model, make())
        else:
            EpochData(make()).close()
    assert sum(message in str(w.message) for w in caught) == 1


class StreamWithState(IterableDataset):
    """A stream with state_dict(), in a plain DataLoader: the engine iterates it through a
    StatefulDataLoader the user never made."""

    def __iter__(self):
        info = get_worker_info()
        yield from (torch.tensor([float(index)]) for index in range(info.id, 8, info.num_workers))

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_a_warning_names_the_data_as_given_at_the_line_of_the_users_fit():
    loader = DataLoader(StreamWithState(), batch_size=2, num_workers=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.Trainer(engine.TrainerConfig(max_epochs=1, progress_bar="off")).fit(Regression(features=1, lr=0.01), loader)
    (warning,) = [w for w in caught if "num_workers=2" in str(w.message)]
    assert str(warning.message).startswith("DataLoader over StreamWithState has num_workers=2 and StreamWithState has "
                                           "a state_dict()") and "StatefulDataLoader" not in str(warning.message)
    assert warning.filename == __file__


def test_iterable_dataset_with_fresh_workers_does_not_warn():
    loader = DataLoader(RandomStream(), batch_size=2, num_workers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EpochData(loader).close()


def test_a_signal_while_workers_start_is_delivered_after_they_started():
    """The preemption signals are blocked while workers are started (a worker inherits the
    block until its init function ignores them); the main process gets the signal after."""
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda number, frame: received.append(number))
    try:
        with preemption_signals_blocked((signal.SIGUSR1,)):
            # Directed at this thread: a process-directed signal may go to another thread
            # (a writer thread left by an earlier test) that does not block it.
            signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
            assert signal.SIGUSR1 in signal.sigpending()
            assert received == []
        assert received == [signal.SIGUSR1]
        assert signal.SIGUSR1 not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_iterable_dataset_with_fresh_workers_resumes_exactly_by_replaying_them():
    """Without persistent workers each epoch starts workers seeded from the epoch's random
    state; resuming replays the epoch's opening, so the fast-forward redraws the same stream."""
    def run(run_dir):
        torch.manual_seed(0)
        loader = DataLoader(RandomStream(), batch_size=2, num_workers=2)
        config = engine.TrainerConfig(max_epochs=2, run_dir=run_dir, progress_bar="off",
                                      checkpoint=engine.CheckpointConfig(every_n_splits=1, keep_last=None))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="resuming .* by drawing and dropping")
            return engine.Trainer(config).fit(Regression(features=1, lr=0.01), loader)

    reference = memory_url("workers")
    run(reference)
    names = CheckpointStore(Storage(reference)).names()
    assert_resumes_are_exact(reference, names[:-1], run)
