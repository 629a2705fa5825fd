"""CheckpointConfig(writer="process"): the checkpoints a writer process commits are those of
the in-process writers; a SIGKILLed training process loses nothing the writer received; a
SIGKILLed writer process is replaced and the run stays exact; structure changes of the state
are laid out again."""

import contextlib
import errno
import glob
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import engine
from engine.checkpoint.writers.process.arena import (ARENA_PREFIX, arena_root, make_arena_directory,
                                                     remove_orphaned_arena_directories)
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.errors import ConfigError
from progress import Cursor
import forkserver
from kill_helpers import SCRIPT, TIMEOUT, environment, run_scenario
from process_table import writer_processes_of
from resume_helpers import assert_same_run
from scenarios import build, train_with_checkpoints


@pytest.fixture(scope="module")
def tbptt_reference(tmp_path_factory):
    """The uninterrupted synchronous run of the tbptt scenario (every checkpoint kept), shared
    by the tests of this module that compare a run with it (read only)."""
    reference = str(tmp_path_factory.mktemp("tbptt-reference"))
    train_with_checkpoints("tbptt", reference, keep_last=None)
    return reference


def test_writer_process_checkpoints_equal_the_synchronous_ones(tmp_path):
    reference, process = str(tmp_path / "sync"), str(tmp_path / "process")
    train_with_checkpoints("tbptt_several_optimizers", reference, keep_last=None)
    train_with_checkpoints("tbptt_several_optimizers", process, keep_last=None, writer="process")
    assert_same_run(reference, process)
    names = CheckpointStore(Storage(reference)).names()
    assert CheckpointStore(Storage(process)).names() == names  # "wait": none skipped
    assert_same_checkpoints(reference, process, names)


def assert_same_checkpoints(first_dir, second_dir, names):
    first, second = CheckpointStore(Storage(first_dir)), CheckpointStore(Storage(second_dir))
    for name in names:
        a, b = first.load(name), second.load(name)
        assert a.progress.cursor == b.progress.cursor, name
        assert_same_tree(a.state, b.state, name)


def assert_same_tree(a, b, where):
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            if key != "elapsed_seconds":  # wall time, the one value two runs never share
                assert_same_tree(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{index}]")
    else:
        assert a == b, where


class GrowingState(engine.Module):
    """A state whose structure changes while it trains: a buffer that appears at the third
    split, one that grows by a row each split, and one whose dtype changes at the fifth."""

    tbptt_split_length = 4

    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.GRU(3, 6, batch_first=True)
        self.head = torch.nn.Linear(6, 1)
        self.register_buffer("history", torch.zeros(0, 2))
        self.register_buffer("tally", torch.zeros(3, dtype=torch.float32))
        self.splits = 0

    def training_step(self, batch, hidden):
        inputs, targets = batch
        output, hidden = self.rnn(inputs, hidden)
        loss = torch.nn.functional.mse_loss(self.head(output), targets)
        self.splits += 1
        row = torch.tensor([[float(self.splits), loss.item()]])
        self.history = torch.cat([self.history, row])
        if self.splits == 3:
            self.register_buffer("late", torch.full((5,), 7.0))
        if self.splits == 5:
            self.tally = self.tally.to(torch.float64) + 1
        return loss, hidden.detach()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def test_structure_changes_are_laid_out_again(tmp_path):
    def train(run_dir, **checkpoint):
        _, loader = build("tbptt")
        torch.manual_seed(5)
        config = engine.TrainerConfig(max_epochs=1, run_dir=run_dir, progress_bar="off",
                                      checkpoint=engine.CheckpointConfig(every_n_splits=1, keep_last=None, **checkpoint))
        engine.Trainer(config).fit(GrowingState(), loader, resume="off")

    reference, process = str(tmp_path / "sync"), str(tmp_path / "process")
    train(reference)
    train(process, writer="process")
    names = CheckpointStore(Storage(reference)).names()
    assert CheckpointStore(Storage(process)).names() == names
    assert_same_checkpoints(reference, process, names)
    last = CheckpointStore(Storage(process)).load(names[-1]).state["module"]
    assert last["tally"].dtype == torch.float64 and "late" in last and last["history"].shape[0] == len(names) - 1


def test_the_writer_commits_the_snapshot_of_a_killed_training_process(tmp_path, tbptt_reference):
    """SIGKILL right after the third checkpoint's snapshot was handed over: the writer process
    commits it, and the restart resumes from exactly that split, with an exact result."""
    reference, run_dir = tbptt_reference, str(tmp_path / "run")
    keep_all = ("--writer", "process", "--keep-last", "0")
    killed = run_scenario("tbptt", run_dir, "split_end_after_checkpoint:3:sigkill", *keep_all)
    assert killed.returncode == -9, killed.stderr[-3000:]
    restarted = run_scenario("tbptt", run_dir, None, *keep_all)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    resumed_from = re.search(r"resumed_from=(\S+)", restarted.stdout).group(1)
    store = CheckpointStore(Storage(run_dir))
    assert store.load(resumed_from).progress.cursor == Cursor(0, 0, 2, 0)  # the third split's boundary
    assert_same_run(reference, run_dir)


def test_a_killed_writer_process_is_replaced_and_the_run_is_exact(tmp_path, tbptt_reference):
    """The first writer process is SIGKILLed inside its third commit (before the manifest):
    the training process says so, starts another, goes on; every later checkpoint is
    committed and the run is exact."""
    reference, run_dir = tbptt_reference, str(tmp_path / "run")
    process = run_scenario("tbptt", run_dir, "checkpoint_before_manifest:3:sigkill", "--writer", "process",
                           "--keep-last", "0")
    assert process.returncode == 0, process.stderr[-3000:]
    assert "checkpoint writer process" in process.stderr and "restarting it" in process.stderr
    assert_same_run(reference, run_dir)
    names = CheckpointStore(Storage(run_dir)).names()
    reference_names = CheckpointStore(Storage(reference)).names()
    # At most the one being written when the writer died is missing; every later one is there.
    assert len(names) >= len(reference_names) - 1
    assert CheckpointStore(Storage(run_dir)).latest().progress.cursor == \
        CheckpointStore(Storage(reference)).latest().progress.cursor


def test_a_writer_process_killed_after_the_final_snapshots_data_leaves_it_to_the_next(tmp_path):
    """The run's only checkpoint is its final one (at the end of its one epoch); the writer
    process is SIGKILLed after writing its data files, before its commit point. The training process hands the
    snapshot (still in its slot) to the new writer process, which commits it: fit does not end
    without it, and a restart resumes from it with the uninterrupted run's result."""
    reference, run_dir = str(tmp_path / "reference"), str(tmp_path / "run")
    only_final = ("--writer", "process", "--every", "1000", "--epochs", "1", "--keep-last", "0")
    train_with_checkpoints("tbptt", reference, epochs=1, every=1000, keep_last=None)
    process = run_scenario("tbptt", run_dir, "checkpoint_before_manifest:1:sigkill", *only_final)
    assert process.returncode == 0, process.stderr[-3000:]
    assert "restarting it" in process.stderr
    committed = CheckpointStore(Storage(run_dir)).latest()
    assert committed is not None, "fit ended without its final checkpoint"
    assert committed.progress.cursor == CheckpointStore(Storage(reference)).latest().progress.cursor
    restarted = run_scenario("tbptt", run_dir, None, *only_final)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert re.search(r"resumed_from=(\S+)", restarted.stdout).group(1) != "None"
    assert_same_run(reference, run_dir)


@pytest.mark.parametrize("checkpoint, field", [
    (dict(writer="process", asynchronous=False), "asynchronous"),
    (dict(writer="processes"), "writer"),
])
def test_writer_process_settings_are_checked(checkpoint, field):
    with pytest.raises(ConfigError, match=field):
        engine.CheckpointConfig(**checkpoint)


class StopTheWriter(engine.Callback):
    """SIGSTOPs the writer process after the first split and lets it go after the sixth."""

    def __init__(self):
        self.splits = 0

    def on_split_end(self, view):
        self.splits += 1
        if self.splits in (1, 6):
            (pid,) = writer_processes_of(os.getpid())
            os.kill(pid, signal.SIGSTOP if self.splits == 1 else signal.SIGCONT)


def test_latest_wins_replaces_snapshots_the_stopped_writer_has_not_taken_up(tmp_path):
    """With when_behind="skip" the training process never waits for a writer process that
    does not keep up (here: stopped for five splits): it takes back the slots of snapshots not
    taken up and puts newer ones there. Fewer checkpoints, always forward, the last one
    written, the run exact."""
    reference, process = str(tmp_path / "sync"), str(tmp_path / "process")
    train_with_checkpoints("tbptt", reference, epochs=1, keep_last=None)
    model, loader = build("tbptt")
    checkpoint = engine.CheckpointConfig(every_n_splits=1, keep_last=None, writer="process",
                                         when_behind="skip")
    config = engine.TrainerConfig(max_epochs=1, run_dir=process, checkpoint=checkpoint, progress_bar="off")
    engine.Trainer(config, callbacks=[StopTheWriter()]).fit(model, loader)
    store = CheckpointStore(Storage(process))
    cursors = [store.load(name).progress.cursor for name in store.names()]
    assert len(cursors) < len(CheckpointStore(Storage(reference)).names())
    assert cursors == sorted(cursors, key=lambda cursor: cursor.as_tuple())
    assert_same_run(reference, process)


@pytest.mark.exhaustive  # CI time: the default run keeps the representative cases above
def test_a_restart_waits_for_the_writer_process_of_the_killed_run(tmp_path, tbptt_reference):
    """The training process is SIGKILLed while its writer process is stopped (as if a long
    commit): the restart finds the lease's lock held, says it waits for that writer, and goes
    on once the writer, let go, has committed and exited; the run is exact."""
    reference, run_dir = tbptt_reference, str(tmp_path / "run")
    command = [sys.executable, SCRIPT, "tbptt", run_dir, "--writer", "process", "--sleep", "0.05"]
    with tempfile.TemporaryFile(mode="w+") as first_errors, tempfile.TemporaryFile(mode="w+") as errors:
        first = forkserver.popen(command, env=environment(None), stdout=subprocess.PIPE, stderr=first_errors, text=True)
        assert first.stdout.readline().startswith("training")
        writers = wait_for(lambda: writer_processes_of(first.pid))
        os.kill(writers[0], signal.SIGSTOP)
        first.kill()
        first.wait(TIMEOUT)
        first.stdout.close()
        restart = forkserver.popen(command, env=environment(None), stdout=subprocess.PIPE, stderr=errors, text=True)
        try:
            def waiting():
                errors.seek(0)
                return "waiting up to" in errors.read()

            wait_for(waiting)
            os.kill(writers[0], signal.SIGCONT)
            restart.wait(TIMEOUT)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(writers[0], signal.SIGCONT)  # never left stopped
            if restart.poll() is None:
                restart.kill()
                restart.wait()
            restart.stdout.close()
        errors.seek(0)
        assert restart.returncode == 0, errors.read()[-3000:]
    assert_same_run(reference, run_dir)


def wait_for(condition, timeout=TIMEOUT):
    """``condition()``'s first true value, polled until ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{condition.__name__} did not hold within {timeout} s")


@pytest.mark.exhaustive  # CI time: the default run keeps the representative cases above
def test_auto_cadence_with_a_writer_process(tmp_path, tbptt_reference):
    """every_n_splits="auto" times the training process's splits against the writer process's
    work in flight; it reaches an interval, and the run trains exactly as without it."""
    reference, process = tbptt_reference, str(tmp_path / "process")
    result = train_with_checkpoints("tbptt", process, every="auto", writer="process")
    assert isinstance(result.checkpoint_interval, int) and result.checkpoint_interval >= 1
    assert_same_run(reference, process)


@pytest.mark.exhaustive  # CI time: the default run keeps the representative cases above
def test_a_rollback_with_a_writer_process_writes_the_same_run(tmp_path):
    """A rollback three steps back (past the newest checkpoint) cuts metrics.jsonl back to the
    restored checkpoint: the writer process starts its lines over there, and the run (weights,
    progress, metrics.jsonl) is the synchronous writer's."""
    from rollback_scenario import train_poisoned

    reference, process = str(tmp_path / "sync"), str(tmp_path / "process")
    rollback = engine.Rollback(back=3)
    with pytest.warns(UserWarning, match="rolled back to"):
        train_poisoned("nan", reference, anomaly=rollback,
                       checkpoint=engine.CheckpointConfig(every_n_splits=1, keep_last=None))
    with pytest.warns(UserWarning, match="rolled back to"):
        train_poisoned("nan", process, anomaly=rollback, checkpoint=engine.CheckpointConfig(
            every_n_splits=1, keep_last=None, writer="process"))
    assert_same_run(reference, process)


def test_a_new_run_removes_the_arena_of_a_killed_trainer_and_writer_and_keeps_a_live_one(tmp_path):
    """The training process and its writer process are SIGKILLed together (their process
    group, as a lost job): nothing removes their slot files from shared memory. The next run's
    writer process launch removes that arena; an arena a live process holds is kept."""
    live = make_arena_directory()
    try:
        command = [sys.executable, SCRIPT, "tbptt", str(tmp_path / "killed"), "--writer", "process",
                   "--sleep", "0.05", "--epochs", "6"]
        killed = forkserver.popen(command, env=environment(None), stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        try:
            assert killed.stdout.readline().startswith("training")
            writer = wait_for(lambda: writer_processes_of(killed.pid))[0]
            orphan = wait_for(lambda: glob.glob(os.path.join(arena_root(), f"{ARENA_PREFIX}{killed.pid}-*")))[0]
            os.killpg(killed.pid, signal.SIGKILL)
            killed.wait(TIMEOUT)
            wait_for(lambda: not process_lives(writer))
        finally:
            if killed.poll() is None:
                os.killpg(killed.pid, signal.SIGKILL)
                killed.wait()
            killed.stdout.close()
        assert os.path.isdir(orphan)
        train_with_checkpoints("tbptt", str(tmp_path / "next"), epochs=1, every=1000, writer="process")
        assert not os.path.exists(orphan)
        assert os.path.isdir(live.path)
    finally:
        live.remove()


def process_lives(pid):
    """Whether ``pid`` is a process that has not exited (a zombie has: its files are closed)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


def test_an_arena_its_writer_process_alone_still_holds_is_kept(tmp_path):
    """A training process makes its arena, hands it to a child (as to its writer process,
    committing the last snapshot) and dies without removing it: the arena is kept while that
    child lives, removed once it is gone too. A directory of that name without an owners file
    (not one this engine made) is never removed."""
    foreign = tmp_path / f"{ARENA_PREFIX}1-foreign"
    foreign.mkdir()
    trainer = forkserver.run([sys.executable, "-c", HAND_THE_ARENA_TO_A_CHILD, str(tmp_path)], capture_output=True,
                             text=True, timeout=TIMEOUT)
    assert trainer.returncode == 0, trainer.stderr[-3000:]
    path, holder = trainer.stdout.split()
    try:
        assert remove_orphaned_arena_directories(str(tmp_path)) == []
        assert os.path.isdir(path)
    finally:
        os.kill(int(holder), signal.SIGKILL)
    wait_for(lambda: not process_lives(int(holder)))
    assert remove_orphaned_arena_directories(str(tmp_path)) == [path]
    assert not os.path.exists(path) and foreign.is_dir()


HAND_THE_ARENA_TO_A_CHILD = """
import os, subprocess, sys
from engine.checkpoint.writers.process.arena import make_arena_directory
arena = make_arena_directory(root=sys.argv[1])
holder = subprocess.Popen(["sleep", "600"], pass_fds=[arena.owner_descriptor], start_new_session=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(arena.path, holder.pid, flush=True)
os._exit(0)
"""


# ---- a shared memory too small for the slots (a container's 64 MB /dev/shm) ----------------------
def test_a_slot_that_does_not_fit_fails_its_checkpoint_and_leaves_nothing_behind(tmp_path, monkeypatch):
    """A slot file's pages are reserved when it is laid out: no room is an OSError naming the
    remedies (not a SIGBUS at the first copy), no file is left, and the next snapshot lays the
    slot out again and copies exactly."""
    from engine.checkpoint.writers.process import arena as snapshot_arena
    from engine.checkpoint.format.codec import encode_state

    tensors = [torch.arange(5000, dtype=torch.float32), torch.ones(3, 7, dtype=torch.float64)]
    encoded = encode_state({"a": tensors[0], "b": tensors[1]})
    buffers = snapshot_arena.SharedSnapshotBuffers(str(tmp_path), 0)

    def full(descriptor, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(snapshot_arena.os, "posix_fallocate", full)
        assert buffers.lock()
        with pytest.raises(OSError, match=r"no room in .*writer='thread'") as error:
            buffers.capture(encoded.tensors, encoded.layout)
        assert error.value.errno == errno.ENOSPC
        buffers.publish(-1)  # what a failed submit does: nothing to publish yet
    assert os.listdir(tmp_path) == []
    assert buffers.lock()
    views = buffers.capture(encoded.tensors, encoded.layout)
    buffers.publish(1)
    assert all(torch.equal(view, tensor) for view, tensor in zip(views, tensors))
    assert buffers.file is not None and buffers.file.generation == 1


TRAIN_WITH_A_WRITER_PROCESS = """
import sys, torch, engine
class Wide(engine.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(256, 256)  # 263 KB of parameters: more than the tmpfs holds
    def training_step(self, batch):
        return self.layer(batch).square().mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
config = engine.TrainerConfig(max_epochs=1, run_dir=sys.argv[1], progress_bar="off", checkpoint=engine.CheckpointConfig(
    every_n_splits=1, writer="process"))
engine.Trainer(config).fit(Wide(), [torch.ones(2, 256)] * 3)
"""


def test_a_writer_process_with_too_little_shared_memory_fails_with_a_clear_error(tmp_path):
    """/dev/shm is a 128 KB tmpfs (in a mount namespace of the test's own): the training
    process is not killed by SIGBUS when it copies its first snapshot; fit raises
    CheckpointWriteError saying where room is missing and what to do."""
    mount = "mount -t tmpfs -o size=128k tmpfs /dev/shm"
    if subprocess.run(["unshare", "--mount", "sh", "-c", mount], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs in a new mount namespace here (needs root)")
    run = subprocess.run(["unshare", "--mount", "sh", "-c", f'{mount} && exec "$0" -c "$1" "$2"', sys.executable,
                          TRAIN_WITH_A_WRITER_PROCESS, str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=TIMEOUT, env=environment(None))
    assert run.returncode == 1, (run.returncode, run.stderr[-3000:])
    last_line = run.stderr.strip().splitlines()[-1]
    assert last_line.startswith("engine.errors.CheckpointWriteError: checkpoint not written: [Errno 28] no room in /dev/shm")
    assert "--shm-size" in last_line and "writer='thread'" in last_line
