"""FSDP2-sharded models under a real torchrun (gloo, CPU device mesh): training without DDP, each
rank saving its own shards, exact resume after SIGKILLs, consolidation in one plain process, a
missing rank part, refusals. tests/distributed/fsdp_train.py is the job."""

from __future__ import annotations

import json
import pathlib
import random
import shutil
import signal
import subprocess

import pytest
import torch

import engine
from engine.checkpoint.format.codec import decode_state
from engine.checkpoint.format.shards import TensorShard
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.errors import CheckpointIncompatible

import fsdp_train
import torchrun_helpers as helpers

pytestmark = pytest.mark.slow
SCRIPT = helpers.FSDP_SCRIPT


def train(tmp: pathlib.Path, name: str, ranks: int, *args: str, max_restarts: int = 0,
          **env: str) -> tuple[subprocess.CompletedProcess, pathlib.Path, pathlib.Path]:
    return helpers.train(tmp, name, ranks, *args, max_restarts=max_restarts, script=SCRIPT, **env)


@pytest.fixture(scope="module")
def reference_two(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """An uninterrupted 2-rank sharded run (2 epochs, a checkpoint every split)."""
    tmp = tmp_path_factory.mktemp("fsdp-reference2")
    process, _, _ = train(tmp, "job", 2)
    assert process.returncode == 0, process.stderr[-4000:]
    return tmp / "job"


def optimizer_steps(out_dir: pathlib.Path) -> int:
    """The optimizer steps the job's rank 0 reports (``rank 0 done: ... steps=N`` is not kept;
    the checkpoint's counter is the source)."""
    store = CheckpointStore(Storage(str(out_dir.parent / "run")), create=False)
    loaded = store.latest()
    assert loaded is not None
    return loaded.progress.records["flow.optimizer_steps"].total.completed


def test_each_rank_saves_its_own_shards_with_their_placement(reference_two: pathlib.Path) -> None:
    store = CheckpointStore(Storage(str(reference_two / "run")), create=False)
    loaded = store.latest()
    assert loaded is not None and loaded.state["signature"]["sharded"] is True
    part = decode_state(bytes(loaded.extra_files["rank-00001.msgpack"]), loaded.extra_files["rank-00001.bin"])
    final = helpers.final_state(reference_two / "out", 0)
    for rank, module_state in ((0, loaded.state["module"]), (1, part["module"])):
        shard = module_state["embedding.weight"]
        assert isinstance(shard, TensorShard)
        # 15 rows over 2 ranks: rank 0 holds rows 0..7, rank 1 rows 8..14 (nothing gathered).
        rows = (0, 8) if rank == 0 else (8, 7)
        assert shard.offsets == (rows[0], 0) and tuple(shard.local.shape) == (rows[1], 8)
        assert shard.global_shape == (15, 8) and shard.mesh_shape == (2,) and shard.placements == ("shard:0",)
        assert torch.equal(shard.local, final["param.embedding.weight"][rows[0]:rows[0] + rows[1]])
    moments = part["optimizers"][0]["state"][0]
    assert isinstance(moments["exp_avg"], TensorShard) and moments["exp_avg"].offsets == (8, 0)


def test_the_documented_reader_decodes_rank_0s_shards(reference_two: pathlib.Path) -> None:
    import importlib.util
    path = pathlib.Path(__file__).resolve().parents[1] / "checkpoint" / "format" / "test_format_doc_reader.py"
    spec = importlib.util.spec_from_file_location("format_doc_reader", path)
    assert spec is not None and spec.loader is not None
    reader_test = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reader_test)
    store = CheckpointStore(Storage(str(reference_two / "run")), create=False)
    _, _, state = reader_test._reader()(str(reference_two / "run" / "checkpoints" / store.names()[-1]))
    shard = state["module"]["embedding.weight"]
    assert (shard["global_shape"], shard["offsets"], shard["placements"]) == ([15, 8], [0, 0], ["shard:0"])
    final = helpers.final_state(reference_two / "out", 0)["param.embedding.weight"]
    assert torch.equal(torch.from_numpy(shard["local"].copy()), final[:8])


@pytest.mark.exhaustive  # CI time (about 20 s: the default run keeps the sharded kill tests)
def test_sharding_before_fit_trains_like_configure_model_and_survives_two_restarts(reference_two: pathlib.Path,
                                                                                  tmp_path: pathlib.Path) -> None:
    # The reproduction: fully_shard applied before fit used to be wrapped in DDP and die
    # in its parameter broadcast. The script starts the group (engine.distributed.init_process_group);
    # on torch's own, a restarted group read the dead try's addresses from torchrun's store and
    # failed (Connection refused) or hung in the engine's writer group.
    rng = random.Random()
    # 12 splits per rank and epoch: the second kill lands in the restarted try whatever the first.
    kills = ";".join(f"{restart}/{rng.randrange(2)}/split_end:{rng.randint(2, 10)}:sigkill" for restart in (0, 1))
    process, _, out_dir = train(tmp_path, "job", 2, "--shard-before-fit", "--start-timeout", "30", max_restarts=5,
                                KILLS=kills)
    assert process.returncode == 0, f"{kills}: " + process.stderr[-4000:]
    assert helpers.worker_pid(out_dir, 0, restart=2) is not None, "the group was not restarted twice"
    helpers.assert_same_result(reference_two, tmp_path / "job", 2)


def test_sigkills_at_a_split_boundary_and_mid_commit_resume_exactly(reference_two: pathlib.Path,
                                                                     tmp_path: pathlib.Path) -> None:
    rng = random.Random()
    boundary, commit = rng.randint(2, 20), rng.randint(1, 6)
    kills = f"0/1/split_end:{boundary}:sigkill;1/0/checkpoint_before_rename:{commit}:sigkill"
    process, _, out_dir = train(tmp_path, "job", 2, max_restarts=3, KILLS=kills)
    assert process.returncode == 0, f"{kills}: " + process.stderr[-4000:]
    assert helpers.worker_pid(out_dir, 0, restart=2) is not None, "the group was not restarted twice"
    helpers.assert_same_result(reference_two, tmp_path / "job", 2)


@pytest.mark.exhaustive  # test_reshard's default chain compares Adam's step and moments; the kill tests here compare final parameters
def test_adam_step_and_moments_after_a_resume_equal_the_uninterrupted_runs(reference_two: pathlib.Path,
                                                                           tmp_path: pathlib.Path) -> None:
    # Killed right after the checkpoint of split 5 (2 optimizer steps taken, the window of the
    # third open: its sharded gradients are in the checkpoint), then started again.
    process, run_dir, out_dir = train(tmp_path, "job", 2, KILLS="0/0/split_end_after_checkpoint:5:sigkill")
    assert process.returncode != 0
    loaded = CheckpointStore(Storage(str(run_dir)), create=False).latest()
    assert loaded is not None and loaded.progress.records["flow.optimizer_steps"].total.completed == 2
    flow = loaded.state["loops"]["flow"]
    assert flow["pending_backward"] == [True]
    assert all(isinstance(gradient, TensorShard) for gradient in flow["gradients"].values())
    again = helpers.run(helpers.torchrun_command(2, run_dir, out_dir, script=SCRIPT, forked_ranks=True),
                        helpers.environment())
    assert again.returncode == 0, again.stderr[-4000:]
    steps = optimizer_steps(reference_two / "out")
    for rank in range(2):
        expected, got = helpers.final_state(reference_two / "out", rank), helpers.final_state(out_dir, rank)
        optimizer_keys = sorted(key for key in expected if key.startswith("optim."))
        assert optimizer_keys == sorted(key for key in got if key.startswith("optim."))
        assert {key.split(".")[2] for key in optimizer_keys} == {"step", "exp_avg", "exp_avg_sq"}
        for key in optimizer_keys:
            assert torch.equal(expected[key], got[key]), f"rank {rank}: {key}"
            if key.endswith(".step"):
                # No optimizer.step() ran to create the state: the count is the run's steps.
                assert int(got[key]) == steps, key
    helpers.assert_same_result(reference_two, tmp_path / "job", 2)


def kill_one_rank_at_a_random_instant(reference: pathlib.Path, job_dir: pathlib.Path, ranks: int, *options: str) -> None:
    """SIGKILL a random rank at a random instant of a slowed-down job; its restarted group must
    end as ``reference`` ended."""
    rng = random.Random()
    rank, delay = rng.randrange(ranks), rng.uniform(0.0, 0.8)
    run_dir, out_dir = job_dir / "run", job_dir / "out"
    out_dir.mkdir(parents=True)
    command = helpers.torchrun_command(ranks, run_dir, out_dir, *options, "--async", "--slow", "0.05", max_restarts=2,
                                       script=SCRIPT)
    helpers.sigkill_a_rank_while_training(command, run_dir, out_dir, rank, delay)
    helpers.assert_same_result(reference, job_dir, ranks)


@pytest.mark.exhaustive  # random-instant kills: DDP's in test_torchrun; FSDP's boundary and mid-commit kills run by default
def test_sigkill_of_one_rank_at_a_random_instant_resumes_exactly(reference_two: pathlib.Path,
                                                                 tmp_path: pathlib.Path) -> None:
    kill_one_rank_at_a_random_instant(reference_two, tmp_path / "job", 2)


@pytest.mark.exhaustive  # one rank's preemption is the coordinator's, covered with DDP in test_torchrun
def test_a_preemption_of_one_rank_stops_every_rank_and_the_rerun_ends_exactly(reference_two: pathlib.Path,
                                                                             tmp_path: pathlib.Path) -> None:
    run_dir, out_dir = tmp_path / "job" / "run", tmp_path / "job" / "out"
    out_dir.mkdir(parents=True)
    command = helpers.torchrun_command(2, run_dir, out_dir, "--slow", "0.1", script=SCRIPT)
    with subprocess.Popen(command, env=helpers.environment(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True) as job:
        helpers.wait_for(lambda: min(helpers.splits_done(out_dir, rank) for rank in (0, 1)) >= 2, "training started", job)
        helpers.signal_worker(out_dir, 1, signal.SIGTERM)
        _, stderr = job.communicate(timeout=helpers.TIMEOUT)
    assert job.returncode == 0, stderr[-4000:]
    stopped = [line.partition("; checkpoint ")[2] for line in stderr.splitlines() if line.startswith("splitloop: ")]
    assert len(stopped) == 2 and stopped[0] == stopped[1], stderr[-4000:]  # one boundary, one checkpoint
    again = helpers.run(helpers.torchrun_command(2, run_dir, out_dir, script=SCRIPT, forked_ranks=True),
                        helpers.environment())
    assert again.returncode == 0, again.stderr[-4000:]
    helpers.assert_same_result(reference_two, tmp_path / "job", 2)


@pytest.mark.exhaustive  # CI time (about 20 s: the default run keeps the sharded kill tests)
def test_validation_of_a_sharded_model_runs_every_batch_in_lockstep_and_counts_each_sample_once(
        tmp_path: pathlib.Path) -> None:
    # 5 validation batches on 2 ranks: blocks of 3 and 2 would leave rank 0 waiting forever in
    # an FSDP2 forward (a collective) that rank 1 never makes; the root's own parameters are
    # gathered only inside its forward hooks, which validation_step bypassed.
    reference, _, _ = train(tmp_path, "reference", 2, "--validate", "--every", "3")
    assert reference.returncode == 0, reference.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "reference" / "run" / "metrics.jsonl").read_text().splitlines()]
    validation = [row["metrics"] for row in rows if row["stage"] == "val"]
    assert len(validation) == 2 and all("val_loss" in values for values in validation)
    assert all(values["val_tokens"] == fsdp_train.VAL_SAMPLES * fsdp_train.TIME for values in validation)
    killed, _, _ = train(tmp_path, "killed", 2, "--validate", "--every", "3", max_restarts=1,
                         KILLS="0/1/epoch_end:1:sigkill")
    assert killed.returncode == 0, killed.stderr[-4000:]
    helpers.assert_same_result(tmp_path / "reference", tmp_path / "killed", 2)


def test_load_weights_and_export_consolidate_the_shards_in_one_process(reference_two: pathlib.Path,
                                                                       tmp_path: pathlib.Path) -> None:
    final = helpers.final_state(reference_two / "out", 0)
    torch.manual_seed(0)
    model = fsdp_train.Model()  # plain, unsharded, other initial values
    engine.load_weights(model, str(reference_two / "run"))
    for key, value in model.state_dict().items():
        assert torch.equal(value, final[f"param.{key}"]), key
    engine.export_weights(str(reference_two / "run"), str(tmp_path / "model.pt"))
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(exported) == set(model.state_dict())
    for key, value in exported.items():
        assert torch.equal(value, final[f"param.{key}"]), key


def test_export_as_safetensors_loads_with_load_file(reference_two: pathlib.Path, tmp_path: pathlib.Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    final = helpers.final_state(reference_two / "out", 0)
    engine.export_weights(str(reference_two / "run"), str(tmp_path / "model.safetensors"), format="safetensors")
    loaded = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    assert set(loaded) == {key.removeprefix("param.") for key in final if key.startswith("param.")}
    for key, value in loaded.items():
        assert torch.equal(value, final[f"param.{key}"]), key


@pytest.mark.exhaustive  # test_reshard's default chain drops a rank part and falls back
def test_a_checkpoint_missing_one_ranks_part_is_invalid_and_resume_falls_back(reference_two: pathlib.Path,
                                                                              tmp_path: pathlib.Path) -> None:
    # A run stopped after its first epoch (its last checkpoint is the epoch's end), with rank 1's
    # part of that checkpoint deleted, then resumed for the second epoch: it must resume from the
    # checkpoint before and still end exactly where the uninterrupted run ends.
    process, run_dir, out_dir = train(tmp_path, "job", 2, "--epochs", "1")
    assert process.returncode == 0, process.stderr[-4000:]
    store = CheckpointStore(Storage(str(run_dir)), create=False)
    newest = store.names()[-1]
    (run_dir / "checkpoints" / newest / "rank-00001.bin").unlink()
    validity = {info.name: info.valid for info in store.inspect()}
    assert validity[newest] is False and validity[store.names()[-2]] is True
    again = helpers.run(helpers.torchrun_command(2, run_dir, out_dir, script=SCRIPT, forked_ranks=True),
                        helpers.environment())
    assert again.returncode == 0, again.stderr[-4000:]
    helpers.assert_same_result(reference_two, tmp_path / "job", 2)


def test_clipping_sharded_gradients_gives_the_numbers_of_unsharded_clipping(tmp_path: pathlib.Path) -> None:
    script = str(pathlib.Path(helpers.FSDP_SCRIPT).with_name("fsdp_clip.py"))
    command = [helpers.sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               *helpers.rank_entry_point(script, forked=True), str(tmp_path / "clipped.pt")]
    process = helpers.run(command, helpers.environment())
    assert process.returncode == 0, process.stderr[-4000:]
    result = torch.load(tmp_path / "clipped.pt", weights_only=True)
    assert float(result["plain.norm"]) > 1.0  # the clipping did scale the gradients down
    for key in (key for key in result if key.startswith("plain.")):
        assert torch.equal(result[key], result[key.replace("plain.", "sharded.")]), key


@pytest.mark.exhaustive
@pytest.mark.parametrize("fault", ["split_end", "checkpoint_before_rename", "checkpoint_before_manifest"])
def test_four_ranks_resume_exactly_after_a_sigkill(tmp_path: pathlib.Path, fault: str) -> None:
    options = ("--epochs", "1")
    reference, _, _ = train(tmp_path, "reference", 4, *options)
    assert reference.returncode == 0, reference.stderr[-4000:]
    rng = random.Random()
    rank, hit = rng.randrange(4), rng.randint(1, 5)
    process, _, _ = train(tmp_path, "killed", 4, *options, max_restarts=2, KILLS=f"0/{rank}/{fault}:{hit}:sigkill")
    assert process.returncode == 0, f"rank {rank} {fault}:{hit}: " + process.stderr[-4000:]
    helpers.assert_same_result(tmp_path / "reference", tmp_path / "killed", 4)


@pytest.mark.exhaustive
def test_four_ranks_resume_exactly_after_a_sigkill_at_a_random_instant(tmp_path: pathlib.Path) -> None:
    reference, _, _ = train(tmp_path, "reference", 4, "--epochs", "1")
    assert reference.returncode == 0, reference.stderr[-4000:]
    kill_one_rank_at_a_random_instant(tmp_path / "reference", tmp_path / "killed", 4, "--epochs", "1")
