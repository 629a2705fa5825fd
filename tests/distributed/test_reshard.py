"""A sharded (FSDP2) run resumed on another number of ranks: each rank reshards the model and
the optimizers' moments from every old rank's shards (engine.distributed.reshard), and the data
order follows the run's global order (engine.distributed.global_order). Real torchrun jobs (gloo
on CPU) of tests/distributed/fsdp_train.py, SIGKILLed at batch boundaries."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess

import pytest
import torch

import engine
import fsdp_train
import torchrun_helpers as helpers
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.cli.commands import inspect_run
from engine.errors import CheckpointIncompatible

pytestmark = pytest.mark.slow
# No TBPTT (every checkpoint is at a batch boundary), one optimizer step per batch, 2 epochs of
# 16 samples in global batches of 4 (2 per rank on 2 ranks): 8 optimizer steps. The script makes
# the process group itself, so that one process under torchrun shards its model on a 1-rank mesh.
OPTIONS = ("--whole-batches", "--accumulate", "1", "--epochs", "2", "--shard-before-fit")
STEPS, SAMPLES = 8, 16


def _torchrun(ranks: int, job: pathlib.Path, attempt: int, kill_after: int | None = None) -> subprocess.CompletedProcess:
    """One try of the job on ``ranks`` ranks; ``kill_after``: rank 0 is SIGKILLed after the
    checkpoint of its ``kill_after``-th step in this try."""
    (job / "out").mkdir(parents=True, exist_ok=True)
    env = {} if kill_after is None else {"KILLS": f"0/0/split_end_after_checkpoint:{kill_after}:sigkill"}
    command = helpers.torchrun_command(ranks, job / "run", job / "out", *OPTIONS, "--record-steps", str(attempt),
                                       script=helpers.FSDP_SCRIPT, forked_ranks=True)
    return helpers.run(command, helpers.environment(**env))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The uninterrupted 2-rank run."""
    job = tmp_path_factory.mktemp("reshard") / "reference"
    process = _torchrun(2, job, 0)
    assert process.returncode == 0, process.stderr[-4000:]
    return job


@pytest.mark.exhaustive  # CI time (about 40 s: the default run keeps the FSDP2 recipe resumed on another world size (test_fsdp_recipe))
def test_sigkilled_sharded_run_resumed_on_4_then_1_then_2_ranks_reshards_and_trains_the_same_samples(
        reference: pathlib.Path, tmp_path: pathlib.Path) -> None:
    job = tmp_path / "job"
    # 2 ranks, killed after step 3. The newest checkpoint then loses rank 1's part: it is invalid,
    # and the 4 ranks resume from the one before (step 2), killed after step 4; 1 rank (a model
    # sharded on a one-rank mesh) from step 4, killed after step 5; 2 ranks to the end.
    for attempt, (ranks, kill_after) in enumerate([(2, 3), (4, 2), (1, 1), (2, None)]):
        if attempt == 1:
            store = CheckpointStore(Storage(str(job / "run")), create=False)
            newest, fallback = store.names()[-1], store.names()[-2]
            (job / "run" / "checkpoints" / newest / "rank-00001.bin").unlink()
        process = _torchrun(ranks, job, attempt, kill_after)
        assert process.returncode == (0 if kill_after is None else 1), f"try {attempt}: {process.stderr[-4000:]}"
        if kill_after is not None:  # killed, not failed: it trained kill_after steps
            assert len((job / "out" / f"steps-{attempt}-0.jsonl").read_text().splitlines()) == kill_after
        assert inspect_run(str(job / "run"))["checkpoints"][-1]["world_size"] == ranks
    resumes = [json.loads(line) for line in (job / "run" / "resumes.jsonl").read_text().splitlines()]
    assert [(row["world_size_before"], row["world_size"], row["step"]) for row in resumes] == [(2, 4, 2), (4, 1, 4), (1, 2, 5)]
    assert resumes[0]["checkpoint"] == fallback
    expected = helpers.samples_per_step(reference / "out")
    assert len(expected) == STEPS and helpers.samples_per_step(job / "out") == expected
    for epoch in (0, 1):  # each sample once per epoch
        steps = range(epoch * STEPS // 2 + 1, (epoch + 1) * STEPS // 2 + 1)
        assert sorted(sum((expected[step] for step in steps), [])) == list(range(SAMPLES))
    # fsdp_train.py gathers every parameter and optimizer state (Adam's step and moments) in full.
    final, uninterrupted = helpers.final_state(job / "out", 0), helpers.final_state(reference / "out", 0)
    for key, value in uninterrupted.items():
        if key.endswith(".step"):
            assert torch.equal(value, final[key]), key
        elif key.startswith(("param.", "optim.")):
            helpers.assert_close_after_resharding(value, final[key], key)
    assert any(key.endswith(".exp_avg_sq") for key in uninterrupted)


def test_a_plain_unsharded_process_is_refused_naming_both_world_sizes(reference: pathlib.Path,
                                                                     tmp_path: pathlib.Path) -> None:
    # One process without a process group cannot hold DTensors: it is told to shard on a
    # one-rank mesh (as the 1-rank try above does) or to start a new run from the weights.
    shutil.copytree(reference / "run", tmp_path / "run")
    model = fsdp_train.Model(shard_in_configure_model=False, tbptt=False)
    tokens = torch.zeros(SAMPLES, fsdp_train.TIME, dtype=torch.int64)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, tokens), batch_size=4, shuffle=True)
    config = engine.TrainerConfig(max_epochs=2, run_dir=str(tmp_path / "run"), progress_bar="off", device="cpu",
                                  gradient_clip_val=0.5, checkpoint=engine.CheckpointConfig(every_n_splits=1, keep_last=3))
    with pytest.raises(CheckpointIncompatible, match=r"holds sharded tensors \(written by 2 rank\(s\), resumed on 1\) but "
                                                     r"this run's model is not sharded: apply fully_shard") as raised:
        engine.Trainer(config).fit(model, loader, resume="latest")
    assert "\n" not in str(raised.value)


@pytest.mark.exhaustive
@pytest.mark.parametrize("ranks", [1, 4])
@pytest.mark.parametrize("kill_after", [1, 4, 7])  # a first step, an epoch's end, the last epoch
def test_one_world_size_change_at_each_kind_of_boundary(reference: pathlib.Path, tmp_path: pathlib.Path,
                                                       kill_after: int, ranks: int) -> None:
    job = tmp_path / "job"
    assert _torchrun(2, job, 0, kill_after).returncode == 1
    process = _torchrun(ranks, job, 1)
    assert process.returncode == 0, process.stderr[-4000:]
    assert helpers.samples_per_step(job / "out") == helpers.samples_per_step(reference / "out")
    final, uninterrupted = helpers.final_state(job / "out", 0), helpers.final_state(reference / "out", 0)
    for key, value in uninterrupted.items():
        if key.startswith(("param.", "optim.")):
            helpers.assert_close_after_resharding(value, final[key], key)
