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
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import forkserver
import torchrun_helpers as helpers
from engine.cli.commands import inspect_run
from engine.data.position import EXHAUSTED, EpochData
from engine.data.rng import capture_global_rng, restore_global_rng
from engine.distributed import global_order
from engine.distributed.environment import DistributedContext
from engine.distributed.sampler import shard_loader
from engine.errors import WorldSizeChangeRefused
from worker_training import make_loader, seed_all

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
               "--max-restarts=0", "--monitor-interval=0.2", *helpers.rank_entry_point(SCRIPT, forked=True),
               str(job / "run"), str(job / "out"), str(attempt), *args]
    return helpers.run(command, helpers.environment())


_samples_per_step = helpers.samples_per_step


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    job = tmp_path_factory.mktemp("elastic") / "reference"
    process = _torchrun(2, job, 0)
    assert process.returncode == 0, process.stderr[-4000:]
    return job


@pytest.mark.exhaustive  # CI time: the default run resumes on other world sizes in test_reshard and below (the anchor, a second agent)
def test_sigkilled_run_resumed_on_4_then_1_rank_trains_every_step_on_the_same_samples(
        reference_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """Grown, then shrunk below the first world size (the 2 -> 4 -> 1 -> 2 chain is exhaustive)."""
    _assert_resumes_on_world_sizes_like_the_reference([(2, 3), (4, 7), (1, None)], reference_run, tmp_path)


@pytest.mark.exhaustive
def test_sigkilled_run_resumed_on_4_then_1_then_2_ranks_trains_every_step_on_the_same_samples(
        reference_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    _assert_resumes_on_world_sizes_like_the_reference([(2, 3), (4, 7), (1, 10), (2, None)], reference_run, tmp_path)


def _assert_resumes_on_world_sizes_like_the_reference(chain: list[tuple[int, int | None]], reference_run: pathlib.Path,
                           tmp_path: pathlib.Path) -> None:
    """Run ``chain`` (ranks, the step after which rank 0 SIGKILLs itself; None: to the end) as
    attempts of one job and compare the samples of every step with the reference run's."""
    job = tmp_path / "elastic"
    for attempt, (ranks, kill_at) in enumerate(chain):
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
    sizes = [ranks for ranks, _ in chain]
    assert [(row["world_size_before"], row["world_size"]) for row in resumes] == list(zip(sizes, sizes[1:]))
    # Parameters: the same samples meet the same step, but DDP averages W per-rank mean
    # gradients in another order (and another reduction tree) for each W, so float rounding
    # differs: this is the one comparison where closeness, not equality, is the guarantee.
    _assert_close_parameters(reference_run / "out" / "final-0.pt", job / "out" / f"final-{len(chain) - 1}.pt")


def _assert_close_parameters(reference_path: pathlib.Path, final_path: pathlib.Path) -> None:
    reference = torch.load(reference_path, weights_only=True)
    final = torch.load(final_path, weights_only=True)
    for key, value in reference.items():
        scale = value.abs().max().clamp_min(1e-12)
        assert ((final[key] - value).abs().max() / scale).item() <= 1e-5, key


def _noise_per_step(out: pathlib.Path) -> dict[int, dict[int, float]]:
    """Each optimizer step's {sample id: noise it drew in its worker} over every rank, as trained
    by the last attempt that trained the step (like helpers.samples_per_step)."""
    by_step: dict[int, dict[int, dict[int, float]]] = {}
    for path in out.glob("steps-*.jsonl"):
        attempt = int(path.name.split("-")[1])
        for line in path.read_text().splitlines():
            row = json.loads(line)
            by_step.setdefault(row["step"], {}).setdefault(attempt, {}).update(zip(row["ids"], row["noise"]))
    return {step: attempts[max(attempts)] for step, attempts in by_step.items()}


def _noise_in_id_order(noise: dict[int, float]) -> torch.Tensor:
    return torch.tensor([noise[sample] for sample in sorted(noise)], dtype=torch.float64)


@pytest.fixture(scope="module")
def workers_reference(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    job = tmp_path_factory.mktemp("elastic") / "workers-reference"
    process = _torchrun(2, job, 0, "--workers", "2")
    assert process.returncode == 0, process.stderr[-4000:]
    return job


@pytest.mark.exhaustive  # CI time (about 60 s: the default run keeps the other world-size resumes of this file and tests/data's worker augmentation)
def test_augmentation_drawn_in_workers_is_the_uninterrupted_runs_after_a_resume_on_1_rank(
        workers_reference: pathlib.Path, tmp_path: pathlib.Path) -> None:
    job = tmp_path / "workers"
    killed = _torchrun(2, job, 0, "--workers", "2", "--kill-at-step", "3")  # inside epoch 0 (6 steps each)
    assert killed.returncode == 1, killed.stderr[-4000:]
    resumed = _torchrun(1, job, 1, "--workers", "2")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    expected = _noise_per_step(workers_reference / "out")
    got = _noise_per_step(job / "out")
    assert sorted(got) == sorted(expected) == list(range(1, 13))
    for step in range(1, 13):  # from step 3 on (redone after the kill) the rest of epoch 0 and epoch 1 on 1 rank
        assert sorted(got[step]) == sorted(expected[step]), step
        assert torch.equal(_noise_in_id_order(got[step]), _noise_in_id_order(expected[step])), step
    # The noise is drawn per sample and epoch (a sample's value in epoch 1 is not its epoch-0 one).
    epochs = [{k: v for step in range(6 * epoch + 1, 6 * epoch + 7) for k, v in expected[step].items()}
              for epoch in (0, 1)]
    assert not torch.equal(_noise_in_id_order(epochs[0]), _noise_in_id_order(epochs[1]))


class _Noise(Dataset):
    """Each sample's id and a noise value drawn when it is loaded."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        return index, torch.rand(())


def _noise_by_sample(world_size: int, epoch: int) -> dict[int, float]:
    """{sample id: the noise it drew in a worker} over the epoch, each rank of ``world_size``
    reading its engine-ordered loader with 2 workers, from its own random state; the base is
    the one value the ranks share (a stand-in for the broadcast of rank 0's)."""
    noise: dict[int, float] = {}
    for rank in range(world_size):
        context = DistributedContext(rank, world_size, rank, torch.device("cpu"), writer_group=None, attempt=0)
        torch.manual_seed(1000 + rank)
        plain = DataLoader(_Noise(), batch_size=8 // world_size, shuffle=True, num_workers=2)
        data = EpochData(shard_loader(plain, context) if world_size > 1 else _ordered_alone(plain),
                         seed_of_rank_zero=lambda seed: 12345)
        try:
            for ids, drawn in data.open_epoch(epoch):
                noise.update(zip(ids.tolist(), drawn.tolist()))
        finally:
            data.close()
    return noise


@pytest.mark.parametrize("epoch", [0, 2])
def test_a_sample_draws_the_same_in_a_worker_on_every_world_size(epoch: int) -> None:
    alone = _noise_by_sample(1, epoch)
    assert sorted(alone) == list(range(SAMPLES)) and len(set(alone.values())) == SAMPLES
    for world_size in (2, 4):
        spread = _noise_by_sample(world_size, epoch)
        assert sorted(spread) == sorted(alone)
        assert torch.equal(_noise_in_id_order(spread), _noise_in_id_order(alone)), world_size


def _epoch_of_ordered_workers(saved: tuple | None, global_scheme: bool) -> tuple[list, tuple]:
    """The batches of epochs 0 and 1 (from ``saved``'s position, else from the start) of a loader
    with 2 augmenting workers ordered the global way; with ``global_scheme=False`` its sampler
    does not say so (the per-rank scheme). Also what a checkpoint after epoch 0's first batch
    holds: the data position's state and the global random streams (the run restores both)."""
    seed_all(0)
    loader = _ordered_alone(make_loader(workers=2))
    if not global_scheme:
        loader.sampler.orders_globally = False
    data = EpochData(loader)
    try:
        if saved is not None:
            data.load_state_dict(saved[0])
            restore_global_rng(saved[1])
        batches: list = []
        first_state: tuple = ()
        for epoch in (0, 1):
            iterator = data.open_epoch(epoch)
            while (batch := data.next_batch(iterator)) is not EXHAUSTED:
                data.batch_done()
                batches.append(batch)
                first_state = first_state or (data.state_dict(), capture_global_rng())
            data.epoch_done()
        return batches, first_state
    finally:
        data.close()


def test_a_checkpoint_without_a_sample_seed_base_keeps_seeding_worker_samples_per_rank() -> None:
    per_rank, _ = _epoch_of_ordered_workers(None, global_scheme=False)
    run_wide, saved = _epoch_of_ordered_workers(None, global_scheme=True)
    assert isinstance(saved[0]["sample_seed_base"], int)
    assert not torch.equal(torch.cat([x for x, _ in per_rank]), torch.cat([x for x, _ in run_wide]))
    resumed, _ = _epoch_of_ordered_workers(saved, global_scheme=True)
    before_the_base = dict(saved[0])  # as a checkpoint of the previous release
    del before_the_base["sample_seed_base"]
    resumed_old, _ = _epoch_of_ordered_workers((before_the_base, saved[1]), global_scheme=True)
    for expected, got in ((run_wide[1:], resumed), (per_rank[1:], resumed_old)):
        assert len(got) == len(expected)
        for (x1, y1), (x2, y2) in zip(expected, got):
            assert torch.equal(x1, x2) and torch.equal(y1, y2)


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
               *helpers.rank_entry_point(SCRIPT, forked=True), str(job / "run"), str(job / "out"), "w",
               "--pause-at-step", "3"]
    # Without it the agents keep torch's shared rendezvous store across the membership change and
    # the next round waits forever for keys written to another store (torch 2.13; docs/distributed.md).
    with log.open("w") as output:
        return forkserver.popen(command, env=helpers.environment(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
                                stdout=output, stderr=forkserver.STDOUT)


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


# ---- anchors: the checkpoints a world-size change can start from --------------------------

def _state(pending: bool = False, finished: bool = False, window: bool = False, **signature: object) -> dict:
    return {"signature": {"world_size": 2, "global_batch": 8, "carry_hidden_across_batches": False, **signature},
            "loops": {"data": {"has_pending_batch": pending}, "flow": {"pending_backward": [window]},
                      "split": {"hidden": None, "batch_finished": finished}}}


def test_only_a_batch_boundary_with_no_open_window_in_a_global_order_is_an_anchor() -> None:
    assert global_order.is_anchor(_state())
    assert global_order.is_anchor(_state(pending=True, finished=True))  # TBPTT: the batch's last split
    assert not global_order.is_anchor(_state(pending=True))  # splits of the batch left
    assert not global_order.is_anchor(_state(window=True))  # gradients accumulated, not stepped
    assert not global_order.is_anchor(_state(global_batch=None))  # the engine does not own the order
    assert not global_order.is_anchor(_state(carry_hidden_across_batches=True))
    assert global_order.needs_an_anchor(_state(pending=True), 4) and not global_order.needs_an_anchor(_state(pending=True), 2)


def test_a_checkpoint_at_the_last_split_of_a_batch_resumes_on_another_world_size() -> None:
    class Data:
        source = _engine_loader()

        def use_loader(self, loader: DataLoader) -> None:
            self.source = loader

    data = Data()
    assert global_order.adapt_data("ckpt", _state(pending=True, finished=True), data,  # type: ignore[arg-type]
                                   torch.nn.Linear(2, 1), 4, 0) == 2
    assert global_order.order_signature(data.source, 4) == {"world_size": 4, "global_batch": 8}


def test_the_split_loop_marks_the_boundary_of_a_batchs_last_split_finished() -> None:
    from engine.loops.context import Position, StopState
    from engine.loops.split import SplitLoop

    class Runner:
        def run_split(self, split: torch.Tensor, hidden: object, last: bool) -> tuple[list[torch.Tensor], object]:
            return [split.sum()], hidden

    seen: list[bool] = []
    loop = SplitLoop(lambda batch, length: list(batch.split(length, dim=1)), 2, False, Runner(),  # type: ignore[arg-type]
                     Position(), StopState(), lambda index, losses: seen.append(loop.state_dict()["batch_finished"]))
    loop.run_batch(torch.zeros(1, 6), 0)
    assert seen == [False, False, True] and loop.state_dict()["batch_finished"] is False
    loop.load_state_dict({"hidden": None})  # a checkpoint of an earlier version: inside the batch
    assert loop.state_dict()["batch_finished"] is False


@pytest.mark.parametrize("tbptt, accumulate, anchors", [
    (True, 1, [(batch, 2) for batch in range(6)]),  # the last of each batch's 3 splits
    (False, 2, [(batch, 0) for batch in (1, 3, 5)]),  # where each accumulation window closes
])
def test_checkpoints_record_which_are_anchors(tmp_path: pathlib.Path, tbptt: bool, accumulate: int,
                                              anchors: list[tuple[int, int]]) -> None:
    import elastic_train
    import engine

    record = elastic_train.Record(tmp_path / "steps.jsonl", None, 0)
    config = engine.TrainerConfig(max_epochs=1, run_dir=str(tmp_path / "run"), progress_bar="off", device="cpu",
                                  accumulate_grad=accumulate, elastic=True,
                                  checkpoint=engine.CheckpointConfig(every_n_splits=1, keep_last=None,
                                                                     at_epoch_end=False))
    model = elastic_train.SequenceModel(record) if tbptt else elastic_train.Model(record)
    engine.Trainer(config, [record]).fit(model, elastic_train.loader(8, tbptt))
    checkpoints = inspect_run(str(tmp_path / "run"))["checkpoints"]  # every split's, and the run's last
    cursors = {(entry["cursor"]["batch"], entry["cursor"]["split"]): entry["anchor"] for entry in checkpoints}
    assert len(cursors) == (18 if tbptt else 6)
    assert sorted(cursor for cursor, anchor in cursors.items() if anchor) == anchors


# ---- TBPTT: SIGKILLed inside a batch, resumed on another world size -------------------------

TBPTT = ("--tbptt", "--epochs", "1")  # 6 batches of G=8, 3 splits (optimizer steps) each


@pytest.fixture(scope="module")
def tbptt_reference(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    job = tmp_path_factory.mktemp("tbptt") / "reference"
    process = _torchrun(2, job, 0, *TBPTT)
    assert process.returncode == 0, process.stderr[-4000:]
    return job


@pytest.fixture(scope="module")
def tbptt_killed(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """2 ranks SIGKILLed after step 9 (the last split of batch 2), before its checkpoint: the
    newest checkpoints, steps 7 and 8, are inside batch 2; step 6 ended batch 1."""
    job = tmp_path_factory.mktemp("tbptt") / "killed"
    process = _torchrun(2, job, 0, *TBPTT, "--kill-at-step", "9")
    assert process.returncode == 1, process.stderr[-4000:]
    last = (job / "out" / "steps-0-0.jsonl").read_text().splitlines()[-1]
    assert json.loads(last)["step"] == 9 and not (job / "out" / "final-0.pt").exists()
    return job


def _copy_job(job: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    copy = tmp_path / "job"
    shutil.copytree(job, copy)
    return copy


def test_retention_kept_the_anchor_older_than_the_last_two_checkpoints(tbptt_killed: pathlib.Path) -> None:
    checkpoints = inspect_run(str(tbptt_killed / "run"))["checkpoints"]
    assert [(entry["cursor"]["split"], entry["anchor"]) for entry in checkpoints] == \
        [(2, True), (0, False), (1, False)]  # keep_last=2, and the anchor of step 6


def _assert_resumes_from_the_anchor(ranks: int, tbptt_reference: pathlib.Path, tbptt_killed: pathlib.Path,
                            tmp_path: pathlib.Path) -> None:
    job = _copy_job(tbptt_killed, tmp_path)
    newest = inspect_run(str(job / "run"))["latest"]
    process = _torchrun(ranks, job, 1, *TBPTT)
    assert process.returncode == 0, process.stderr[-4000:]
    assert f"the newest checkpoint, {newest} (world size 2), was taken inside a batch" in process.stderr
    assert "and redoing 2 split(s)" in process.stderr
    row = json.loads((job / "run" / "resumes.jsonl").read_text().splitlines()[-1])
    assert (row["step"], row["world_size_before"], row["world_size"]) == (6, 2, ranks)
    assert (row["fell_back_from"], row["splits_redone"], len(row["skipped"])) == (newest, 2, 2)
    expected = _samples_per_step(tbptt_reference / "out")
    assert len(expected) == 18 and _samples_per_step(job / "out") == expected
    _assert_close_parameters(tbptt_reference / "out" / "final-0.pt", job / "out" / "final-1.pt")


def test_a_tbptt_run_killed_inside_a_batch_resumes_on_4_ranks_from_the_anchor(
        tbptt_reference: pathlib.Path, tbptt_killed: pathlib.Path, tmp_path: pathlib.Path) -> None:
    _assert_resumes_from_the_anchor(4, tbptt_reference, tbptt_killed, tmp_path)


@pytest.mark.exhaustive  # the same fallback, shrinking
def test_a_tbptt_run_killed_inside_a_batch_resumes_on_1_rank_from_the_anchor(
        tbptt_reference: pathlib.Path, tbptt_killed: pathlib.Path, tmp_path: pathlib.Path) -> None:
    _assert_resumes_from_the_anchor(1, tbptt_reference, tbptt_killed, tmp_path)


def test_resuming_a_checkpoint_inside_a_batch_by_name_on_another_world_size_is_refused(
        tbptt_killed: pathlib.Path, tmp_path: pathlib.Path) -> None:
    job = _copy_job(tbptt_killed, tmp_path)
    newest = inspect_run(str(job / "run"))["latest"]
    process = helpers.run([sys.executable, SCRIPT, str(job / "run"), str(job / "out"), "1", *TBPTT, "--resume", newest],
                          helpers.environment())
    assert process.returncode == 2, process.stderr[-4000:]
    error = (job / "out" / "error-1-0.txt").read_text()
    assert error.startswith(f"WorldSizeChangeRefused: {newest} was written with world size 2 and this run has "
                            "world size 1: it was taken inside a batch") and "\n" not in error
    assert not list((job / "out").glob("steps-1-*"))  # nothing trained
    assert inspect_run(str(job / "run"))["latest"] == newest  # nothing left behind or deleted


# ---- a single process that can grow: TrainerConfig(elastic=True) ---------------------------

def test_an_elastic_single_process_trains_each_step_on_the_global_batch_and_records_it(tmp_path: pathlib.Path) -> None:
    import elastic_train
    import engine

    record = elastic_train.Record(tmp_path / "steps-0-0.jsonl", None, 0)
    config = engine.TrainerConfig(max_epochs=1, run_dir=str(tmp_path / "run"), progress_bar="off", device="cpu",
                                  elastic=True)
    engine.Trainer(config, [record]).fit(elastic_train.Model(record), elastic_train.loader(8))
    # The scheme, written independently of the sampler: global batch k is [8k, 8k+8) of randperm(48, seed 0).
    permutation = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0)).tolist()
    assert _samples_per_step(tmp_path) == {k + 1: sorted(permutation[8 * k:8 * k + 8]) for k in range(6)}
    from engine.checkpoint.store.storage import Storage
    from engine.checkpoint.store.checkpoint_store import CheckpointStore
    store = CheckpointStore(Storage(str(tmp_path / "run")), create=False)
    signature = store.load(inspect_run(str(tmp_path / "run"))["latest"]).state["signature"]
    assert (signature["world_size"], signature["global_batch"]) == (1, 8)


def test_turning_elastic_on_over_a_checkpoint_in_the_loaders_own_order_is_refused(tmp_path: pathlib.Path) -> None:
    import elastic_train
    import engine

    record = elastic_train.Record(tmp_path / "steps.jsonl", None, 0)
    config = engine.TrainerConfig(max_steps=2, run_dir=str(tmp_path / "run"), progress_bar="off", device="cpu")
    engine.Trainer(config, [record]).fit(elastic_train.Model(record), elastic_train.loader(8))
    config = engine.TrainerConfig(max_epochs=1, run_dir=str(tmp_path / "run"), progress_bar="off", device="cpu",
                                  elastic=True)
    with pytest.raises(engine.CheckpointIncompatible, match=r"^ckpt-\d+ was written by a single process that read its "
                                                           r"DataLoader in the loader's own order .*[^\n]$"):
        engine.Trainer(config, [record]).fit(elastic_train.Model(record), elastic_train.loader(8))


def test_elastic_needs_data_and_a_sampler_the_engine_can_order() -> None:
    import engine
    from misuse_helpers import Plain

    with pytest.raises(engine.ConfigError, match=r"TrainerConfig.elastic: True needs the engine's sampler"):
        engine.TrainerConfig(elastic=True, distributed_sampler=False)
    with pytest.raises(engine.ConfigError, match=r"TrainerConfig.elastic"):
        engine.TrainerConfig(elastic=1)  # type: ignore[arg-type]
    config = engine.TrainerConfig(progress_bar="off", device="cpu", elastic=True)
    with pytest.raises(engine.ConfigError, match=r"TrainerConfig.elastic=True: the training data, a list, is not a "
                                                 r"DataLoader over a map-style dataset"):
        engine.Trainer(config).fit(Plain(), [torch.zeros(2, 3)])


def test_a_process_torchrun_started_alone_orders_its_data_the_global_way(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.run.coordinator import join_coordinator

    data = DataLoader(TensorDataset(torch.arange(24)), batch_size=8, shuffle=True)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert join_coordinator(torch.device("cpu")).shard(data, True) is data  # plain python: unchanged
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("WORLD_SIZE", "1")
    alone = join_coordinator(torch.device("cpu"))
    try:
        assert global_order.order_signature(alone.shard(data, True), 1) == {"world_size": 1, "global_batch": 8}
        assert alone.shard(data, False) is data  # distributed_sampler=False: the loader's own order
    finally:  # under torchrun the engine starts a one-rank group, which lives until the process ends
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_a_single_elastic_process_sigkilled_and_grown_to_2_ranks_trains_the_2_rank_runs_steps(
        reference_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    job = tmp_path / "grown"
    (job / "out").mkdir(parents=True)
    alone = helpers.run([sys.executable, SCRIPT, str(job / "run"), str(job / "out"), "0", "--elastic", "--batch", "8",
                         "--kill-at-step", "3"], helpers.environment())
    assert alone.returncode == -9, alone.stderr[-4000:]
    process = _torchrun(2, job, 1, "--batch", "8")  # the same script: the global batch stays 8, 4 per rank
    assert process.returncode == 0, process.stderr[-4000:]
    assert _samples_per_step(job / "out") == _samples_per_step(reference_run / "out")
    resumes = [json.loads(line) for line in (job / "run" / "resumes.jsonl").read_text().splitlines()]
    assert [(row["step"], row["world_size_before"], row["world_size"]) for row in resumes] == [(2, 1, 2)]
    _assert_close_parameters(reference_run / "out" / "final-0.pt", job / "out" / "final-1.pt")


def test_one_process_with_distributed_sampler_off_resuming_a_distributed_run_is_refused(
        tbptt_killed: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # distributed_sampler=False leaves the loader as given (batches of 4 in its own order), so the
    # run's global position (6 steps of G=8) cannot continue on it: refused, not re-ordered anyway.
    job = _copy_job(tbptt_killed, tmp_path)
    process = helpers.run([sys.executable, SCRIPT, str(job / "run"), str(job / "out"), "1", *TBPTT,
                           "--no-distributed-sampler"], helpers.environment())
    assert process.returncode == 2, process.stderr[-4000:]
    error = (job / "out" / "error-1-0.txt").read_text()
    assert error.startswith("WorldSizeChangeRefused: ") and "distributed_sampler=False" in error and "\n" not in error
    assert not list((job / "out").glob("steps-1-*"))  # nothing trained


def test_a_changed_batch_size_on_another_world_size_is_refused_saying_to_keep_the_scripts(
        tbptt_killed: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # The natural edit when going from 2 ranks of 4 to 1 rank: a batch of 8 (G). The engine
    # derives that itself, so the refusal must say to keep the script's 4, not only differ.
    job = _copy_job(tbptt_killed, tmp_path)
    process = helpers.run([sys.executable, SCRIPT, str(job / "run"), str(job / "out"), "1", *TBPTT, "--batch", "8"],
                          helpers.environment())
    assert process.returncode == 2, process.stderr[-4000:]
    error = (job / "out" / "error-1-0.txt").read_text()
    assert error.startswith("CheckpointIncompatible: ") and "batch_size: checkpoint 4, this run 8" in error
    assert "keep the script's DataLoader batch_size=4" in error and "G=8" in error and "\n" not in error


def test_resume_auto_on_another_world_size_with_no_anchor_left_says_there_is_none(
        tbptt_killed: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # A job killed before its first anchor committed (an early kill, asynchronous writes) leaves
    # only checkpoints inside a batch: the refusal must not send the user to resume='auto', which
    # is what failed, but say that the run directory holds no anchor yet.
    job = _copy_job(tbptt_killed, tmp_path)
    for entry in inspect_run(str(job / "run"))["checkpoints"]:
        if entry["anchor"]:
            shutil.rmtree(job / "run" / "checkpoints" / entry["name"])
    process = helpers.run([sys.executable, SCRIPT, str(job / "run"), str(job / "out"), "1", *TBPTT],
                          helpers.environment())
    assert process.returncode == 2, process.stderr[-4000:]
    error = (job / "out" / "error-1-0.txt").read_text()
    assert error.startswith("WorldSizeChangeRefused: ") and "it was taken inside a batch" in error
    assert "under resume='auto' the run directory holds none yet" in error and "\n" not in error
