"""Memory-first checkpoints under torchrun (engine.distributed.memory_commit): every rank's part in
node memory each split, durable copies only every 50 splits, peer copies on the next node. Killed
ranks and lost nodes resume from memory, replaying at most one split, and end bit-exact."""

from __future__ import annotations

import json
import pathlib
import random
import shutil
import time
import uuid

import pytest

import torchrun_helpers as helpers

pytestmark = pytest.mark.slow

DURABLE_EVERY = "50"


@pytest.fixture
def tiers():
    """A fresh memory-tier root under /dev/shm ('{node}' in it: one directory per node), removed after."""
    root = f"/dev/shm/splitloop-memory-test-{uuid.uuid4().hex[:12]}"
    yield root
    for path in pathlib.Path("/dev/shm").glob(pathlib.Path(root).name + "*"):
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """An uninterrupted 2-rank run without a memory tier (2 epochs, a checkpoint every split)."""
    return helpers.uninterrupted(tmp_path_factory.mktemp("memory-reference"), 2)


def restored_units(run_dir: pathlib.Path, rank: int) -> list[int | None]:
    """The units each attempt of ``rank`` resumed at (None: a fresh start), in order."""
    rows = [json.loads(line) for line in (run_dir / "ledger" / f"rank-{rank:05d}.jsonl").read_text().splitlines()]
    return [row["units"] if row["resumed_from"] is not None else None for row in rows if row["event"] == "restored"]


def durable_sequences(run_dir: pathlib.Path) -> list[int]:
    return sorted(int(path.name[5:]) for path in (run_dir / "checkpoints").glob("ckpt-*"))


def test_a_rank_killed_between_splits_resumes_from_the_memory_tier_exactly(reference: pathlib.Path, tmp_path: pathlib.Path,
                                                                           tiers: str) -> None:
    boundary = random.Random().randint(4, 20)
    process, run_dir, _ = helpers.train(tmp_path, "job", 2, "--memory-tier", tiers, "--durable-every", DURABLE_EVERY,
                                        max_restarts=1, KILLS=f"0/1/split_end:{boundary}:sigkill")
    assert process.returncode == 0, f"killed at split {boundary}: " + process.stderr[-4000:]
    # Killed after its split `boundary` ran, before that split's checkpoint: the one before it is
    # in memory on both ranks (the durable tier holds only the first one by then).
    assert restored_units(run_dir, 0) == [None, boundary - 1] == restored_units(run_dir, 1)
    helpers.assert_same_result(reference, tmp_path / "job", 2)


def test_a_lost_node_comes_back_from_its_peer_copies_exactly(reference: pathlib.Path, tmp_path: pathlib.Path,
                                                            tiers: str) -> None:
    job, per_node = tmp_path / "job", tiers + "-{node}"
    options = ("--memory-tier", per_node, "--peer-copies", "1", "--durable-every", DURABLE_EVERY)
    agents = helpers.start_nodes(job, *options, "--slow", "0.1", forked_ranks=True)
    try:
        helpers.wait_for(lambda: helpers.splits_done(job / "out", 1) >= 6, "training started", agents[0])
        time.sleep(random.Random().uniform(0.0, 0.5))
    finally:
        for agent in reversed(agents):  # every process of the job, as a whole allocation lost
            helpers.kill_node(agent)
    done = [helpers.splits_done(job / "out", rank) for rank in range(2)]
    shutil.rmtree(tiers + "-1")  # node 1 comes back as a new machine: its memory is empty
    restarted = helpers.start_nodes(job, *options, forked_ranks=True)
    statuses = [agent.wait(timeout=helpers.TIMEOUT) for agent in restarted]
    assert statuses == [0, 0], helpers.node_logs(job)
    resumed = restored_units(job / "run", 1)
    assert resumed[0] is None and resumed[1] is not None, resumed
    assert min(done) - resumed[1] <= 1, f"splits done {done}, resumed at {resumed[1]}: more than one split replayed"
    assert pathlib.Path(tiers + "-1", "rank-00001", "checkpoints").is_dir()  # refilled, and written since
    helpers.assert_same_result(reference, job, 2)
