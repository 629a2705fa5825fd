"""Distributed runs under a real torchrun (gloo, CPU): exact resume of every rank after a rank
is SIGKILLed, one commit for all ranks, preemption agreement, refusals. Each torchrun start
costs a few seconds per rank (torch is imported by each), so the runs are few and tiny."""

from __future__ import annotations

import json
import pathlib
import random
import signal
import subprocess

import pytest
import torch

import engine
from engine.checkpoint.format.codec import decode_state
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.errors import CheckpointIncompatible

import forkserver
import torchrun_helpers as helpers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference_two(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """An uninterrupted 2-rank run (2 epochs, a checkpoint every split)."""
    tmp = tmp_path_factory.mktemp("reference2")
    process, _, _ = helpers.train(tmp, "job", 2)
    assert process.returncode == 0, process.stderr[-4000:]
    return tmp / "job"


def test_ranks_hold_different_per_rank_state_and_equal_parameters(reference_two: pathlib.Path) -> None:
    rank0, rank1 = helpers.final_state(reference_two / "out", 0), helpers.final_state(reference_two / "out", 1)
    # DDP averaged the gradients: the replicas agree although each rank saw other data and dropout.
    for key in (k for k in rank0 if k.startswith("param.")):
        assert torch.equal(rank0[key], rank1[key]), key
    assert not torch.equal(rank0["rng"], rank1["rng"])
    assert not torch.equal(rank0["hidden.h"], rank1["hidden.h"])
    store = CheckpointStore(Storage(str(reference_two / "run")), create=False)
    loaded = store.latest()
    assert loaded is not None
    part = decode_state(bytes(loaded.extra_files["rank-00001.msgpack"]), loaded.extra_files["rank-00001.bin"])
    assert loaded.state["signature"]["world_size"] == 2
    # Rank 1's own RNG streams are in its part, not a copy of rank 0's.
    assert part["rng"] != loaded.state["rng"] if not isinstance(part["rng"]["torch_cpu"], torch.Tensor) \
        else not torch.equal(part["rng"]["torch_cpu"], loaded.state["rng"]["torch_cpu"])


def test_sigkills_at_split_boundaries_and_mid_commit_resume_exactly(reference_two: pathlib.Path, tmp_path: pathlib.Path) -> None:
    rng = random.Random()
    boundary, commit = rng.randint(3, 20), rng.randint(1, 8)
    # Rank 1 dies at a split boundary; in the restarted group rank 0 dies inside a commit, after
    # every part is durable and just before the rename.
    kills = f"0/1/split_end:{boundary}:sigkill;1/0/checkpoint_before_rename:{commit}:sigkill"
    process, _, out_dir = helpers.train(tmp_path, "job", 2, max_restarts=3, KILLS=kills)
    assert process.returncode == 0, f"{kills}: " + process.stderr[-4000:]
    assert helpers.worker_pid(out_dir, 0, restart=2) is not None, "the group was not restarted twice"
    helpers.assert_same_result(reference_two, tmp_path / "job", 2)


def test_sigkill_of_one_rank_at_a_random_instant_resumes_exactly(reference_two: pathlib.Path, tmp_path: pathlib.Path) -> None:
    rng = random.Random()
    # Slowed down so the kill lands while the job trains (a kill after its last checkpoint
    # leaves nothing to resume, and the final hidden state is then never produced).
    rank, delay = rng.randrange(2), rng.uniform(0.0, 1.0)
    run_dir, out_dir = tmp_path / "job" / "run", tmp_path / "job" / "out"
    out_dir.mkdir(parents=True)
    command = helpers.torchrun_command(2, run_dir, out_dir, "--async", "--slow", "0.1", max_restarts=2, forked_ranks=True)
    helpers.sigkill_a_rank_while_training(command, run_dir, out_dir, rank, delay, popen=forkserver.popen)
    helpers.assert_same_result(reference_two, tmp_path / "job", 2)


@pytest.mark.exhaustive  # 2- and 4-rank kills run by default (here and in test_elastic); the CI time
def test_three_ranks_resume_exactly_after_a_sigkill(tmp_path: pathlib.Path) -> None:
    # 12 splits per rank and epoch, a step every 5: the epoch ends with a window open, whose
    # unsynced gradients must be averaged before its step (the digest check would refuse the
    # epoch-end checkpoint otherwise).
    options = ("--epochs", "1", "--accumulate", "5")
    reference, _, _ = helpers.train(tmp_path, "reference", 3, *options)
    assert reference.returncode == 0, reference.stderr[-4000:]
    finals = [helpers.final_state(tmp_path / "reference" / "out", rank) for rank in range(3)]
    for key in (k for k in finals[0] if k.startswith("param.")):
        assert torch.equal(finals[0][key], finals[1][key]) and torch.equal(finals[0][key], finals[2][key]), key
    boundary = random.Random().randint(2, 11)
    process, _, _ = helpers.train(tmp_path, "killed", 3, *options, max_restarts=2,
                                  KILLS=f"0/2/split_end:{boundary}:sigkill")
    assert process.returncode == 0, f"boundary {boundary}: " + process.stderr[-4000:]
    helpers.assert_same_result(tmp_path / "reference", tmp_path / "killed", 3)


def test_resuming_hidden_state_carried_across_batches_on_another_world_size_is_refused(
        reference_two: pathlib.Path, tmp_path: pathlib.Path) -> None:
    import shutil
    shutil.copytree(reference_two / "run", tmp_path / "job" / "run")
    (tmp_path / "job" / "out").mkdir()
    process = helpers.run(helpers.torchrun_command(3, tmp_path / "job" / "run", tmp_path / "job" / "out",
                                                  forked_ranks=True),
                          helpers.environment())
    assert process.returncode != 0
    assert "WorldSizeChangeRefused" in process.stderr and "world size 2" in process.stderr
    assert "this run has world size 3: carry_hidden_across_batches=True" in process.stderr


def test_a_single_process_refuses_a_distributed_checkpoint(reference_two: pathlib.Path) -> None:
    import dist_train  # noqa: PLC0415 - the same model, trained in this process
    torch.manual_seed(100)
    model = dist_train.Model()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 12, 3), torch.zeros(4, 12, 1)),
                                         batch_size=2)
    config = engine.TrainerConfig(max_epochs=2, run_dir=str(reference_two / "run"), progress_bar="off", device="cpu",
                                  accumulate_grad=2, checkpoint=engine.CheckpointConfig(every_n_splits=1, keep_last=3))
    with pytest.raises(CheckpointIncompatible, match="world size 2 and this run has world size 1"):
        engine.Trainer(config).fit(model, loader, resume="latest")


def test_a_diverged_replica_stops_the_commit(tmp_path: pathlib.Path) -> None:
    process, run_dir, _ = helpers.train(tmp_path, "job", 2, "--epochs", "1", DIVERGE_RANK="1", DIVERGE_AT="3")
    assert process.returncode != 0
    assert "ReplicaDivergence" in process.stderr and "module.head.bias (rank(s) [1] differ from rank 0)" in process.stderr
    store = CheckpointStore(Storage(str(run_dir)), create=False)
    assert [info.cursor.split for info in store.inspect() if info.valid][-1] <= 2  # nothing after the drift


# SIGTERM to one rank by default (the others learn of it from the stop agreement); to every worker
# in the exhaustive run, and by default through the launcher in test_sbatch_recipes (several-nodes).
@pytest.mark.parametrize("every_worker", [pytest.param(True, marks=pytest.mark.exhaustive), False],
                         ids=["sigterm-every-worker", "sigterm-one-rank"])
def test_preemption_stops_every_rank_at_one_boundary_and_launch_exits_75(tmp_path: pathlib.Path, every_worker: bool) -> None:
    run_dir, out_dir = tmp_path / "run", tmp_path / "out"
    out_dir.mkdir()
    command = [helpers.sys.executable, "-m", "engine", "launch", "--marker", str(tmp_path / "marker.json"), "--",
               *helpers.torchrun_command(2, run_dir, out_dir, "--every", "1000", "--no-epoch-checkpoint", "--slow", "0.2", max_restarts=2,
                                         forked_ranks=True)]  # the signal goes to the training process itself
    with subprocess.Popen(command, env=helpers.environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd=helpers.REPOSITORY) as job:
        helpers.wait_for(lambda: min(helpers.splits_done(out_dir, r) for r in (0, 1)) >= 2, "training started", job)
        for rank in ([0, 1] if every_worker else [1]):
            helpers.signal_worker(out_dir, rank, signal.SIGTERM)
        stdout, stderr = job.communicate(timeout=helpers.TIMEOUT)
    assert job.returncode == 75, stderr[-4000:]
    # Each worker says where it stopped; under torchrun a preempted worker exits 0 (no restart).
    stopped = [line.partition("; checkpoint ")[2] for line in stderr.splitlines() if line.startswith("splitloop: ")]
    assert len(stopped) == 2 and stopped[0] == stopped[1] and stopped[0].endswith("exiting with 0"), stderr[-4000:]
    store = CheckpointStore(Storage(str(run_dir)), create=False)
    infos = store.inspect()
    assert [info.valid for info in infos] == [True]  # one commit, the preemption checkpoint
    last_row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    cursor = infos[0].cursor
    assert (last_row["epoch"], last_row["batch"], last_row["split"]) == (cursor.epoch, cursor.batch, cursor.split)
    assert helpers.worker_pid(out_dir, 0, restart=1) is None  # torchrun did not restart the group


def test_a_stop_one_rank_decides_is_recorded_alike_by_every_rank_and_ends_the_run(tmp_path: pathlib.Path) -> None:
    """Rank 1 alone asks to stop: every rank stops at that boundary, the one checkpoint records
    rank 1's reason, and the job started again (a requeue) trains nothing more."""
    args = ("--epochs", "2", "--stop-rank", "1", "--stop-at", "5")
    process, run_dir, out_dir = helpers.train(tmp_path, "job", 2, *args)
    assert process.returncode == 0, process.stderr[-4000:]
    store = CheckpointStore(Storage(str(run_dir)), create=False)
    first = store.latest()
    assert first is not None and first.progress.end is not None
    assert first.progress.end.reason == "rank-local stop after 5 splits"
    names, metrics = store.names(), (run_dir / "metrics.jsonl").read_bytes()
    again = helpers.run(helpers.torchrun_command(2, run_dir, out_dir, *args, forked_ranks=True), helpers.environment())
    assert again.returncode == 0, again.stderr[-4000:]
    steps = first.progress.records["flow.optimizer_steps"].total.completed
    assert f"rank 0 done: rank-local stop after 5 splits steps={steps}" in again.stdout
    assert CheckpointStore(Storage(str(run_dir)), create=False).names() == names
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics


def test_a_plateau_on_each_ranks_own_metric_steps_alike_and_only_rank_0_logs(tmp_path: pathlib.Path) -> None:
    # Each rank logs its own training loss; the plateau is stepped with their mean, so the replicas'
    # learning rates stay equal (a difference would stop the commit as a ReplicaDivergence).
    process, run_dir, out_dir = helpers.train(tmp_path, "job", 2, "--plateau-and-loggers", "--epochs", "1")
    assert process.returncode == 0, process.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [row["metrics"]["lr"] for row in rows if row["stage"] == "train"]
    assert len(set(rates)) >= 2  # the plateau reduced the learning rate
    lines = (out_dir / "metrics-0.csv").read_text().splitlines()
    assert len(lines) == len(rows) + 1  # the header
    assert (out_dir / "tensorboard-0").is_dir()
    assert not (out_dir / "metrics-1.csv").exists() and not (out_dir / "tensorboard-1").exists()
