"""The fast local tier (CheckpointConfig(local_tier=..., durable_every_n_splits=...)): real
SIGKILLs at split boundaries and inside the commits of both tiers, a lost node, corruption of
either tier, fencing of a stale fast tier, preemption and the end of a run reaching the
durable tier; every resume is compared bit for bit with an uninterrupted run."""

import os
import shutil
import signal

import pytest

import engine
from engine.checkpoint.store.lease import WriterLease
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from kill_helpers import AtSplit, run_scenario, sigterm_to_self
from progress import Cursor
from resume_helpers import assert_same_run
from scenarios import train_with_checkpoints

DURABLE_EVERY = 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("reference"))
    train_with_checkpoints("tbptt", run_dir)
    return run_dir


def paths(tmp_path):
    return str(tmp_path / "run"), str(tmp_path / "node" / "fast")


def newest(directory):
    return CheckpointStore(Storage(directory), create=False).latest()


def killed(run_dir, fast, fault, *args):
    process = run_scenario("tbptt", run_dir, fault, "--local-tier", fast, "--durable-every", str(DURABLE_EVERY), *args)
    assert process.returncode == -signal.SIGKILL, process.stderr[-3000:]


def resume(run_dir, fast, durable_every=DURABLE_EVERY, **extra):
    return train_with_checkpoints("tbptt", run_dir, tier=(fast, durable_every), **extra)


def flip_a_byte(directory, name):
    path = os.path.join(directory, "checkpoints", name, "tensors.bin")
    with open(path, "r+b") as handle:
        first = handle.read(1)
        handle.seek(0)
        handle.write(bytes([first[0] ^ 0xFF]))


def test_a_kill_resumes_from_the_fast_tier_at_the_interrupted_split(tmp_path, reference):
    run_dir, fast = paths(tmp_path)
    killed(run_dir, fast, "split_end_after_checkpoint:6:sigkill")
    in_fast = newest(fast)
    assert in_fast.progress.cursor == Cursor(0, 1, 1, 0)  # the 6th split: batch 1, split 1
    in_durable = newest(run_dir)
    assert in_durable is None or in_durable.name < in_fast.name
    result = resume(run_dir, fast)
    assert result.resumed_from == in_fast.name
    assert_same_run(reference, run_dir)


# First split, a batch's last split, an epoch's last split (epoch-end work follows), the run's
# last split (its final checkpoint is made durable at the end): cursor after each.
BOUNDARIES = [(1, Cursor(0, 0, 0, 0)), (8, Cursor(0, 1, 3, 0)), (12, Cursor(0, 2, 3, 0)), (24, Cursor(1, 2, 3, 0))]


@pytest.mark.parametrize("split, cursor", BOUNDARIES, ids=[str(split) for split, _ in BOUNDARIES])
def test_a_kill_after_a_boundary_resumes_from_the_fast_tier_exactly(split, cursor, tmp_path, reference):
    run_dir, fast = paths(tmp_path)
    killed(run_dir, fast, f"split_end_after_checkpoint:{split}:sigkill")
    assert newest(fast).progress.cursor == cursor
    resume(run_dir, fast)
    assert_same_run(reference, run_dir)


def test_retention_keeps_the_newest_checkpoints_of_both_tiers_and_they_verify(tmp_path):
    run_dir, fast = paths(tmp_path)
    resume(run_dir, fast, keep_last=2)
    for directory in (run_dir, fast):
        store = CheckpointStore(Storage(directory), create=False)
        names = store.committed_names()
        assert 1 <= len(names) <= 2, (directory, names)
        for name in names:
            store.load(name)  # verifies
    assert CheckpointStore(Storage(fast), create=False).names()[-1] == newest(run_dir).name


def test_a_lost_node_resumes_from_the_durable_tier(tmp_path, reference):
    run_dir, fast = paths(tmp_path)
    # Killed six splits (0.6 s of sleep, at least) after the 4th checkpoint's durable copy was
    # requested: time enough for it on a loaded machine.
    killed(run_dir, fast, "split_end_after_checkpoint:10:sigkill", "--sleep", "0.1")
    in_durable = newest(run_dir)
    assert in_durable is not None and in_durable.name < newest(fast).name
    shutil.rmtree(os.path.dirname(fast))  # the node is gone, and its /dev/shm with it
    result = resume(run_dir, fast)
    assert result.resumed_from == in_durable.name
    assert_same_run(reference, run_dir)


# The durable copy of the 4th checkpoint is the 5th commit: the scenario sleeps after each split
# so that the background copy is done before the 5th split's fast commit.
COMMIT_FAULTS = [
    "checkpoint_before_file:13:sigkill",   # the durable copy, before its tensors.bin
    "checkpoint_before_manifest:5:sigkill",
    "checkpoint_before_rename:5:sigkill",  # inside the durable commit
    "checkpoint_after_rename:5:sigkill",   # the durable copy committed
    "checkpoint_before_rename:6:sigkill",  # inside the 5th fast commit
    "checkpoint_retention:2:sigkill",
]


@pytest.mark.parametrize("fault", COMMIT_FAULTS)
def test_a_kill_inside_the_commit_of_either_tier_resumes_exactly(fault, tmp_path, reference):
    run_dir, fast = paths(tmp_path)
    killed(run_dir, fast, fault, "--sleep", "0.2")
    candidates = [loaded for loaded in (newest(run_dir), newest(fast)) if loaded is not None]
    expected = max(candidates, key=lambda loaded: loaded.name)
    result = resume(run_dir, fast)
    assert result.resumed_from == expected.name
    assert_same_run(reference, run_dir)


def test_a_corrupt_newest_fast_checkpoint_falls_back(tmp_path, reference):
    run_dir, fast = paths(tmp_path)
    killed(run_dir, fast, "split_end_after_checkpoint:6:sigkill")
    corrupt = newest(fast).name
    flip_a_byte(fast, corrupt)
    with pytest.warns(UserWarning, match=f"skipping checkpoint {corrupt}"):
        result = resume(run_dir, fast)
    assert result.resumed_from is not None and result.resumed_from < corrupt
    assert_same_run(reference, run_dir)


def test_a_corrupt_newest_durable_checkpoint_falls_back(tmp_path, reference):
    run_dir, fast = paths(tmp_path)
    killed(run_dir, fast, "split_end_after_checkpoint:14:sigkill", "--sleep", "0.05", "--keep-last", "0")
    durable_names = CheckpointStore(Storage(run_dir)).committed_names()
    assert len(durable_names) >= 2
    flip_a_byte(run_dir, durable_names[-1])
    shutil.rmtree(os.path.dirname(fast))
    with pytest.warns(UserWarning, match=f"skipping checkpoint {durable_names[-1]}"):
        result = resume(run_dir, fast)
    assert result.resumed_from == durable_names[-2]
    assert_same_run(reference, run_dir)


def test_a_fast_tier_of_a_superseded_writer_is_ignored(tmp_path, reference):
    run_dir, fast = paths(tmp_path)
    killed(run_dir, fast, "split_end_after_checkpoint:6:sigkill", "--sleep", "0.05")  # generation 1
    stale = newest(fast)
    in_durable = newest(run_dir)
    # Generation 2 trains on from the stale tier's checkpoint with another fast tier and
    # never makes a checkpoint durable before it dies.
    other = str(tmp_path / "other-node" / "fast")
    process = run_scenario("tbptt", run_dir, "split_end_after_checkpoint:3:sigkill", "--local-tier", other,
                           "--durable-every", "1000")
    assert process.returncode == -signal.SIGKILL, process.stderr[-3000:]
    with pytest.warns(UserWarning, match="ignoring the fast checkpoint tier"):
        result = resume(run_dir, fast)  # generation 3, back on the first node
    assert result.resumed_from == in_durable.name != stale.name
    assert_same_run(reference, run_dir)


def test_a_fast_tier_of_another_run_is_ignored(tmp_path, reference):
    _, fast = paths(tmp_path)
    killed(str(tmp_path / "another-run"), fast, "split_end_after_checkpoint:6:sigkill")
    run_dir = str(tmp_path / "run")
    with pytest.warns(UserWarning, match="ignoring the fast checkpoint tier"):
        result = resume(run_dir, fast)
    assert result.resumed_from is None
    assert_same_run(reference, run_dir)


def test_the_fast_tier_of_a_run_that_is_writing_now_is_refused_and_left_alone(tmp_path, reference):
    _, fast = paths(tmp_path)
    another_run = str(tmp_path / "another-run")
    killed(another_run, fast, "split_end_after_checkpoint:6:sigkill")
    theirs = CheckpointStore(Storage(fast), create=False).committed_names()
    lease = WriterLease(Storage(another_run))
    lease.acquire()  # the other run is live again (its writer holds the lock)
    try:
        with pytest.raises(engine.ConfigError, match="fast tier of another run.*writer is running now"):
            resume(str(tmp_path / "run"), fast)
        assert CheckpointStore(Storage(fast), create=False).committed_names() == theirs
        assert newest(fast).progress.cursor == Cursor(0, 1, 1, 0)
    finally:
        lease.release()
    with pytest.warns(UserWarning, match="ignoring the fast checkpoint tier"):  # no longer live: taken over
        resume(str(tmp_path / "run"), fast)
    assert_same_run(reference, str(tmp_path / "run"))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_preemption_checkpoint_reaches_the_durable_tier(asynchronous, tmp_path, reference):
    run_dir, fast = paths(tmp_path)
    with pytest.raises(SystemExit):
        resume(run_dir, fast, durable_every=1000, asynchronous=asynchronous, callbacks=(AtSplit(10, sigterm_to_self),))
    assert newest(run_dir).progress.cursor == Cursor(0, 2, 1, 0)  # split 10
    shutil.rmtree(os.path.dirname(fast))
    result = resume(run_dir, fast, asynchronous=asynchronous)
    assert result.resumed_cursor == Cursor(0, 2, 1, 0)
    assert_same_run(reference, run_dir)


def test_the_last_checkpoint_of_a_run_reaches_the_durable_tier(tmp_path):
    run_dir, fast = paths(tmp_path)
    result = resume(run_dir, fast, durable_every=1000)
    assert newest(run_dir).name == result.last_checkpoint == newest(fast).name


def test_a_run_killed_while_copying_its_last_checkpoint_to_the_durable_tier_completes_the_copy(tmp_path, reference):
    """The process dies inside the durable copy of the run's last checkpoint, after training
    ended: the resumed run has nothing left to train, and still makes that state durable
    (before, it resumed at the end and stopped, leaving the durable tier behind for good)."""
    counted = train_with_checkpoints("tbptt", str(tmp_path / "counted"), tier=(str(tmp_path / "counted-fast"), 1000))
    fast_commits = int(counted.last_checkpoint[len("ckpt-"):])  # the commit after them is the durable copy
    run_dir, fast = paths(tmp_path)
    process = run_scenario("tbptt", run_dir, f"checkpoint_before_rename:{fast_commits + 1}:sigkill",
                           "--local-tier", fast, "--durable-every", "1000")
    assert process.returncode == -signal.SIGKILL, process.stderr[-3000:]
    end = newest(fast)
    assert end.name == counted.last_checkpoint and end.progress.cursor == Cursor(1, 2, 3, 0)
    assert newest(run_dir) is None or newest(run_dir).name < end.name
    result = resume(run_dir, fast, durable_every=1000)
    assert result.resumed_from == end.name
    assert newest(run_dir).progress.cursor == end.progress.cursor
    shutil.rmtree(os.path.dirname(fast))  # then the node is lost: the durable tier has it all
    assert_same_run(reference, run_dir)


@pytest.mark.parametrize("settings, field", [
    (dict(durable_every_n_splits=4), "durable_every_n_splits"),
    (dict(local_tier="/dev/shm/x"), "durable_every_n_splits and/or"),
    (dict(local_tier="s3://bucket/x", durable_every_n_splits=4), "local_tier"),
    (dict(local_tier="/dev/shm/x", durable_every_seconds=0), "durable_every_seconds"),
])
def test_tier_settings_are_validated(settings, field):
    with pytest.raises(engine.ConfigError, match=field):
        engine.CheckpointConfig(**settings)
