"""A fast tier (CheckpointConfig.local_tier) is bound to one run, whatever the storage of its
run directory (here ``s3://`` on a real S3 protocol server, tests/s3_server.py): another run
that is given it while that run is live is refused and touches nothing; and a checkpoint that
another run wrote there (recorded in its manifest) is reported and skipped, never resumed from.
Real processes, a real SIGKILL, every resume compared bit for bit."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

import engine
from engine.checkpoint.format.codec import encode_state
from engine.checkpoint.store.request import CommitRequest
from engine.checkpoint.format.manifest import Manifest
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
import forkserver
from kill_helpers import SCRIPT, TIMEOUT, environment, run_scenario
from progress import Cursor, ProgressTree, encode_tree
from resume_helpers import assert_same_run
from s3_server import s3_endpoint, s3_run_url  # noqa: F401  (fixtures)
from scenarios import train_with_checkpoints

OTHER_SEED = 99  # the other run: same setup, other weights and data order
LEASE_EXPIRY = 1.0  # seconds a restart waits for a killed writer's S3 lease to go stale


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("reference"))
    train_with_checkpoints("tbptt", run_dir)
    return run_dir


def fast_names(fast):
    return CheckpointStore(Storage(fast), create=False).committed_names()


def another_bucket(s3_run_url):
    """A second run directory on the same server (``s3_run_url`` made a bucket per test)."""
    return s3_run_url[:-len("/run")] + "/other-run"


@pytest.mark.exhaustive  # CI time (about 35 s): the default run keeps another run's checkpoints in a tier never resumed from
def test_a_tier_in_use_by_a_live_s3_run_is_refused_and_that_run_is_untouched(s3_run_url, reference, tmp_path):
    fast = str(tmp_path / "node" / "fast")
    live_run = another_bucket(s3_run_url)
    hold = tmp_path / "hold"  # the live run waits after its second split while this file exists
    hold.touch()
    with tempfile.TemporaryFile(mode="w+") as stderr:
        process = forkserver.popen([sys.executable, SCRIPT, "tbptt", live_run, "--local-tier", fast, "--durable-every", "4",
                                    "--hold-while", str(hold)], env=environment(None), stdout=subprocess.PIPE,
                                   stderr=stderr, text=True)
        try:
            assert process.stdout.readline().startswith("training")
            with pytest.raises(engine.ConfigError, match="fast tier of another run.*running now"):
                train_with_checkpoints("tbptt", s3_run_url, tier=(fast, 4))
            hold.unlink()
            process.wait(TIMEOUT)
            stderr.seek(0)
            assert process.returncode == 0, stderr.read()[-3000:]
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            process.stdout.close()
    assert_same_run(reference, live_run)  # the live run never noticed
    # Once that run has ended, the tier is taken over (its checkpoints are not this run's).
    with pytest.warns(UserWarning, match="ignoring the fast checkpoint tier"):
        result = train_with_checkpoints("tbptt", s3_run_url, tier=(fast, 4))
    assert result.resumed_from is None
    assert_same_run(reference, s3_run_url)


@pytest.mark.slow
def test_checkpoints_another_run_wrote_into_the_tier_are_never_resumed_from(s3_run_url, reference, tmp_path):
    """This run is SIGKILLed after its 6th split; another run (another seed) wrote further
    checkpoints into the same tier meanwhile, without holding its lock (as from another mount of
    it): the resume skips them and continues this run exactly."""
    fast = str(tmp_path / "node" / "fast")
    process = run_scenario("tbptt", s3_run_url, "split_end:6:sigkill", "--local-tier", fast, "--durable-every", "1000",
                           "--lease-expiry", str(LEASE_EXPIRY))
    assert process.returncode == -signal.SIGKILL, process.stderr[-3000:]
    ours = fast_names(fast)
    other_fast = str(tmp_path / "other-node" / "fast")
    process = run_scenario("tbptt", another_bucket(s3_run_url), "split_end:10:sigkill", "--local-tier", other_fast,
                           "--durable-every", "1000", "--seed", str(OTHER_SEED))
    assert process.returncode == -signal.SIGKILL, process.stderr[-3000:]
    theirs = [name for name in fast_names(other_fast) if name > ours[-1]]
    assert theirs
    for name in theirs:
        shutil.copytree(os.path.join(other_fast, "checkpoints", name), os.path.join(fast, "checkpoints", name))
    with pytest.warns(UserWarning, match=f"skipping checkpoint {theirs[-1]}.*written by another run"):
        result = train_with_checkpoints("tbptt", s3_run_url, tier=(fast, 1000), lease_expiry=LEASE_EXPIRY)
    assert result.resumed_from == ours[-1]
    assert_same_run(reference, s3_run_url)


def commit(store, sequence):
    cursor = Cursor(0, 0, sequence, 0)
    return store.write(CommitRequest.of_state(encode_state({"weight": torch.full((3,), float(sequence))}),
                                              encode_tree(ProgressTree(cursor=cursor)), cursor, 1, sequence=sequence))


def test_a_store_bound_to_a_run_reads_only_that_runs_checkpoints(tmp_path):
    store = CheckpointStore(Storage(str(tmp_path)))
    unbound = commit(store, 1)  # as written by an earlier version: no run recorded
    store.run = "a" * 32
    mine = commit(store, 2)
    other = CheckpointStore(Storage(str(tmp_path)))
    other.run = "b" * 32
    theirs = commit(other, 3)
    reader = CheckpointStore(Storage(str(tmp_path)))
    reader.run = "a" * 32
    assert reader.load(mine).manifest.run == "a" * 32
    for name, recorded in ((unbound, None), (theirs, "b" * 32)):
        with pytest.raises(engine.CheckpointIncompatible, match=f"{name}: written by another run \\(run {recorded!r}"):
            reader.load(name)
    with pytest.warns(UserWarning, match=f"skipping checkpoint {theirs}: .*written by another run"):
        assert reader.latest().name == mine
    assert CheckpointStore(Storage(str(tmp_path))).latest().name == theirs  # an unbound reader (the run dir's) reads all


@pytest.mark.parametrize("value", [5, "", "x" * 65, None])
def test_a_malformed_run_in_a_manifest_is_corrupt(value):
    manifest = json.loads(Manifest(1, None, {}, 0.0, 1, run="r").to_json())
    assert manifest["run"] == "r"
    manifest["run"] = value
    with pytest.raises(engine.CheckpointCorrupt, match="'run' must be a string"):
        Manifest.from_json(json.dumps(manifest).encode())
