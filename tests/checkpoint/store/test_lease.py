"""A second writer on the same run directory is detected and refused; it never interleaves."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import fsspec
import pytest

import engine
import forkserver
from engine import faults
from engine.checkpoint.store.lease import LEASE_FILE, WriterLease
from engine.faults.faulty_fs import FaultyFileSystem
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.storage import Storage
from progress import Cursor
from kill_helpers import SCRIPT, WITH_A_WRITER_PROCESS, AtSplit, environment
from resume_helpers import assert_same_run
from scenarios import train_with_checkpoints


def write_lease(run_dir, pid, host=None, generation=3, token="someone-else"):
    os.makedirs(run_dir, exist_ok=True)
    record = {"token": token, "generation": generation, "pid": pid, "host": host or socket.gethostname(),
              "heartbeat_unix": 0.0}
    # Replaced whole, as the engine writes it: a writer process checking the lease meanwhile
    # never reads a half-written file.
    temporary = os.path.join(run_dir, f".{LEASE_FILE}.test")
    with open(temporary, "w") as handle:
        json.dump(record, handle)
    os.replace(temporary, os.path.join(run_dir, LEASE_FILE))


def test_a_live_holder_of_the_lock_is_refused(tmp_path):
    run_dir = str(tmp_path / "run")
    holder = WriterLease(Storage(run_dir))
    holder.acquire()
    try:
        with pytest.raises(engine.WriterConflict, match=f"generation 1 \\(pid {os.getpid()}"):
            train_with_checkpoints("plain", run_dir)
    finally:
        holder.release()
    assert not CheckpointStore(Storage(run_dir)).names()


def test_a_lease_naming_a_live_pid_does_not_block_when_nobody_holds_the_lock(tmp_path):
    """Liveness never trusts a pid: a restarted container's entrypoint often gets the dead
    holder's pid (here: a pid that is alive on this host, our parent's)."""
    run_dir = str(tmp_path / "run")
    write_lease(run_dir, os.getppid(), generation=4)
    result = train_with_checkpoints("plain", run_dir)
    assert result.resumed_from is None
    store = CheckpointStore(Storage(run_dir))
    assert {store.load(name).manifest.writer_generation for name in store.names()} == {5}


def test_a_dead_holder_is_taken_over_with_a_new_generation(tmp_path):
    run_dir = str(tmp_path / "run")
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_lease(run_dir, int(finished.stdout), generation=6)
    train_with_checkpoints("plain", run_dir)
    store = CheckpointStore(Storage(run_dir))
    assert {store.load(name).manifest.writer_generation for name in store.names()} == {7}
    with open(os.path.join(run_dir, LEASE_FILE)) as handle:
        record = json.load(handle)
    assert record["released"] is True and record["generation"] == 7  # kept, so generations only grow
    assert WriterLease(Storage(run_dir)).acquire() == 8


def test_other_host_with_an_old_heartbeat_is_taken_over_at_once_on_a_local_disk(tmp_path):
    run_dir = str(tmp_path / "run")
    write_lease(run_dir, 1, host="another-host")
    assert train_with_checkpoints("plain", run_dir).resumed_from is None


def test_a_lease_temporary_left_by_a_killed_writer_is_removed(tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    left_behind = os.path.join(run_dir, f"{LEASE_FILE}.4242.tmp")
    with open(left_behind, "w") as handle:
        handle.write("{")
    lease = WriterLease(Storage(run_dir))
    lease.acquire()
    lease.release()
    assert not os.path.exists(left_behind)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_enospc_while_replacing_the_lease_leaves_no_temporary(tmp_path, where):
    run_dir = str(tmp_path / "run") if where == "local" else f"memory://enospc-lease-{os.getpid()}"
    inner, _ = fsspec.core.url_to_fs(run_dir)
    storage = Storage(run_dir, filesystem=FaultyFileSystem(inner))
    # Arrival 1 writes writer.lease.<pid>.tmp, arrival 2 renames it over writer.lease.
    faults.inject([faults.Fault("filesystem_write", 2, "enospc")])
    try:
        with pytest.raises(OSError, match="No space left"):
            WriterLease(storage).acquire()
    finally:
        faults.clear()
    assert [path for path in inner.ls(storage.root, detail=False) if path.endswith(".tmp")] == []
    lease = WriterLease(storage)  # the lock was dropped with the failure
    assert lease.acquire() == 1
    lease.release()


# ---- object stores: a heartbeat timed by the reader -------------------------------------------
def memory_run(tmp_path):
    return f"memory://lease-{tmp_path.name}"


def write_memory_lease(run_dir, **record):
    storage = Storage(run_dir)
    storage.write(LEASE_FILE, [json.dumps(record).encode()], durable=False)
    return storage


def test_a_heartbeat_from_a_clock_running_ahead_does_not_block_takeover(tmp_path):
    """A dead holder whose host clock ran an hour ahead: its lease stays unchanged, and that is
    all the newcomer times, with its own clock."""
    run_dir = memory_run(tmp_path)
    storage = write_memory_lease(run_dir, token="fast-clock", generation=3, pid=1, host="fast-host",
                                 heartbeat_unix=time.time() + 3600)
    lease = WriterLease(storage, stale_after=0.5)
    assert lease.acquire() == 4
    lease.release()


def test_a_live_heartbeat_is_not_taken_over(tmp_path):
    run_dir = memory_run(tmp_path)
    holder = WriterLease(Storage(run_dir), stale_after=3.0)
    holder.acquire()
    try:
        with pytest.raises(engine.WriterConflict, match="heartbeat moved"):
            WriterLease(Storage(run_dir), stale_after=3.0).acquire()
        holder.verify()  # still the holder
    finally:
        holder.release()


def test_a_released_lease_is_taken_at_once_and_a_taken_over_writer_is_fenced(tmp_path):
    run_dir = memory_run(tmp_path)
    first = WriterLease(Storage(run_dir), stale_after=3600.0)
    first.acquire()
    first.release()
    second = WriterLease(Storage(run_dir), stale_after=3600.0)  # would wait an hour for a held lease
    assert second.acquire() == 2
    write_memory_lease(run_dir, token="newcomer", generation=3, pid=1, host="elsewhere", released=False)
    with pytest.raises(engine.WriterConflict, match="generation 3"):
        second.verify()


def take_over(run_dir):
    """Plays a relaunched job that took the lease while this one still runs."""
    write_lease(run_dir, os.getppid(), generation=99)


@WITH_A_WRITER_PROCESS
def test_a_writer_that_lost_the_lease_stops_before_committing(test_writer, tmp_path, capfd):
    run_dir = str(tmp_path / "run")
    with pytest.raises(engine.WriterConflict, match="generation 99"):
        train_with_checkpoints("tbptt", run_dir, keep_last=None, callbacks=(AtSplit(5, take_over, run_dir),))
    store = CheckpointStore(Storage(run_dir))
    cursors = [store.load(name).progress.cursor for name in store.names()]
    # splits 1-4 at most: split 5's checkpoint was refused, and so was any written in the
    # background that was not committed when the lease was lost
    assert cursors == [Cursor(0, 0, split, 0) for split in range(len(cursors))] and len(cursors) <= 4
    if test_writer != "process":
        assert len(cursors) == 4  # synchronous: each committed before the next split
    # a writer process that stopped for the lost lease is not restarted
    assert "restarting it" not in capfd.readouterr().err


def second_run_while_the_first_is_held(tmp_path, run_dir, *args, after_a_checkpoint=False):
    """Start the tbptt scenario in ``run_dir`` (``args`` added), held after its second split;
    run a second one on the same run dir meanwhile (after the first's first checkpoint with
    ``after_a_checkpoint``), then let the first finish. (second, whether the first was still
    running when the second ended, the first's return code, its stderr)."""
    hold = tmp_path / "hold"  # the first process waits after its second split while this file exists
    hold.touch()
    first = forkserver.popen([sys.executable, SCRIPT, "tbptt", run_dir, *args, "--hold-while", str(hold)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(None))
    try:
        assert first.stdout.readline().startswith("training")
        if after_a_checkpoint:
            wait_for_checkpoints(run_dir, 1)
        second = forkserver.run([sys.executable, SCRIPT, "tbptt", run_dir, *args], capture_output=True,
                                text=True, env=environment(None), timeout=120)
        first_still_running = first.poll() is None
        hold.unlink()
        _, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    return second, first_still_running, first.returncode, err


@pytest.mark.slow
def test_second_process_is_refused_and_first_one_finishes_exactly(tmp_path):
    reference = str(tmp_path / "reference")
    train_with_checkpoints("tbptt", reference, epochs=4)
    run_dir = str(tmp_path / "run")
    second, first_still_running, first_returncode, err = second_run_while_the_first_is_held(
        tmp_path, run_dir, "--epochs", "4")
    assert second.returncode == 1 and "WriterConflict" in second.stderr, second.stderr[-2000:]
    assert first_still_running
    assert first_returncode == 0, err[-2000:]
    assert all(info.valid for info in CheckpointStore(Storage(run_dir)).inspect())
    assert_same_run(reference, run_dir)


@pytest.mark.slow
def test_a_second_process_is_refused_at_once_while_a_training_process_with_a_writer_process_lives(tmp_path):
    """The writer process shares the lease's lock, so writer.lock alone cannot tell a live
    training process from the writer of a killed one finishing its last commit (which a restart
    waits for): the training process's own trainer.lock does, and the second is refused at once."""
    reference = str(tmp_path / "reference")
    train_with_checkpoints("tbptt", reference, epochs=2)
    run_dir = str(tmp_path / "run")
    second, first_still_running, first_returncode, err = second_run_while_the_first_is_held(
        tmp_path, run_dir, "--writer", "process", after_a_checkpoint=True)
    assert second.returncode == 1 and "WriterConflict" in second.stderr, second.stderr[-2000:]
    assert "waiting up to" not in second.stderr, second.stderr[-2000:]
    assert first_still_running
    assert first_returncode == 0, err[-2000:]
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


# ---- real PID namespaces: a restarted container is PID 1 again -----------------------------------
def in_new_pid_namespace(*command, pid_one=True):
    """``unshare --pid --fork --mount-proc``: the command is PID 1 of a fresh PID namespace, or,
    when ``pid_one`` is False, a PID above 200 under a shell (the pids before it are spent on
    short-lived processes), a number no process or thread of a newcomer's namespace has."""
    if not pid_one:
        spend = 'i=0; while [ $i -lt 200 ]; do /bin/true; i=$((i+1)); done; "$@"; exit $?'
        command = ("sh", "-c", spend, "sh", *command)  # the shell stays PID 1
    return ["unshare", "--pid", "--fork", "--mount-proc", *command]


def start_in_namespace(run_dir, *args, pid_one=True):
    return subprocess.Popen(in_new_pid_namespace(sys.executable, SCRIPT, "tbptt", run_dir, *args, pid_one=pid_one),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(None),
                            start_new_session=True)


def wait_for_checkpoints(run_dir, count):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if len(CheckpointStore(Storage(run_dir)).committed_names()) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {count} checkpoints in {run_dir}")


@pytest.mark.exhaustive  # CI time (about 35 s: the default run keeps the live writer in another PID namespace)
@pytest.mark.slow
def test_a_writer_killed_as_pid_1_resumes_when_restarted_as_pid_1(tmp_path):
    reference = str(tmp_path / "reference")
    train_with_checkpoints("tbptt", reference, epochs=4)
    run_dir = str(tmp_path / "run")
    first = start_in_namespace(run_dir, "--epochs", "4", "--sleep", "0.1")
    try:
        assert first.stdout.readline().startswith("training"), first.stderr.read()[-2000:]
        wait_for_checkpoints(run_dir, 2)
        with open(os.path.join(run_dir, LEASE_FILE)) as handle:
            assert json.load(handle)["pid"] == 1  # what the old pid-based liveness saw as "itself"
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    second = subprocess.run(in_new_pid_namespace(sys.executable, SCRIPT, "tbptt", run_dir, "--epochs", "4"),
                            capture_output=True, text=True, env=environment(None), timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed_from=ckpt-" in second.stdout
    assert_same_run(reference, run_dir)


@pytest.mark.slow
def test_a_live_writer_in_another_pid_namespace_is_not_taken_over(tmp_path):
    reference = str(tmp_path / "reference")
    train_with_checkpoints("tbptt", reference, epochs=3)
    run_dir = str(tmp_path / "run")
    # The holder's pid does not exist in the newcomer's namespace: pid-based liveness took it over.
    hold = tmp_path / "hold"  # the first process waits after its second split while this file exists
    hold.touch()
    first = start_in_namespace(run_dir, "--epochs", "3", "--hold-while", str(hold), pid_one=False)
    try:
        assert first.stdout.readline().startswith("training"), first.stderr.read()[-2000:]
        wait_for_checkpoints(run_dir, 1)
        second = subprocess.run(in_new_pid_namespace(sys.executable, SCRIPT, "tbptt", run_dir, "--epochs", "3"),
                                capture_output=True, text=True, env=environment(None), timeout=300)
        first_still_running = first.poll() is None
        hold.unlink()
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.communicate()
    assert second.returncode == 1 and "WriterConflict" in second.stderr, second.stderr[-2000:]
    assert first_still_running
    assert first.returncode == 0, err[-2000:]
    assert_same_run(reference, run_dir)


def test_a_forked_child_does_not_hold_the_writer_lock(tmp_path):
    """DataLoader workers are forked children: one outliving a killed writer must not keep
    the next writer out, so children close the inherited lock at once."""
    run_dir = str(tmp_path / "run")
    lease = WriterLease(Storage(run_dir))
    lease.acquire(minimum_generation=0)
    reader, writer = os.pipe()
    ready_reader, ready_writer = os.pipe()
    child = os.fork()
    if child == 0:  # the child: lives on after the parent releases, like an orphaned worker
        os.close(writer)
        os.write(ready_writer, b"r")  # running (the fork handlers have run)
        os.read(reader, 1)
        os._exit(0)
    os.close(reader)
    os.close(ready_writer)
    assert os.read(ready_reader, 1) == b"r"
    os.close(ready_reader)
    try:
        lease._unlock()  # the writer's own descriptor goes, as when the process dies
        newcomer = WriterLease(Storage(run_dir))
        newcomer.acquire(minimum_generation=0)  # refused if the child still held the flock
        newcomer.release()
    finally:
        os.write(writer, b"x")
        os.close(writer)
        os.waitpid(child, 0)
