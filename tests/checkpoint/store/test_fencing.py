"""Fencing: a writer that lost the lease can never make a run resume from its state, delete
another writer's checkpoints, or change metrics.jsonl."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import engine
import forkserver
from engine.checkpoint.format.codec import encode_state
from engine.checkpoint.store.request import CommitCallbacks, CommitRequest
from engine.checkpoint.store.lease import LEASE_FILE, WriterLease, read_fences
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.metrics_log import METRICS_FILE
from kill_helpers import SCRIPT, AtSplit, environment
from progress import Cursor, ProgressTree, encode_tree
from resume_helpers import assert_same_run, read_metrics
from scenarios import train_with_checkpoints


def commit(store, sequence, generation, value=0.0, fence=None):
    encoded = encode_state({"weight": torch.full((3,), float(value))})
    cursor = Cursor(0, 0, sequence, 0)
    return store.write(CommitRequest.of_state(encoded, encode_tree(ProgressTree(cursor=cursor)), cursor, generation,
                                              sequence=sequence), CommitCallbacks(fence=fence))


def run_dir_for(tmp_path, where):
    return str(tmp_path / "run") if where == "local" else f"memory://fencing-{tmp_path.name}"


# ---- metrics.jsonl -------------------------------------------------------------------------------
def take_over(run_dir):
    """Plays a relaunched job that took the lease while this one still runs."""
    record = {"token": "newcomer", "generation": 99, "pid": 1, "host": socket.gethostname(), "released": False}
    # Replaced in one step, as a real writer's lease is: a background writer checking the
    # fence meanwhile must never see a half-written file.
    Storage(run_dir).write(LEASE_FILE + ".test-tmp", [json.dumps(record).encode()], durable=False)
    os.replace(os.path.join(run_dir, LEASE_FILE + ".test-tmp"), os.path.join(run_dir, LEASE_FILE))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_writer_that_lost_the_lease_appends_nothing_to_metrics(tmp_path, asynchronous):
    run_dir = str(tmp_path / "run")
    with pytest.raises(engine.WriterConflict, match="generation 99"):
        train_with_checkpoints("tbptt", run_dir, keep_last=None, asynchronous=asynchronous,
                               callbacks=(AtSplit(5, take_over, run_dir),))
    newest = CheckpointStore(Storage(run_dir)).latest()
    metrics = read_metrics(run_dir)
    lines = metrics.decode().splitlines()
    # No line of split 5, which completed after the lease was lost (the background writer may
    # have appended lines of a commit it started while it still held the lease).
    assert len(lines) <= 4
    assert len(metrics) >= newest.state["metrics_bytes"]
    if not asynchronous:
        assert newest.progress.cursor == Cursor(0, 0, 3, 0)  # split 4's checkpoint; split 5's was refused
        assert len(lines) == 4 and len(metrics) == newest.state["metrics_bytes"]


# ---- the fence at the commit point ---------------------------------------------------------------
@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_fence_that_fails_at_the_commit_point_commits_nothing(tmp_path, where):
    store = CheckpointStore(Storage(run_dir_for(tmp_path, where)))
    commit(store, 1, generation=1)

    def lost():
        raise engine.WriterConflict("the lease now belongs to generation 2")

    with pytest.raises(engine.WriterConflict):
        commit(store, 2, generation=1, fence=lost)
    assert store.names() == ["ckpt-0000000001"]
    assert store.storage.list_names("checkpoints") == ["ckpt-0000000001"]  # no staging left either


def test_checkpoints_are_ordered_by_writer_generation_then_sequence(tmp_path):
    """A stale writer (generation 1) that commits late, with a higher sequence number, never
    outranks the writer that took over (generation 2)."""
    store = CheckpointStore(Storage(str(tmp_path / "run")))
    commit(store, 4, generation=1, value=4)
    commit(store, 5, generation=2, value=5)
    commit(store, 6, generation=1, value=6)  # the stale writer's late commit
    assert store.latest().name == "ckpt-0000000005"
    assert store.newest_generation() == 2
    assert [info.name for info in store.inspect()] == ["ckpt-0000000004", "ckpt-0000000006", "ckpt-0000000005"]


def test_retention_never_deletes_a_newer_generations_checkpoints(tmp_path):
    store = CheckpointStore(Storage(str(tmp_path / "run")))
    for sequence in (1, 2, 3):
        commit(store, sequence, generation=2)
    commit(store, 4, generation=1)
    store.apply_retention(keep_last=1, generation=1)  # as a stale generation-1 writer would
    assert store.names() == ["ckpt-0000000001", "ckpt-0000000002", "ckpt-0000000003"]  # only its own went
    store.apply_retention(keep_last=1, generation=2)  # the holder keeps its newest
    assert store.names() == ["ckpt-0000000003"]


# ---- real processes ------------------------------------------------------------------------------
def wait_until_stopped(pid):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as handle:
            if handle.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} did not stop")


@pytest.mark.exhaustive  # CI time (about 40 s: the default run keeps the frozen writer on a local disk)
@pytest.mark.slow
def test_a_writer_frozen_after_its_fence_check_cannot_change_the_run_after_a_takeover(tmp_path):
    """Object-store protocol (no flock, heartbeat lease, manifest as the commit point), shared by
    real processes: the first writer freezes right after the fence check of its 5th commit,
    the second takes over once the lease stays unchanged for 2 s and finishes the run, then the
    first one wakes up and commits its stale checkpoint."""
    reference = str(tmp_path / "reference")
    train_with_checkpoints("tbptt", reference)
    run_dir = f"objectdir://{tmp_path}/run"
    common = ["--lease-expiry", "2", "--keep-last", "0"]
    stale = forkserver.popen([sys.executable, SCRIPT, "tbptt", run_dir, *common, "--stop-after-fence", "5"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(None))
    try:
        assert stale.stdout.readline().startswith("training"), stale.stderr.read()[-2000:]
        assert stale.stdout.readline().startswith("frozen")
        wait_until_stopped(stale.pid)
        newcomer = forkserver.run([sys.executable, SCRIPT, "tbptt", run_dir, *common], capture_output=True,
                                  text=True, env=environment(None), timeout=300)
        assert newcomer.returncode == 0, newcomer.stderr[-2000:]
        assert "resumed_from=ckpt-0000000004" in newcomer.stdout
        store = CheckpointStore(Storage(run_dir))
        final = store.latest().name
        metrics = read_metrics(run_dir)
        stale.send_signal(signal.SIGCONT)
        out, err = stale.communicate(timeout=120)
    finally:
        if stale.poll() is None:
            stale.kill()
            stale.communicate()
    assert stale.returncode == 1 and "WriterConflict" in err, err[-2000:]
    # The stale checkpoint was committed (its manifest is the commit point it had passed) ...
    assert CheckpointStore(Storage(run_dir)).storage.exists("checkpoints/ckpt-0000000005/MANIFEST.json")
    stale_info = next(i for i in CheckpointStore(Storage(run_dir)).inspect() if i.name == "ckpt-0000000005")
    assert not stale_info.valid and "stale writer" in stale_info.error
    # ... but it is never resumed from, deleted none of the newcomer's, and left metrics alone.
    assert CheckpointStore(Storage(run_dir)).latest().name == final
    assert read_metrics(run_dir) == metrics
    assert_same_run(reference, run_dir)
    again = forkserver.run([sys.executable, SCRIPT, "tbptt", run_dir, *common], capture_output=True, text=True,
                           env=environment(None), timeout=300)
    assert again.returncode == 0 and f"resumed_from={final}" in again.stdout, again.stderr[-2000:]
    assert read_metrics(run_dir) == metrics


@pytest.mark.slow
def test_a_writer_frozen_after_its_fence_check_on_a_local_disk_keeps_the_lease(tmp_path):
    """On a local disk a frozen writer still holds its flock: nobody takes over, and once it
    runs again it finishes the run exactly."""
    reference = str(tmp_path / "reference")
    train_with_checkpoints("tbptt", reference)
    run_dir = str(tmp_path / "run")
    frozen = forkserver.popen([sys.executable, SCRIPT, "tbptt", run_dir, "--stop-after-fence", "5"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(None))
    try:
        assert frozen.stdout.readline().startswith("training"), frozen.stderr.read()[-2000:]
        assert frozen.stdout.readline().startswith("frozen")
        wait_until_stopped(frozen.pid)
        newcomer = forkserver.run([sys.executable, SCRIPT, "tbptt", run_dir], capture_output=True, text=True,
                                  env=environment(None), timeout=300)
        frozen.send_signal(signal.SIGCONT)
        out, err = frozen.communicate(timeout=300)
    finally:
        if frozen.poll() is None:
            frozen.kill()
            frozen.communicate()
    assert newcomer.returncode == 1 and "WriterConflict" in newcomer.stderr, newcomer.stderr[-2000:]
    assert frozen.returncode == 0, err[-2000:]
    assert_same_run(reference, run_dir)
    assert not os.path.exists(os.path.join(run_dir, METRICS_FILE + ".tmp"))


def test_a_stale_commit_after_a_takeover_is_never_resumed_even_before_the_new_writer_commits(tmp_path):
    """The new writer records, at its takeover, the highest committed sequence; a checkpoint of
    an older generation above it was committed by a writer that had lost the lease."""
    run_dir = f"memory://fenced-{tmp_path.name}"
    storage = Storage(run_dir)
    store = CheckpointStore(storage)
    storage.write(LEASE_FILE, [json.dumps({"token": "old", "generation": 1, "pid": 1, "host": "a",
                                           "released": False}).encode()], durable=False)
    commit(store, 1, generation=1)
    commit(store, 2, generation=1)
    newcomer = WriterLease(Storage(run_dir), stale_after=0.2)  # the old writer froze: its lease stays
    assert newcomer.acquire(committed_sequence=store.newest_committed_sequence) == 2
    commit(store, 3, generation=1)  # the old writer wakes up and commits; the newcomer then crashes
    assert CheckpointStore(Storage(run_dir)).latest().name == "ckpt-0000000002"
    stale = next(info for info in CheckpointStore(Storage(run_dir)).inspect() if info.name == "ckpt-0000000003")
    assert not stale.valid and "stale writer" in stale.error
    # A later takeover keeps the earlier fence.
    newcomer._stop_heartbeat.set()  # the newcomer crashes: its heartbeat stops, its lease stays
    newcomer._heartbeat.join()
    later = WriterLease(Storage(run_dir), stale_after=0.2)
    assert later.acquire(committed_sequence=store.newest_committed_sequence) == 3
    assert read_fences(Storage(run_dir)) == [(2, 2), (3, 3)]
    assert CheckpointStore(Storage(run_dir)).latest().name == "ckpt-0000000002"
    later.release()
