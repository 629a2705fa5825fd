"""A second writer on the same run directory is detected and refused; it never interleaves."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

import engine
import forkserver
from engine.checkpoint.lease import LEASE_FILE
from engine.checkpoint.store import CheckpointStore
from engine.checkpoint.storage import Storage
from kill_helpers import SCRIPT, environment
from resume_helpers import assert_same_run
from scenarios import train_with_checkpoints


def write_lease(run_dir, pid, host=None, generation=3, token="someone-else"):
    os.makedirs(run_dir, exist_ok=True)
    record = {"token": token, "generation": generation, "pid": pid, "host": host or socket.gethostname(),
              "heartbeat_unix": 0.0}
    with open(os.path.join(run_dir, LEASE_FILE), "w") as handle:
        json.dump(record, handle)


def test_live_holder_is_refused(tmp_path):
    run_dir = str(tmp_path / "run")
    write_lease(run_dir, os.getppid())  # our parent process: alive
    with pytest.raises(engine.WriterConflict, match=f"pid {os.getppid()}"):
        train_with_checkpoints("plain", run_dir)
    assert not os.path.exists(os.path.join(run_dir, "checkpoints")) or not CheckpointStore(Storage(run_dir)).names()


def test_dead_holder_is_taken_over_with_a_new_generation(tmp_path):
    run_dir = str(tmp_path / "run")
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_lease(run_dir, int(finished.stdout), generation=6)
    train_with_checkpoints("plain", run_dir)
    store = CheckpointStore(Storage(run_dir))
    assert {store.load(name).manifest.writer_generation for name in store.names()} == {7}
    assert not os.path.exists(os.path.join(run_dir, LEASE_FILE))  # released at the end


def test_other_host_with_an_old_heartbeat_is_stale(tmp_path):
    run_dir = str(tmp_path / "run")
    write_lease(run_dir, 1, host="another-host")
    assert train_with_checkpoints("plain", run_dir).resumed_from is None


class TakeOver(engine.Callback):
    """Plays a relaunched job that took the lease while this one still runs."""

    def __init__(self, run_dir, at):
        self.run_dir = run_dir
        self.at = at
        self.seen = 0

    def on_split_end(self, view):
        self.seen += 1
        if self.seen == self.at:
            write_lease(self.run_dir, os.getppid(), generation=99)


def test_a_writer_that_lost_the_lease_stops_before_committing(tmp_path):
    run_dir = str(tmp_path / "run")
    with pytest.raises(engine.WriterConflict, match="generation 99"):
        train_with_checkpoints("tbptt", run_dir, keep_last=None, callbacks=(TakeOver(run_dir, 5),))
    names = CheckpointStore(Storage(run_dir)).names()
    assert len(names) == 4  # splits 1-4; split 5's checkpoint was refused


@pytest.mark.slow
def test_second_process_is_refused_and_first_one_finishes_exactly(tmp_path):
    reference = str(tmp_path / "reference")
    train_with_checkpoints("tbptt", reference, epochs=4)
    run_dir = str(tmp_path / "run")
    first = forkserver.popen([sys.executable, SCRIPT, "tbptt", run_dir, "--epochs", "4", "--sleep", "0.2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(None))
    try:
        assert first.stdout.readline().startswith("training")
        second = forkserver.run([sys.executable, SCRIPT, "tbptt", run_dir, "--epochs", "4"], capture_output=True,
                                text=True, env=environment(None), timeout=120)
        first_still_running = first.poll() is None
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == 1 and "WriterConflict" in second.stderr, second.stderr[-2000:]
    assert first_still_running
    assert first.returncode == 0, err[-2000:]
    assert all(info.valid for info in CheckpointStore(Storage(run_dir)).inspect())
    assert_same_run(reference, run_dir)


@pytest.mark.slow
def test_relaunch_after_the_first_writer_was_killed_takes_over(tmp_path):
    reference = str(tmp_path / "reference")
    train_with_checkpoints("tbptt", reference, epochs=6)
    run_dir = str(tmp_path / "run")
    first = forkserver.popen([sys.executable, SCRIPT, "tbptt", run_dir, "--epochs", "6"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=environment(None))
    assert first.stdout.readline().startswith("training")
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    first.stdout.close()
    first.stderr.close()
    second = forkserver.run([sys.executable, SCRIPT, "tbptt", run_dir, "--epochs", "6"], capture_output=True,
                            text=True, env=environment(None), timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert_same_run(reference, run_dir)
