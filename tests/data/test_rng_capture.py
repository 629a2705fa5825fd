"""The Python random state in a checkpoint is always the current one, also when consecutive
checkpoints see the same state (its tensor is then reused, not rebuilt); a state that a
generator would refuse is refused by validation, before anything is restored, and a checkpoint
holding one is INVALID (resume falls back to the previous one)."""

import json
import random
import sys

import pytest
import torch

from engine.checkpoint.format.codec import encode_state
from engine.checkpoint.store.request import CommitRequest
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.data.rng import RngSnapshot, capture_global_rng, check_generator_state, restore_global_rng
import forkserver
from resume_helpers import assert_same_run, copy_run_until
from scenarios import train_with_checkpoints


def _python_words(state):
    return state["python"][1]


def test_each_capture_holds_the_python_state_of_its_instant():
    random.seed(5)
    first = capture_global_rng().to_state()
    same = capture_global_rng().to_state()
    drawn = [random.random() for _ in range(3)]
    after = capture_global_rng().to_state()
    assert torch.equal(_python_words(first), _python_words(same))
    assert not torch.equal(_python_words(first), _python_words(after))
    assert torch.equal(_python_words(after), torch.tensor(random.getstate()[1], dtype=torch.int64))
    restore_global_rng(RngSnapshot.from_state(first))
    assert [random.random() for _ in range(3)] == drawn
    restore_global_rng(RngSnapshot.from_state(same))
    assert [random.random() for _ in range(3)] == drawn



def test_a_kept_snapshot_holds_its_own_instant_between_captures_of_other_instants():
    """The epoch start's snapshot is saved by every checkpoint of the epoch, between captures
    of the current streams: its words are converted once and stay its own (neither the
    current state's nor rebuilt each time)."""
    import numpy

    random.seed(7)
    numpy.random.seed(7)
    epoch_start = capture_global_rng()
    kept = epoch_start.to_state()
    for _ in range(3):
        random.random()
        numpy.random.random()
        now = capture_global_rng().to_state()
        again = epoch_start.to_state()
        assert again["python"][1] is kept["python"][1] and again["numpy"][1] is kept["numpy"][1]
        assert torch.equal(again["python"][1], torch.tensor(epoch_start.python[1], dtype=torch.int64))
        assert torch.equal(again["numpy"][1], torch.from_numpy(epoch_start.numpy[1].astype("int64")))
        assert torch.equal(now["python"][1], torch.tensor(random.getstate()[1], dtype=torch.int64))
        assert torch.equal(now["numpy"][1], torch.from_numpy(numpy.random.get_state()[1].astype("int64")))
        assert not torch.equal(now["python"][1], again["python"][1])
        assert not torch.equal(now["numpy"][1], again["numpy"][1])
    epoch_start.python = random.getstate()  # a replaced state is converted again
    assert torch.equal(epoch_start.to_state()["python"][1], torch.tensor(random.getstate()[1], dtype=torch.int64))

# ---- states a generator would refuse: refused by validation, before anything is applied ---------
def _forged_states():
    """Stream name -> a function turning a good to_state() value into one of the right type and
    size that its generator refuses (or would silently truncate)."""

    def torch_cpu(state):
        state["torch_cpu"] = torch.zeros_like(state["torch_cpu"])  # "Invalid mt19937 state"

    def python_index(state):
        words = state["python"][1].clone()
        words[-1] = _MT_INDEX_LIMIT + 1
        state["python"][1] = words

    def python_word(state):
        words = state["python"][1].clone()
        words[0] = 1 << 40
        state["python"][1] = words

    def numpy_position(state):
        state["numpy"][2] = 10_000

    def numpy_word(state):
        keys = state["numpy"][1].clone()
        keys[0] = -1
        state["numpy"][1] = keys

    def cuda_size(state):
        state["torch_cuda"] = [torch.zeros(15, dtype=torch.uint8)]

    def cuda_offset(state):
        state["torch_cuda"] = [torch.tensor([0] * 8 + [3] + [0] * 7, dtype=torch.uint8)]

    return {f.__name__: f for f in (torch_cpu, python_index, python_word, numpy_position, numpy_word, cuda_size,
                                    cuda_offset)}


_MT_INDEX_LIMIT = 624  # random.setstate accepts an index in 0..624
FORGED = _forged_states()


@pytest.mark.parametrize("forge", sorted(FORGED))
def test_a_state_its_generator_refuses_fails_the_check_and_leaves_the_streams_alone(forge):
    state = capture_global_rng().to_state()
    FORGED[forge](state)
    before = capture_global_rng().to_state()
    with pytest.raises(ValueError):
        RngSnapshot.from_state(state).check()
    after = capture_global_rng().to_state()
    assert torch.equal(before["torch_cpu"], after["torch_cpu"])
    assert torch.equal(before["python"][1], after["python"][1])
    assert torch.equal(before["numpy"][1], after["numpy"][1]) and before["numpy"][2] == after["numpy"][2]


def test_a_captured_state_passes_the_check():
    random.seed(3)
    torch.manual_seed(3)
    [random.random() for _ in range(700)]  # past one Mersenne Twister block
    torch.rand(1000)
    RngSnapshot.from_state(capture_global_rng().to_state()).check()
    RngSnapshot.from_state(capture_global_rng().to_state() | {"torch_cuda": [torch.zeros(16, dtype=torch.uint8)]}).check()


# ---- a forged checkpoint: valid checksums, a torch RNG state torch refuses ------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("reference"))
    train_with_checkpoints("tbptt", run_dir, keep_last=None)
    return run_dir


def _forge_rng(run_dir, name, where, forge):
    """Re-commit checkpoint ``name`` of ``run_dir`` under the same name with the RNG map that
    ``where(state)`` picks changed by ``forge``: new files, a new manifest, every checksum valid."""
    store = CheckpointStore(Storage(run_dir))
    loaded = store.load(name)
    progress_bytes = store.storage.read(f"checkpoints/{name}/progress.msgpack")
    forge(where(loaded.state))
    store.storage.remove_tree(f"checkpoints/{name}")
    forged = CheckpointStore(Storage(run_dir))
    forged.write(CommitRequest.of_state(encode_state(loaded.state), progress_bytes, loaded.manifest.cursor,
                                        loaded.manifest.writer_generation, sequence=int(name[5:])))
    assert forged.verifies(name)


# The global streams now, and at the start of the epoch (restored to replay the epoch's shuffle
# when a resume lands mid-epoch, as it does at the checkpoint forged below).
WHERE = {
    "rng": (lambda state: state["rng"], "the RNG state"),
    "epoch_start_rng": (lambda state: state["loops"]["data"]["epoch_start_rng"], "the data position's random state"),
}


@pytest.mark.slow
@pytest.mark.parametrize("where", sorted(WHERE))
def test_a_forged_rng_state_is_invalid_and_resume_falls_back_exactly(where, reference, tmp_path):
    names = CheckpointStore(Storage(reference)).names()
    newest, previous = names[10], names[9]
    run_dir = str(tmp_path / "run")
    copy_run_until(reference, run_dir, newest)
    pick, described = WHERE[where]
    _forge_rng(run_dir, newest, pick, FORGED["torch_cpu"])

    process = forkserver.run([sys.executable, "-m", "engine", "inspect", run_dir, "--json"],
                             capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr[-2000:]
    report = json.loads(process.stdout)
    entry = next(e for e in report["checkpoints"] if e["name"] == newest)
    assert entry["valid"] is False and described in entry["error"] and "torch_cpu" in entry["error"], entry
    assert report["latest"] == previous

    with pytest.warns(UserWarning, match=f"skipping checkpoint {newest}.*{described}"):
        result = train_with_checkpoints("tbptt", run_dir, keep_last=None)
    assert result.resumed_from == previous
    assert_same_run(reference, run_dir)


@pytest.mark.parametrize("state", [torch.zeros(5056, dtype=torch.uint8), torch.zeros(7, dtype=torch.uint8),
                                   torch.zeros(16, dtype=torch.uint8) + 3, torch.zeros(4, dtype=torch.int64)],
                         ids=["invalid mt19937", "short", "cuda offset", "int64"])
def test_a_loader_generator_state_its_generator_refuses_fails_the_check(state):
    with pytest.raises(ValueError, match="loader"):
        check_generator_state("loader", state)


def test_a_loader_generator_state_passes_the_check():
    generator = torch.Generator().manual_seed(4)
    torch.randperm(100, generator=generator)
    check_generator_state("loader", generator.get_state())
