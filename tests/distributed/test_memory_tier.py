"""Memory-first checkpoints under torchrun (engine.distributed.memory_commit): every rank's part in
node memory each split, durable copies only every 50 splits, peer copies on the next node. Killed
ranks and lost nodes resume from memory, replaying at most one split, and end bit-exact."""

from __future__ import annotations

import json
import pathlib
import random
import shutil
import subprocess
import time
import uuid

import pytest

import forkserver
import torchrun_helpers as helpers
from engine.checkpoint.tiers.node import describe_parts
from engine.cli.main import main
from engine.watchdog import HANGS_FILE

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
    # What `inspect --memory-tier` lists: node 0 holds rank 0's parts and the copies of rank 1's.
    parts = describe_parts(tiers + "-0")
    assert {(part["rank"], part["kind"]) for part in parts} == {(0, "own"), (1, "copy")}
    assert all(part["valid"] for part in parts) and len({part["name"] for part in parts}) >= 2


def lose_node_one(job: pathlib.Path, tiers: str, options: tuple[str, ...], splits: int = 6) -> list[int]:
    """Start the two-node job, kill every process of it once rank 1 finished ``splits`` splits,
    and empty node 1's memory tier (a new machine); the splits each rank had finished."""
    agents = helpers.start_nodes(job, *options, "--slow", "0.1", forked_ranks=True)
    try:
        helpers.wait_for(lambda: helpers.splits_done(job / "out", 1) >= splits, "training started", agents[0])
    finally:
        for agent in reversed(agents):
            helpers.kill_node(agent)
    shutil.rmtree(tiers + "-1")
    return [helpers.splits_done(job / "out", rank) for rank in range(2)]


def peer_options(tiers: str, durable_every: str = DURABLE_EVERY) -> tuple[str, ...]:
    return ("--memory-tier", tiers + "-{node}", "--peer-copies", "1", "--durable-every", durable_every)


@pytest.mark.exhaustive
def test_a_peer_copy_with_one_flipped_bit_is_reported_and_the_copy_before_it_is_loaded(
        reference: pathlib.Path, tmp_path: pathlib.Path, tiers: str, capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "job"
    lose_node_one(job, tiers, peer_options(tiers))
    held = pathlib.Path(tiers + "-0", "held-rank-00001", "checkpoints")
    newest = max(held.glob("ckpt-*"))
    with open(newest / "tensors.bin", "r+b") as data:
        data.seek(3)
        byte = data.read(1)[0]
        data.seek(3)
        data.write(bytes([byte ^ 0x10]))
    assert main(["inspect", str(job / "run"), "--memory-tier", tiers + "-0"]) == 0
    listed = capsys.readouterr().out
    assert f"{newest.name}  rank 1 (copy kept for it)" in listed and "INVALID: CheckpointCorrupt" in listed, listed
    restarted = helpers.start_nodes(job, *peer_options(tiers), forked_ranks=True)
    assert [agent.wait(timeout=helpers.TIMEOUT) for agent in restarted] == [0, 0], helpers.node_logs(job)
    logs = helpers.node_logs(job)
    assert f"the part of rank 1 of {newest.name}" in logs and "is not loaded" in logs and "CRC" in logs, logs
    resumed = restored_units(job / "run", 1)[1]
    assert resumed is not None
    helpers.assert_same_result(reference, job, 2)


@pytest.mark.exhaustive
@pytest.mark.parametrize("kills, durable_every", [
    ("0/1/memory_tier_peer_copy:{n}:sigkill", DURABLE_EVERY),  # rank 1 dies while its copy is on its way
    ("0/0/memory_tier_peer_copy:{n}:sigkill", DURABLE_EVERY),
    ("0/0/checkpoint_before_rename:{d}:sigkill", "3"),  # rank 0 dies inside a durable commit
    ("0/1/checkpoint_after_file:{d}:sigkill", "3"),  # rank 1 dies writing its durable part
], ids=["replicating-rank-1", "replicating-rank-0", "durable-commit-rank-0", "durable-part-rank-1"])
def test_kills_while_replicating_or_making_a_checkpoint_durable_resume_exactly(
        reference: pathlib.Path, tmp_path: pathlib.Path, tiers: str, kills: str, durable_every: str) -> None:
    rng = random.Random()
    kills = kills.format(n=rng.randint(3, 20), d=rng.randint(1, 4))
    job = tmp_path / "job"
    agents = helpers.start_nodes(job, *peer_options(tiers, durable_every), max_restarts=1, forked_ranks=True, KILLS=kills)
    assert [agent.wait(timeout=helpers.TIMEOUT) for agent in agents] == [0, 0], kills + helpers.node_logs(job)
    assert restored_units(job / "run", 0)[1:], f"{kills}: the group was not restarted"
    helpers.assert_same_result(reference, job, 2)


@pytest.mark.exhaustive
def test_a_peer_that_never_answers_is_named_by_the_watchdog_and_the_job_restarts_exactly(
        reference: pathlib.Path, tmp_path: pathlib.Path, tiers: str) -> None:
    # Rank 1 (the second node) stops (SIGSTOP) just before its part and rank 0's cross in the peer
    # copy: it never answers rank 0's copy, and its monitor stops with it. Rank 0 waits in the copy
    # (a collective for the watchdog); its monitor reads that rank 1's node stopped publishing,
    # names rank 1 and exits 86 (a hang under torchrun ends the group whatever on_io_error says).
    # Node 0's agent restarts its worker; node 1's agent, whose worker did not fail, stops it
    # (SIGTERM stays pending in a stopped process: SIGKILLed after torchrun's 30 s) and starts a
    # new one for the new round. Both resume from memory and end as an uninterrupted run.
    copy = random.Random().randint(4, 20)
    job = tmp_path / "job"
    agents = helpers.start_nodes(job, *peer_options(tiers), "--watchdog", "3", max_restarts=1, forked_ranks=True,
                                 KILLS=f"0/1/memory_tier_peer_copy:{copy}:sigstop")
    statuses = helpers.wait_for_nodes_releasing_a_stopped_rank(agents, job / "out", 1)
    assert statuses == [0, 0], helpers.node_logs(job)
    rows = [json.loads(line) for line in (job / "run" / HANGS_FILE).read_text().splitlines()]
    assert rows and {row["rank"] for row in rows} == {1}, (rows, helpers.node_logs(job))
    assert all(row["reported_by"] == 0 and "stopped publishing" in row["process_state"] for row in rows), rows
    assert "splitloop watchdog: on " in (job / "node-0.log").read_text() and "rank 1 (pid" in helpers.node_logs(job)
    resumed = restored_units(job / "run", 0)
    assert resumed == restored_units(job / "run", 1) and len(resumed) == 2 and resumed[0] is None, resumed
    assert resumed[1], f"restarted once, from a checkpoint (copy {copy} never came): {resumed}"
    helpers.assert_same_result(reference, job, 2)


@pytest.mark.exhaustive
def test_a_kill_while_a_node_is_refilled_from_its_peer_resumes_exactly(reference: pathlib.Path, tmp_path: pathlib.Path,
                                                                       tiers: str) -> None:
    job = tmp_path / "job"
    lose_node_one(job, tiers, peer_options(tiers))
    restarted = helpers.start_nodes(job, *peer_options(tiers), max_restarts=1, forked_ranks=True,
                                    KILLS="0/1/memory_tier_refill:1:sigkill")
    assert [agent.wait(timeout=helpers.TIMEOUT) for agent in restarted] == [0, 0], helpers.node_logs(job)
    # Killed in the refill (before its restore ended: no ledger row), restarted, refilled again.
    assert helpers.worker_pid(job / "out", 1, restart=1) is not None, "the group was not restarted after the kill"
    assert restored_units(job / "run", 1)[-1] is not None
    helpers.assert_same_result(reference, job, 2)


@pytest.mark.parametrize("writer, trial", [
    pytest.param("process", 0, marks=pytest.mark.exhaustive),
    pytest.param("process", 1, marks=pytest.mark.exhaustive),
    pytest.param("process", 2, marks=pytest.mark.exhaustive),
    *(pytest.param("thread", trial, marks=pytest.mark.exhaustive) for trial in range(3)),
])
def test_a_rank_killed_at_random_instants_with_a_background_writer_resumes_exactly(
        reference: pathlib.Path, tmp_path: pathlib.Path, tiers: str, writer: str, trial: int) -> None:
    rng = random.Random()
    rank, delay = rng.randrange(2), rng.uniform(0.0, 1.0)
    run_dir, out_dir = tmp_path / "job" / "run", tmp_path / "job" / "out"
    out_dir.mkdir(parents=True)
    command = helpers.torchrun_command(2, run_dir, out_dir, "--writer", writer, "--slow", "0.1", "--memory-tier", tiers,
                                       "--durable-every", DURABLE_EVERY, max_restarts=2, forked_ranks=True)
    helpers.sigkill_a_rank_while_training(command, run_dir, out_dir, rank, delay, popen=forkserver.popen)
    helpers.assert_same_result(reference, tmp_path / "job", 2)


@pytest.fixture
def tiny_tier(tmp_path: pathlib.Path):
    """A 64 KiB tmpfs: far too small for one rank's part (a /dev/shm too small)."""
    mount_point = tmp_path / "tiny-shm"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode()[-300:]}")
    yield str(mount_point)
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.mark.exhaustive
@pytest.mark.parametrize("policy", ["raise", "warn"])
def test_a_memory_tier_too_small_fails_clearly_and_training_goes_on_where_the_policy_says(
        reference: pathlib.Path, tmp_path: pathlib.Path, tiny_tier: str, policy: str) -> None:
    process, run_dir, _ = helpers.train(tmp_path, "job", 2, "--memory-tier", tiny_tier, "--durable-every", "5",
                                        "--on-io-error", policy)
    if policy == "raise":
        assert process.returncode != 0
        assert "CheckpointWriteError" in process.stderr and "not complete in the memory tier" in process.stderr
        assert "No space left on device" in process.stderr, process.stderr[-3000:]
        return
    assert process.returncode == 0, process.stderr[-4000:]
    assert "checkpoint not written, training goes on (on_io_error='warn')" in process.stderr
    assert durable_sequences(run_dir), "the durable checkpoints are written all the same"
    helpers.assert_same_result(reference, tmp_path / "job", 2)


def test_rollback_with_a_memory_tier_under_torchrun_is_refused_in_one_line(tmp_path: pathlib.Path, tiers: str) -> None:
    process, _, _ = helpers.train(tmp_path, "job", 2, "--memory-tier", tiers, "--poison", "--epochs", "1")
    assert process.returncode != 0
    assert "Rollback rolls a torchrun job back to a checkpoint in the run dir" in process.stderr, process.stderr[-3000:]


@pytest.mark.exhaustive
def test_a_replaced_node_joins_the_surviving_agent_and_comes_back_from_its_peer_copies(
        reference: pathlib.Path, tmp_path: pathlib.Path, tiers: str) -> None:
    """Node 1 is lost whole (agent and worker SIGKILLed, its tier deleted) while node 0's agent
    stays up; node 0's worker fails at its next collective, its agent (--max-restarts) waits in
    the rendezvous, and a new node 1 (a new agent, an empty tier) joins it."""
    job, options = tmp_path / "job", peer_options(tiers)
    port = helpers.free_port()
    (job / "out").mkdir(parents=True)

    def agent(node: int) -> subprocess.Popen:
        command = helpers.node_command(node, port, job / "run", job / "out", *options, "--slow", "0.1",
                                       max_restarts=1, forked_ranks=True)
        with open(job / f"node-{node}.log", "a") as log:
            # As for an elastic job (docs/distributed.md, Limits): with torch 2.13 the rendezvous
            # after a membership change otherwise waits for keys written to another store.
            return forkserver.popen(command, env=helpers.environment(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    survivor, lost = agent(0), agent(1)
    replacement = None
    try:
        helpers.wait_for(lambda: helpers.splits_done(job / "out", 1) >= 6, "training started", survivor)
        helpers.kill_node(lost)
        shutil.rmtree(tiers + "-1")
        done = helpers.splits_done(job / "out", 1)
        replacement = agent(1)
        assert survivor.wait(timeout=helpers.TIMEOUT) == 0, helpers.node_logs(job)
        assert replacement.wait(timeout=helpers.TIMEOUT) == 0, helpers.node_logs(job)
    finally:
        for process in (survivor, lost, replacement):
            if process is not None and process.poll() is None:
                helpers.kill_node(process)
    resumed = restored_units(job / "run", 1)[-1]
    assert resumed is not None and done - resumed <= 1, (done, restored_units(job / "run", 1))
    helpers.assert_same_result(reference, job, 2)


def test_writer_processes_fill_every_ranks_memory_tier_and_peer_copies_and_a_lost_node_comes_back_exactly(
        reference: pathlib.Path, tmp_path: pathlib.Path, tiers: str) -> None:
    """Each rank's checkpoints written by its writer process (CheckpointConfig(writer="process")):
    every part in its node's tier with a verified copy on the other node, and a node lost whole
    comes back from those copies, replaying at most one split."""
    job = tmp_path / "job"
    options = (*peer_options(tiers), "--writer", "process")
    done = lose_node_one(job, tiers, options)
    lease = json.loads((job / "run" / "writer.lease").read_text())
    assert lease["writer_process"] is True
    restarted = helpers.start_nodes(job, *options, forked_ranks=True)
    assert [agent.wait(timeout=helpers.TIMEOUT) for agent in restarted] == [0, 0], helpers.node_logs(job)
    resumed = restored_units(job / "run", 1)[1]
    assert resumed is not None and min(done) - resumed <= 1, (done, resumed)
    helpers.assert_same_result(reference, job, 2)
    parts = describe_parts(tiers + "-1")
    assert {(part["rank"], part["kind"]) for part in parts} == {(1, "own"), (0, "copy")}
    assert all(part["valid"] for part in parts)


@pytest.mark.exhaustive
@pytest.mark.parametrize("fault", ["checkpoint_after_file:{n}:sigkill", "memory_tier_peer_copy:{n}:sigkill"])
def test_a_writer_process_that_dies_under_torchrun_is_not_restarted_and_the_group_resumes_exactly(
        reference: pathlib.Path, tmp_path: pathlib.Path, tiers: str, fault: str) -> None:
    """Rank 1's writer process is SIGKILLed inside a commit (its fault points fire in the writer
    process): the rank reports it and exits (on_io_error="raise"), torchrun restarts the group,
    and the run resumes exactly from the newest complete checkpoint."""
    kills = "0/1/" + fault.format(n=random.Random().randint(2, 10))
    job = tmp_path / "job"
    agents = helpers.start_nodes(job, *peer_options(tiers, "3"), "--writer", "process", max_restarts=1,
                                 forked_ranks=True, KILLS=kills)
    assert [agent.wait(timeout=helpers.TIMEOUT) for agent in agents] == [0, 0], kills + helpers.node_logs(job)
    logs = helpers.node_logs(job)
    assert "the checkpoint writer process of rank 1 died" in logs and "it is not restarted" in logs, logs[-4000:]
    assert restored_units(job / "run", 0)[1:], f"{kills}: the group was not restarted"
    helpers.assert_same_result(reference, job, 2)
