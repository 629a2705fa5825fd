"""Resuming on another world size (engine.distributed.global_order): the global order, the
re-partition of the data, and the refusals. The fault-tolerance test runs real torchrun jobs
(gloo on CPU) of tests/distributed/elastic_train.py and SIGKILLs them."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import torchrun_helpers as helpers
from engine.cli.commands import inspect_run
from engine.distributed import global_order
from engine.distributed.environment import DistributedContext
from engine.distributed.sampler import shard_loader
from engine.errors import WorldSizeChangeRefused

SCRIPT = str(pathlib.Path(__file__).with_name("elastic_train.py"))
SAMPLES = 48


# ---- the global order ---------------------------------------------------------------------

def _ids_per_step(world_size: int, per_rank_batch: int, epoch: int, samples: int = 24) -> list[list[int]]:
    """The sorted sample ids of each optimizer step of an epoch when ``world_size`` ranks read
    the engine's loaders (rank r's k-th batch belongs to step k)."""
    steps: list[list[int]] = []
    for rank in range(world_size):
        context = DistributedContext(rank, world_size, rank, torch.device("cpu"), writer_group=None, attempt=0)
        data = DataLoader(TensorDataset(torch.arange(samples)), batch_size=per_rank_batch, shuffle=True)
        loader = shard_loader(data, context) if world_size > 1 else _ordered_alone(data)
        loader.sampler.set_epoch(epoch)
        for step, (batch,) in enumerate(loader):
            if step == len(steps):
                steps.append([])
            steps[step].extend(int(i) for i in batch)
    return [sorted(ids) for ids in steps]


def _ordered_alone(data: DataLoader) -> DataLoader:
    return shard_loader(data, DistributedContext(0, 1, 0, torch.device("cpu"), writer_group=None, attempt=0))


@pytest.mark.parametrize("epoch", [0, 3])
def test_every_world_size_trains_each_step_on_the_same_slice_of_one_permutation(epoch: int) -> None:
    # The scheme, written independently of the sampler: global batch k is the positions
    # [kG, (k+1)G) of randperm(n) drawn with seed 0 + epoch.
    permutation = torch.randperm(24, generator=torch.Generator().manual_seed(epoch)).tolist()
    expected = [sorted(permutation[k * 8:(k + 1) * 8]) for k in range(3)]
    for world_size in (1, 2, 4, 8):
        assert _ids_per_step(world_size, 8 // world_size, epoch) == expected, f"world size {world_size}"


def test_regroup_gives_a_rank_its_part_of_the_same_global_batches() -> None:
    context = DistributedContext(1, 2, 1, torch.device("cpu"), writer_group=None, attempt=0)
    loader = shard_loader(DataLoader(TensorDataset(torch.arange(24)), batch_size=4, shuffle=True), context)
    assert global_order.order_signature(loader, 2) == {"world_size": 2, "global_batch": 8}
    loader.sampler.set_epoch(2)
    assert global_order.regroup(loader, 8, 4, 3)
    assert not global_order.regroup(loader, 8, 4, 3)  # already so: nothing changes
    assert global_order.order_signature(loader, 4) == {"world_size": 4, "global_batch": 8}
    permutation = torch.randperm(24, generator=torch.Generator().manual_seed(2)).tolist()
    assert [batch.tolist() for (batch,) in loader] == [permutation[k * 8 + 3:(k + 1) * 8:4] for k in range(3)]


def test_rank_streams_after_a_change_depend_on_the_rank_and_the_step_only() -> None:
    rng = {"torch_cpu": torch.get_rng_state()}
    seeds = {(rank, step): global_order.rank_seed(rng, rank, step) for rank in range(3) for step in (5, 6)}
    assert len(set(seeds.values())) == 6
    assert global_order.rank_seed({"torch_cpu": rng["torch_cpu"].clone()}, 1, 5) == seeds[1, 5]


# ---- the refusals, one line each ------------------------------------------------------------

def _engine_loader(samples: int = 24, batch: int = 4, drop_last: bool = False) -> DataLoader:
    return _ordered_alone(DataLoader(TensorDataset(torch.arange(samples)), batch_size=batch, shuffle=True,
                                     drop_last=drop_last))


def _refusal(world_size: int, data, saved=None, module: torch.nn.Module | None = None) -> str:
    saved = {"world_size": 2, "global_batch": 8, "carry_hidden_across_batches": False} if saved is None else saved
    error = global_order.refusal("ckpt-0000000004", saved, world_size, data, module or torch.nn.Linear(2, 1))
    assert isinstance(error, WorldSizeChangeRefused)
    message = str(error)
    assert "\n" not in message and message.startswith(
        f"ckpt-0000000004 was written with world size 2 and this run has world size {world_size}: ")
    return message


def test_a_world_size_that_does_not_divide_the_global_batch_is_refused_naming_those_that_do() -> None:
    assert "the global batch G=8 does not split into 3 equal parts; resume with a world size that divides G: " \
           "[1, 2, 4, 8]" in _refusal(3, _engine_loader())


def test_hidden_state_carried_across_batches_is_refused() -> None:
    saved = {"world_size": 2, "global_batch": 8, "carry_hidden_across_batches": True}
    assert "carry_hidden_across_batches=True" in _refusal(4, _engine_loader(), saved)


def test_a_users_distributed_sampler_with_padding_is_refused() -> None:
    dataset = TensorDataset(torch.arange(10))
    own = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, num_replicas=4, rank=0))
    assert "has a DistributedSampler of its own that pads 10 samples to 12" in _refusal(4, own)


def test_a_sampler_the_engine_cannot_repartition_is_refused() -> None:
    class EveryOther(Sampler):
        def __iter__(self):
            return iter(range(0, 24, 2))

        def __len__(self):
            return 12

    custom = DataLoader(TensorDataset(torch.arange(24)), batch_size=2, sampler=EveryOther())
    assert "the engine did not order its training data" in _refusal(4, custom)
    # A checkpoint that recorded no global batch (its data was not ordered by the engine) alike.
    assert "the engine did not order its training data" in _refusal(4, _engine_loader(), {"world_size": 2})


def test_data_that_would_be_padded_on_the_new_world_size_is_refused() -> None:
    assert "the 20 samples do not split evenly over 2 and 8 ranks" in _refusal(8, _engine_loader(20))
    assert global_order.refusal("ckpt", {"world_size": 2, "global_batch": 8}, 8, _engine_loader(20, drop_last=True),
                                torch.nn.Linear(2, 1)) is None


def test_a_checkpoint_inside_a_batch_is_refused() -> None:
    state = {"signature": {"world_size": 2, "global_batch": 8},
             "loops": {"data": {"has_pending_batch": True}, "flow": {"pending_backward": [False]}}}

    class Data:
        source = _engine_loader()

    with pytest.raises(WorldSizeChangeRefused, match=r"it was taken inside a batch or an open gradient-accumulation "
                                                     r"window.*resume from a checkpoint at a batch boundary"):
        global_order.adapt_data("ckpt", state, Data(), torch.nn.Linear(2, 1), 4, 0)  # type: ignore[arg-type]


# ---- real torchrun jobs ---------------------------------------------------------------------

def _torchrun(ranks: int, job: pathlib.Path, attempt: int, *args: str) -> subprocess.CompletedProcess:
    (job / "out").mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "--max-restarts=0", "--monitor-interval=0.2", SCRIPT, str(job / "run"), str(job / "out"), str(attempt),
               *args]
    return helpers.run(command, helpers.environment())


_samples_per_step = helpers.samples_per_step


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    job = tmp_path_factory.mktemp("elastic") / "reference"
    process = _torchrun(2, job, 0)
    assert process.returncode == 0, process.stderr[-4000:]
    return job


def test_sigkilled_run_resumed_on_4_then_1_then_2_ranks_trains_every_step_on_the_same_samples(
        reference_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    job = tmp_path / "elastic"
    for attempt, (ranks, kill_at) in enumerate([(2, 3), (4, 7), (1, 10), (2, None)]):
        kill = ["--kill-at-step", str(kill_at)] if kill_at is not None else []
        process = _torchrun(ranks, job, attempt, *kill)
        assert process.returncode == (0 if kill_at is None else 1), process.stderr[-4000:]
        if kill_at is not None:  # rank 0 SIGKILLed itself after that step (torchrun may report another rank first)
            last = (job / "out" / f"steps-{attempt}-0.jsonl").read_text().splitlines()[-1]
            assert json.loads(last)["step"] == kill_at and not (job / "out" / f"final-{attempt}.pt").exists()
        assert inspect_run(str(job / "run"))["checkpoints"][-1]["world_size"] == ranks
    expected = _samples_per_step(reference_run / "out")
    got = _samples_per_step(job / "out")
    assert len(expected) == 12 and got == expected
    for epoch in (0, 1):  # each sample once per epoch
        assert sorted(sum((expected[step] for step in range(6 * epoch + 1, 6 * epoch + 7)), [])) == list(range(SAMPLES))
    resumes = [json.loads(line) for line in (job / "run" / "resumes.jsonl").read_text().splitlines()]
    assert [(row["world_size_before"], row["world_size"]) for row in resumes] == [(2, 4), (4, 1), (1, 2)]
    # Parameters: the same samples meet the same step, but DDP averages W per-rank mean
    # gradients in another order (and another reduction tree) for each W, so float rounding
    # differs: this is the one comparison where closeness, not equality, is the guarantee.
    reference = torch.load(reference_run / "out" / "final-0.pt", weights_only=True)
    final = torch.load(job / "out" / "final-3.pt", weights_only=True)
    for key, value in reference.items():
        scale = value.abs().max().clamp_min(1e-12)
        assert ((final[key] - value).abs().max() / scale).item() <= 1e-5, key


@pytest.mark.exhaustive  # the message is tested in-process above; this is the same refusal under torchrun
def test_a_world_size_that_does_not_divide_the_global_batch_is_refused_before_training(
        reference_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    job = tmp_path / "job"
    shutil.copytree(reference_run / "run", job / "run")
    process = _torchrun(3, job, 1)
    assert process.returncode != 0
    for rank in range(3):
        error = (job / "out" / f"error-1-{rank}.txt").read_text()
        assert error.startswith("WorldSizeChangeRefused: ") and "\n" not in error
        assert "the global batch G=8 does not split into 3 equal parts" in error
    assert not list((job / "out").glob("steps-*"))  # nothing trained


def _agent(job: pathlib.Path, port: int, log: pathlib.Path, hosts_store: bool) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=2",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test",
               f"--rdzv-conf=last_call_timeout=1,is_host={int(hosts_store)}", "--local-addr=127.0.0.1",
               "--max-restarts=0", "--monitor-interval=0.2",
               SCRIPT, str(job / "run"), str(job / "out"), "w", "--pause-at-step", "3"]
    # Without it the agents keep torch's shared rendezvous store across the membership change and
    # the next round waits forever for keys written to another store (torch 2.13; docs/distributed.md).
    return subprocess.Popen(command, env=helpers.environment(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"), stdout=log.open("w"),
                            stderr=subprocess.STDOUT)


def test_a_second_torchrun_agent_joining_mid_run_continues_on_the_larger_world(
        reference_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    job = tmp_path / "job"
    (job / "out").mkdir(parents=True)
    first = _agent(job, port, tmp_path / "first.log", hosts_store=True)
    second = None
    try:
        helpers.wait_for(lambda: (job / "out" / "paused").exists(), "the first group's step 3", first)
        second = _agent(job, port, tmp_path / "second.log", hosts_store=False)
        # The first agent saw the second one waiting and stops its workers (SIGTERM): only now
        # may the paused group go on, so it cannot finish the run before the second node joins.
        helpers.wait_for(lambda: "closing signal SIGTERM" in (tmp_path / "first.log").read_text(),
                         "the first agent to restart its group for the new node", first)
        (job / "out" / "go").write_text("")
        assert first.wait(timeout=helpers.TIMEOUT) == 0, (tmp_path / "first.log").read_text()[-4000:]
        assert second.wait(timeout=helpers.TIMEOUT) == 0, (tmp_path / "second.log").read_text()[-4000:]
    finally:
        for agent in (first, second):
            if agent is not None and agent.poll() is None:
                agent.kill()
    assert _samples_per_step(job / "out") == _samples_per_step(reference_run / "out")
    resumes = [json.loads(line) for line in (job / "run" / "resumes.jsonl").read_text().splitlines()]
    assert [(row["world_size_before"], row["world_size"]) for row in resumes] == [(2, 4)]
