"""Hangs in a torchrun job (gloo on the CPU, 2 ranks, tests/distributed/dist_train.py): the rank
that hangs is named — not the rank waiting for it in a collective —, every rank ends with the
hang exit code, torchrun restarts the group (``--max-restarts``) and the job ends bit-identical
to an uninterrupted one (parameters, RNG, hidden state of every rank, metrics.jsonl)."""

from __future__ import annotations

import json
import os
import pathlib
import random
import re
import signal
import sys

import pytest

from engine.watchdog import HANG_EXIT_CODE, HANGS_FILE

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "distributed"))
import torchrun_helpers as helpers  # noqa: E402

pytestmark = pytest.mark.slow

OPTIONS = ("--epochs", "1", "--watchdog", "3")
SPLITS = 18  # per rank: 24 samples in batches of 2 over 2 ranks, 3 splits per batch


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return helpers.uninterrupted(tmp_path_factory.mktemp("hangs"), 2, *OPTIONS)


def hang_and_restart(reference: pathlib.Path, tmp_path: pathlib.Path, faults: str) -> tuple[str, list[dict]]:
    """Run the job with ``faults`` armed on rank 1 in its first try; its stderr and hangs.jsonl rows."""
    process, run_dir, _ = helpers.train(tmp_path, "job", 2, *OPTIONS, max_restarts=1, KILLS=f"0/1/{faults}")
    hangs = run_dir / HANGS_FILE
    assert process.returncode == 0, (hangs.read_text() if hangs.exists() else "no hangs.jsonl") + process.stderr[-4000:]
    assert re.search(rf"exitcode\s*:\s*{HANG_EXIT_CODE}\b", process.stderr), process.stderr[-4000:]  # torchrun's failure summary
    helpers.assert_same_result(reference, tmp_path / "job", 2)
    rows = [json.loads(line) for line in (run_dir / HANGS_FILE).read_text().splitlines()]
    return process.stderr, rows


# Exhaustive for now: one of eight runs here (2 cores at load 10) failed for a reason its output did
# not keep; the default run keeps the in-process hang (test_hang_in_process.py) and the verdict's
# unit tests (test_verdict.py), which decide the culprit the same way.
@pytest.mark.exhaustive
def test_a_stopped_rank_is_named_killed_and_the_group_restarts_exactly(reference: pathlib.Path,
                                                                       tmp_path: pathlib.Path) -> None:
    split = random.randint(5, SPLITS - 3)
    stderr, rows = hang_and_restart(reference, tmp_path, f"split_end:{split}:sigstop")
    assert "rank 1 (pid" in stderr and "stopped by a signal" in stderr, stderr[-4000:]
    assert len(rows) == 1, (rows, stderr[-4000:])
    assert rows[0]["rank"] == 1 and rows[0]["reported_by"] == 0 and rows[0]["last_split"] == split, rows
    assert rows[0]["phase"] == "boundary" and rows[0]["waiting_ranks"] == [0], rows


@pytest.mark.exhaustive
def test_a_rank_sleeping_in_its_step_is_named_with_its_stack(reference: pathlib.Path, tmp_path: pathlib.Path) -> None:
    split = random.randint(5, SPLITS - 3)
    stderr, rows = hang_and_restart(reference, tmp_path, f"step_start:{split}:hang")
    assert len(rows) == 1, rows
    assert rows[0]["rank"] == 1 and rows[0]["reported_by"] == 1 and rows[0]["phase"] == "step"
    assert "_hang_forever" in rows[0]["stacks"] and "_hang_forever" in stderr


@pytest.mark.exhaustive
def test_a_rank_that_skips_an_all_reduce_is_named_not_the_rank_waiting_in_it(reference: pathlib.Path,
                                                                             tmp_path: pathlib.Path) -> None:
    # Rank 1 skips the all-reduce of one boundary agreement and goes on to the checkpoint, whose
    # collectives wait for rank 0; rank 0 waits in that all-reduce: a deadlock. Rank 0 is the one
    # waiting in a collective; rank 1 has not arrived at it.
    call = random.randint(5, SPLITS - 3)
    process, run_dir, _ = helpers.train(tmp_path, "job", 2, *OPTIONS, max_restarts=1, SKIP_ALLREDUCE=f"0/1/{call}")
    hangs = run_dir / HANGS_FILE
    assert process.returncode == 0, (hangs.read_text() if hangs.exists() else "no hangs.jsonl") + process.stderr[-4000:]
    assert re.search(rf"exitcode\s*:\s*{HANG_EXIT_CODE}\b", process.stderr), process.stderr[-4000:]
    rows = [json.loads(line) for line in hangs.read_text().splitlines()]
    assert {row["rank"] for row in rows} == {1}, (rows, process.stderr[-6000:])
    assert all(row["waiting_ranks"] == [0] and row["phase"] != "collective" for row in rows), rows
    assert rows[0]["stacks"] if rows[0]["reported_by"] == 1 else rows[0]["process_state"], rows  # its stacks, when it says it
    helpers.assert_same_result(reference, tmp_path / "job", 2)


@pytest.mark.exhaustive
def test_on_two_nodes_the_rank_that_skipped_the_all_reduce_is_named_by_the_node_that_waits(
        reference: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # Two agents ("nodes") of one rank each: rank 0's node sees only its own rank, waiting in the
    # all-reduce; it reads rank 1's word from the group's store and names it (engine.watchdog.remote).
    call = random.randint(5, SPLITS - 3)
    job = tmp_path / "job"
    agents = helpers.start_nodes(job, *OPTIONS, max_restarts=1, forked_ranks=True, SKIP_ALLREDUCE=f"0/1/{call}")
    try:
        statuses = [agent.wait(timeout=helpers.TIMEOUT) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                helpers.kill_node(agent)
    assert statuses == [0, 0], helpers.node_logs(job)
    rows = [json.loads(line) for line in (job / "run" / HANGS_FILE).read_text().splitlines()]
    assert rows and {row["rank"] for row in rows} == {1}, (rows, helpers.node_logs(job))  # never "on another node"
    by_rank_0 = [row for row in rows if row["reported_by"] == 0]
    assert all(row["phase"] != "collective" and row["process_state"].startswith("on ") for row in by_rank_0), rows
    helpers.assert_same_result(reference, job, 2)



@pytest.mark.exhaustive
def test_a_whole_stopped_node_is_named_by_the_other_node_and_the_job_restarts_exactly(
        reference: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # Two agents ("nodes") of one rank each, started as a job of two machines is (the rendezvous
    # host first). Every worker of the second node (its one rank) is SIGSTOPped from outside once
    # it trained a random number of splits; its agent runs on. The stopped rank's monitor thread
    # stops with it, so its node stops publishing its words in the group's store: rank 0, waiting
    # for it, names rank 1 on the other node (engine.watchdog.remote) and exits 86; both agents
    # restart their workers (--max-restarts, the stopped worker is killed by its agent) and the
    # job ends as an uninterrupted one.
    split = random.randint(4, SPLITS - 6)
    job = tmp_path / "job"
    agents = helpers.start_nodes(job, *OPTIONS, "--slow", "0.1", max_restarts=1)
    try:
        helpers.wait_for(lambda: helpers.splits_done(job / "out", 1) >= split, f"rank 1's split {split}", agents[1])
        helpers.signal_worker(job / "out", 1, signal.SIGSTOP)
    finally:  # the agents waited for, and the stopped worker released, whatever happened
        statuses = helpers.wait_for_nodes_releasing_a_stopped_rank(agents, job / "out", 1)
    assert statuses == [0, 0], helpers.node_logs(job)
    rows = [json.loads(line) for line in (job / "run" / HANGS_FILE).read_text().splitlines()]
    assert rows and {row["rank"] for row in rows} == {1}, (rows, helpers.node_logs(job))
    assert all(row["reported_by"] == 0 and row["process_state"].startswith("on ") for row in rows), rows
    assert "stopped publishing its words" in rows[0]["process_state"], rows
    assert abs(rows[0]["last_split"] - split) <= 2, (split, rows)
    helpers.assert_same_result(reference, job, 2)


@pytest.mark.exhaustive
def test_a_job_requeued_under_its_rendezvous_id_after_a_hang_trains_on_exactly(reference: pathlib.Path,
                                                                                tmp_path: pathlib.Path) -> None:
    # As a scheduler requeues a job: no restarts by torchrun, a fixed rendezvous id and port, and
    # ranks started by the agent itself (not forked: their agent is their parent). Rank 1 hangs in
    # its step and reports itself; both ranks share the node's words, so the row names rank 0 as
    # waiting. The same command again resumes and ends exact, reading nothing the first launch
    # left in /dev/shm (one directory per agent) and removing it.
    split = random.randint(5, SPLITS - 3)
    port = helpers.free_port()
    job = tmp_path / "job"
    (job / "out").mkdir(parents=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=0",
               "--monitor-interval=0.2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               "--rdzv-id=requeued", helpers.SCRIPT, str(job / "run"), str(job / "out"), *OPTIONS]
    first = helpers.run(command, helpers.environment(KILLS=f"0/1/step_start:{split}:hang"))
    assert re.search(rf"exitcode\s*:\s*{HANG_EXIT_CODE}\b", first.stderr), first.stderr[-4000:]
    rows = [json.loads(line) for line in (job / "run" / HANGS_FILE).read_text().splitlines()]
    assert rows[0]["rank"] == 1 and rows[0]["reported_by"] == 1 and rows[0]["waiting_ranks"] == [0], rows
    second = helpers.run(command, helpers.environment())
    assert second.returncode == 0, second.stderr[-4000:]
    helpers.assert_same_result(reference, job, 2)
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"splitloop-watchdog-requeued-{port}-")]
