"""TrainerConfig.device: resolving it, moving the module and every batch, hidden state restored
onto the run's device, the CUDA generator, the determinism envelope, pinned async snapshots.

Without a second device, placement is checked on the ``meta`` device; tests marked ``gpu`` run
on a CUDA machine (benchmarks/gpu_check.sh)."""

import collections
import os
import warnings

import pytest
import torch

import engine
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.writers.buffers import SnapshotBuffers
from engine.data.rng import RngSnapshot, capture_global_rng, restore_global_rng
from engine.run import state as run_state
from engine.loops.device import OnDevice, move_to_device, prepare_device, resolve_device
from engine.run.envelope import FIELDS, capture_envelope
from engine.run.run import FitRun
from resume_helpers import assert_resumes_are_exact, assert_same_run, copy_run_until, memory_url
from scenarios import build, train_with_checkpoints

# cuBLAS is deterministic only with a fixed workspace (read when CUDA first creates a handle).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
META = torch.device("meta")
Pair = collections.namedtuple("Pair", ["inputs", "targets"])


# ---- resolving the device ---------------------------------------------------------------
def fake_cuda(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_auto_is_the_cpu_without_cuda(monkeypatch):
    fake_cuda(monkeypatch, 0)
    assert resolve_device("auto", {}) == torch.device("cpu")
    assert resolve_device("cpu", {"LOCAL_RANK": "3"}) == torch.device("cpu")


def test_auto_and_cuda_follow_local_rank(monkeypatch):
    fake_cuda(monkeypatch, 4)
    assert resolve_device("auto", {}) == torch.device("cuda", 0)
    assert resolve_device("auto", {"LOCAL_RANK": "2"}) == torch.device("cuda", 2)
    assert resolve_device("cuda", {"LOCAL_RANK": "3"}) == torch.device("cuda", 3)
    assert resolve_device("cuda:1", {"LOCAL_RANK": "3"}) == torch.device("cuda", 1)


def test_a_missing_device_is_a_config_error(monkeypatch):
    fake_cuda(monkeypatch, 0)
    with pytest.raises(engine.ConfigError, match=r"TrainerConfig.device: 'cuda' needs CUDA"):
        resolve_device("cuda", {})
    fake_cuda(monkeypatch, 2)
    with pytest.raises(engine.ConfigError, match=r"'cuda:5' resolves to cuda:5 but this machine has 2"):
        resolve_device("cuda:5", {})
    with pytest.raises(engine.ConfigError, match=r"LOCAL_RANK.*'x'"):
        resolve_device("auto", {"LOCAL_RANK": "x"})


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "CPU", "", 0])
def test_device_setting_is_validated(device):
    with pytest.raises(engine.ConfigError, match="TrainerConfig.device"):
        engine.TrainerConfig(device=device)


# ---- moving modules and batches -----------------------------------------------------------
def test_nested_batches_move_and_keep_their_shape():
    batch = {
        "pair": Pair(torch.ones(2), [torch.zeros(3), "label", 7]),
        "ordered": collections.OrderedDict(a=torch.ones(1)),
        "counts": collections.defaultdict(int, b=torch.ones(1)),
        "meta": ("name", None, 1.5),
    }
    moved = move_to_device(batch, META)
    assert type(moved["pair"]) is Pair and moved["pair"].inputs.device == META
    assert moved["pair"].targets[0].device == META and moved["pair"].targets[1:] == ["label", 7]
    assert type(moved["ordered"]) is collections.OrderedDict and moved["ordered"]["a"].device == META
    assert type(moved["counts"]) is collections.defaultdict and moved["counts"]["b"].device == META
    assert moved["meta"] == ("name", None, 1.5)
    assert batch["pair"].inputs.device.type == "cpu"  # the original is left alone


def test_on_device_moves_each_batch_before_the_level_below():
    seen = []

    class Recorder:
        def run_batch(self, batch, batch_index):
            seen.append((batch[0].device, batch_index))
            return []

        def end_epoch(self):
            seen.append("end")

    runner = OnDevice(Recorder(), META)
    runner.run_batch((torch.ones(2),), 4)
    runner.end_epoch()
    assert seen == [(META, 4), "end"]


def test_prepare_device_moves_the_module():
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    prepare_device(module, META)
    assert all(t.device == META for t in [*module.parameters(), *module.buffers()])


def test_hidden_state_is_restored_onto_the_runs_device():
    """A checkpoint's hidden state (decoded on the device that wrote it) goes to the device of
    the run that resumes it."""
    model, loader = build("tbptt")
    run = FitRun(engine.TrainerConfig(run_dir=None, checkpoint=None, progress_bar="off"), [], model, loader, None)
    states = run.tree.loop_states()
    states["split"] = {"hidden": (torch.ones(1, 4, 8), torch.zeros(1, 4, 8))}
    run.tree.device = META
    run.tree.load_loop_states(states)
    assert [h.device for h in run.tree.split.hidden] == [META, META]
    run.tree.close()


class NestedBatches(engine.Module):
    """Reads a dict batch holding a namedtuple and a non-tensor leaf."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.seen = []

    def training_step(self, batch):
        pair = batch["pair"]
        self.seen.append((type(pair), batch["name"], pair.inputs.device, self.layer.weight.device))
        return torch.nn.functional.mse_loss(self.layer(pair.inputs), pair.targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def nested_data():
    return [{"pair": Pair(torch.ones(3, 2) * i, torch.ones(3, 1)), "name": f"b{i}"} for i in range(3)]


def test_fit_hands_the_step_its_nested_batch_on_the_device():
    model = NestedBatches()
    engine.Trainer(engine.TrainerConfig(device="cpu", run_dir=None, checkpoint=None, progress_bar="off")).fit(
        model, nested_data())
    cpu = torch.device("cpu")
    assert model.seen == [(Pair, f"b{i}", cpu, cpu) for i in range(3)]


# ---- RNG and determinism envelope ---------------------------------------------------------
def test_one_cuda_generator_at_most():
    snapshot = capture_global_rng()
    snapshot.torch_cuda = [snapshot.torch_cpu, snapshot.torch_cpu]
    with pytest.raises(ValueError, match="at most one device"):
        snapshot.check()


def test_each_checkpoint_records_the_envelope():
    run_dir = memory_url("devices")
    train_with_checkpoints("plain", run_dir, epochs=1)
    for name in CheckpointStore(Storage(run_dir)).names():
        envelope = CheckpointStore(Storage(run_dir)).load(name).state[run_state.ENVELOPE]
        assert set(envelope) == set(FIELDS)
        assert envelope["torch_version"] == torch.__version__
        assert envelope["device"] == "cpu"
        assert envelope["cudnn_benchmark"] == torch.backends.cudnn.benchmark


def test_a_malformed_envelope_is_corrupt():
    run_dir = memory_url("devices")
    train_with_checkpoints("plain", run_dir, epochs=1)
    state = CheckpointStore(Storage(run_dir)).latest().state
    state[run_state.ENVELOPE] = dict(state[run_state.ENVELOPE], torch_version=3)
    with pytest.raises(engine.CheckpointCorrupt, match="envelope.*torch_version"):
        run_state.validate("ckpt", state)
    del state[run_state.ENVELOPE]
    with pytest.raises(engine.CheckpointCorrupt, match="envelope"):
        run_state.validate("ckpt", state)


def test_resume_under_other_numerics_settings_warns_once_naming_them():
    reference = memory_url("devices")
    train_with_checkpoints("plain", reference)
    names = CheckpointStore(Storage(reference)).names()
    same, changed = memory_url("devices"), memory_url("devices")
    copy_run_until(reference, same, names[2])
    copy_run_until(reference, changed, names[2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_with_checkpoints("plain", same)
    assert not [w for w in caught if "numerics settings" in str(w.message)]
    benchmark, precision = torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision()
    try:
        torch.backends.cudnn.benchmark = not benchmark
        torch.set_float32_matmul_precision("medium" if precision != "medium" else "high")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = train_with_checkpoints("plain", changed)
    finally:
        torch.backends.cudnn.benchmark = benchmark
        torch.set_float32_matmul_precision(precision)
    envelope_warnings = [str(w.message) for w in caught if "numerics settings" in str(w.message)]
    assert len(envelope_warnings) == 1
    assert "cudnn_benchmark" in envelope_warnings[0] and "float32_matmul_precision" in envelope_warnings[0]
    assert "torch_version" not in envelope_warnings[0]
    assert result.resumed_from == names[2]
    assert_same_run(reference, changed)  # a CPU run does not use either setting


# ---- on a CUDA device ---------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_run_places_the_module_and_batches_on_the_device():
    model = NestedBatches()
    engine.Trainer(engine.TrainerConfig(device="cuda", run_dir=None, checkpoint=None, progress_bar="off")).fit(
        model, nested_data())
    device = torch.device("cuda", torch.cuda.current_device())
    assert [entry[2:] for entry in model.seen] == [(device, device)] * 3
    assert capture_envelope(device)["device_name"] == torch.cuda.get_device_name(device)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tbptt", "bf16", "fp16_accumulate"])
def test_cuda_resume_from_every_checkpoint(name):
    """Dropout draws from the CUDA generator: exactness needs it saved and restored."""
    reference = memory_url("devices")
    train_with_checkpoints(name, reference, keep_last=None, device="cuda")
    names = CheckpointStore(Storage(reference)).names()
    assert_resumes_are_exact(reference, names[:-1:3],
                             lambda run_dir: train_with_checkpoints(name, run_dir, keep_last=None, device="cuda"))


@pytest.mark.gpu
def test_cuda_generator_round_trip():
    prepare_device(torch.nn.Linear(1, 1), torch.device("cuda", 0))
    snapshot = capture_global_rng()
    assert len(snapshot.torch_cuda) == 1
    first = torch.rand(8, device="cuda")
    restore_global_rng(RngSnapshot.from_state(snapshot.to_state()))
    assert torch.equal(torch.rand(8, device="cuda"), first)


@pytest.mark.gpu
def test_pinned_snapshot_is_not_raced_by_the_next_step():
    source = torch.randn(1 << 20, device="cuda")
    expected = source.cpu()
    buffers = SnapshotBuffers()
    (copy,) = buffers.capture([source], [(0, source.numel() * source.element_size())])
    source.mul_(2)  # queued after the copy on the same stream, like the next optimizer step
    buffers.wait_until_copied()
    assert copy.is_pinned()
    assert torch.equal(copy, expected)


@pytest.mark.gpu
def test_cuda_asynchronous_checkpoints_equal_synchronous_ones():
    synchronous, asynchronous = memory_url("devices"), memory_url("devices")
    train_with_checkpoints("fp16_accumulate", synchronous, device="cuda")
    train_with_checkpoints("fp16_accumulate", asynchronous, device="cuda", asynchronous=True)
    assert_same_run(synchronous, asynchronous)


@pytest.mark.gpu
def test_a_cuda_checkpoint_resumes_on_the_cpu():
    run_dir = memory_url("devices")
    train_with_checkpoints("tbptt", run_dir, epochs=1, device="cuda")
    with pytest.warns(UserWarning, match="device: checkpoint 'cuda', this run 'cpu'"):
        result = train_with_checkpoints("tbptt", run_dir, epochs=2, device="cpu")
    assert result.resumed_from is not None and result.epochs_completed == 2
