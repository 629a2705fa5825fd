"""Streams with state resume from their saved state (never replayed), with and without worker
processes, Hugging Face ``datasets`` streaming included; streams without state are replayed
with a progress bar; a state the checkpoint cannot hold is refused naming the data."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import pathlib
import random
import sys
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import engine
import engine.data
import forkserver
from engine.cli.main import main
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.storage import Storage
from engine.data.combined import combine_loaders
from engine.data.streams import drop_batches
from engine.errors import DataError
from kill_helpers import kill_at_random_instant
from resume_helpers import assert_resumes_are_exact, assert_same_run, copy_run_until

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "distributed"))
import stream_train  # noqa: E402
import torchrun_helpers  # noqa: E402

SCRIPT = str(pathlib.Path(stream_train.__file__))
KINDS = ["stream-0", "stream-2", "hf-0", "hf-2", "hf_shuffled-0", "hf_shuffled-2", "hf_shuffled_after_map-0",
         "hf_shuffled_after_map-2", "mixture-stop", "mixture-cycle", "mixture-drop",
         "combined-max_size_cycle", "combined-min_size", "combined-sequential"]


def train(kind: str, run_dir: pathlib.Path, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = stream_train.train(kind, str(run_dir), **options)
    return result, [str(w.message) for w in caught]


# The two longest epochs (a mixture that drops an exhausted source, the loaders one after the
# other) resume from many checkpoints: behind the exhaustive marker, their modes' siblings stay.
# CI time: one worker count of each kind by default, the other in the exhaustive run.
LONG_KINDS = ("mixture-drop", "combined-sequential", "stream-0", "hf-2", "hf_shuffled-0", "hf_shuffled_after_map-2",
              "mixture-cycle", "combined-max_size_cycle")


@pytest.mark.parametrize("kind", [pytest.param(kind, marks=pytest.mark.exhaustive) if kind in LONG_KINDS else kind
                                  for kind in KINDS])
def test_a_stream_with_state_resumes_from_its_checkpoints_exactly_without_replay(kind, tmp_path):
    """Resumed from checkpoints spread over two epochs (mid-epoch, at an epoch end), each step
    sees the samples it saw in the uninterrupted run (metrics.jsonl logs them) and the final
    state is bit-identical; the stream is never replayed."""
    reference = tmp_path / "reference" / "run"
    train(kind, reference, keep_last=None)
    store = CheckpointStore(Storage(str(reference)))
    names = store.names()
    assert len(names) > 6
    epochs_done = [store.load(name).progress.records["fit.epochs"].total.completed for name in names]
    first_epoch_end = epochs_done.index(1)
    # Each resume trains to the end: the first checkpoint (one worker has not yielded yet: its
    # position is the one before it iterated; with workers only, CI time: a resume from there is
    # nearly a whole run), the first epoch's last batch and its end, and one inside the second epoch.
    first = [names[0]] if not kind.endswith("-0") else []
    chosen = [*first, *names[first_epoch_end - 1:first_epoch_end + 1], names[(first_epoch_end + len(names)) // 2]]

    def resume(run_dir):
        result, messages = train(kind, run_dir, keep_last=None)
        assert not [m for m in messages if "drawing and dropping" in m]
        return result

    assert_resumes_are_exact(str(reference), sorted(set(chosen)), resume, lambda name: str(tmp_path / name / "run"))


@pytest.mark.parametrize("epoch", [0, 1])
def test_a_resumed_hf_stream_with_workers_checkpointed_before_each_worker_yields_resumes_exactly(epoch, tmp_path):
    """A resumed run's first checkpoint comes after one batch, from one of the 2 workers: the
    other worker's position is the one it loaded (datasets answered its stream's start until it
    iterated, and a second resume replayed its shards). Resumed again from that checkpoint, the
    run equals the uninterrupted one."""
    reference = tmp_path / "reference" / "run"
    train("hf-2", reference, keep_last=None)
    names = CheckpointStore(Storage(str(reference))).names()
    resume_at = 4 + epoch * len(names) // 2
    first = tmp_path / "first" / "run"
    copy_run_until(str(reference), str(first), names[resume_at])
    train("hf-2", first, keep_last=None)
    second = tmp_path / "second" / "run"
    copy_run_until(str(first), str(second), names[resume_at + 1])  # the first resumed run's first checkpoint
    result, _ = train("hf-2", second, keep_last=None)
    assert result.resumed_from == names[resume_at + 1]
    assert_same_run(str(reference), str(second))


def test_a_stream_with_state_is_loaded_not_replayed():
    """Without workers the stream's own object is used: the resumed run loads its state once
    and reads only the samples after the checkpoint."""
    reads = []

    class Recording(stream_train.CountingStream):
        def __iter__(self):
            for item in super().__iter__():
                reads.append(int(item["id"]))
                yield item

    def fit(run_dir, stream):
        torch.manual_seed(0)
        config = engine.TrainerConfig(max_epochs=1, run_dir=run_dir, progress_bar="off",
                                      checkpoint=engine.CheckpointConfig(every_n_splits=1, keep_last=None))
        engine.Trainer(config).fit(stream_train.Model(), DataLoader(stream, batch_size=4), resume="auto")

    reference = "memory://streams-reference"
    fit(reference, Recording())
    resumed = "memory://streams-resumed"
    copy_run_until(reference, resumed, CheckpointStore(Storage(reference)).names()[7])  # 8 batches done
    reads.clear()
    stream = Recording()
    fit(resumed, stream)
    assert stream.loads_state == 1
    assert reads == list(range(32, stream_train.SAMPLES))
    assert_same_run(reference, resumed)


# The Hugging Face shuffled stream is resumed from every checkpoint by default (above) and killed at
# random instants in the exhaustive run (here and below, again and again).
@pytest.mark.slow
@pytest.mark.parametrize("kind", [pytest.param("stream-2", marks=pytest.mark.exhaustive),
                                  pytest.param("hf_shuffled-2", marks=pytest.mark.exhaustive),
                                  pytest.param("mixture-cycle", marks=pytest.mark.exhaustive),
                                  "combined-max_size_cycle"])
def test_sigkills_at_random_instants_resume_a_stream_exactly(kind, tmp_path):
    """SIGKILL at random instants (workers alive, mid-checkpoint, ...), resume each time: the
    samples each step saw and the final parameters equal the uninterrupted run's. hf_shuffled-2:
    a Hugging Face stream through a shuffle buffer and a map, read by 2 workers."""
    assert_random_sigkills_resume_exactly(kind, tmp_path, f"streams-{kind}")


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("attempt", range(10))
@pytest.mark.parametrize("kind", ["hf-2", "hf_shuffled-2", "hf_shuffled-0", "hf_shuffled_after_map-2"])
def test_sigkills_at_random_instants_resume_a_stream_exactly_again_and_again(kind, attempt, tmp_path):
    """The random-kill case above with other kill instants, for Hugging Face streams with and
    without a shuffle buffer (one with 2 workers once resumed differently after several resumes:
    a worker's position saved before it had yielded since the resume)."""
    assert_random_sigkills_resume_exactly(kind, tmp_path, f"streams-{kind}-{attempt}")


def assert_random_sigkills_resume_exactly(kind: str, tmp_path: pathlib.Path, seed: str, kills_wanted: int = 2) -> None:
    reference = tmp_path / "reference" / "run"
    finished = forkserver.run([sys.executable, SCRIPT, kind, str(reference)], capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr[-3000:]
    rng = random.Random(seed)
    kills, runs = 0, 0
    while kills < kills_wanted:
        run_dir = tmp_path / f"killed-{runs}" / "run"
        runs += 1
        while kill_at_random_instant(kind, str(run_dir), rng, 1.0, "--sleep", "0.05", script=SCRIPT):
            kills += 1
        assert_same_run(str(reference), str(run_dir))  # samples of every step (metrics.jsonl), parameters, states
        final = CheckpointStore(Storage(str(run_dir))).latest()
        expected = CheckpointStore(Storage(str(reference))).latest()
        for key, value in expected.state["module"].items():
            assert torch.equal(value, final.state["module"][key])


class Unstorable(IterableDataset):
    def __iter__(self):
        yield from ({"id": torch.zeros(1), "x": torch.ones(1)} for _ in range(4))

    def state_dict(self):
        return {"reader": object()}

    def load_state_dict(self, state):
        pass


def test_a_state_the_checkpoint_cannot_hold_is_refused_naming_the_data():
    config = engine.TrainerConfig(max_epochs=1, run_dir="memory://streams-unstorable", progress_bar="off",
                                  checkpoint=engine.CheckpointConfig(every_n_splits=1))
    with pytest.raises(DataError, match=r"DataLoader over Unstorable.*reader.*object"):
        engine.Trainer(config).fit(stream_train.Model(), DataLoader(Unstorable(), batch_size=None))


def test_replaying_a_stream_without_state_shows_its_progress():
    output = io.StringIO()
    iterator = iter(range(20000))
    drop_batches(iterator, 12345, show=True, file=output)
    assert "skipping 12,345 batches already seen" in output.getvalue()
    assert next(iterator) == 12345


def test_replaying_past_the_end_of_a_stream_is_refused():
    with pytest.raises(DataError, match="yields only 3 batches"):
        drop_batches(iter(range(3)), 5, show=False)


def torchrun(tmp_path: pathlib.Path, name: str, kind: str, **env: str):
    """The stream script under a real torchrun with 2 ranks (one restart allowed)."""
    run_dir, out_dir = tmp_path / name / "run", tmp_path / name / "out"
    out_dir.mkdir(parents=True)
    command = torchrun_helpers.torchrun_command(2, run_dir, out_dir, max_restarts=1, forked_ranks=True)
    command[command.index(torchrun_helpers.SCRIPT):] = [SCRIPT, kind, str(run_dir), "--out", str(out_dir),
                                                         "--epochs", "1"]
    process = torchrun_helpers.run(command, torchrun_helpers.environment(**env))
    assert process.returncode == 0, process.stderr[-3000:]
    return tmp_path / name, process.stdout


@pytest.mark.slow
@pytest.mark.exhaustive  # CI time: the default run resumes Hugging Face streams from every checkpoint in one process
def test_hf_streams_split_by_node_resume_each_rank_exactly_under_torchrun(tmp_path):
    """Two ranks, each streaming its part (split_dataset_by_node) through a shuffle buffer; one
    rank SIGKILLed mid-epoch, the group restarted: each rank's samples per step (metrics) and
    final parameters equal the uninterrupted run's. (2 DataLoader workers:
    test_sigkills_at_random_instants_resume_a_stream_exactly.)"""
    reference, _ = torchrun(tmp_path, "reference", "hf_shuffled-0")
    killed, log = torchrun(tmp_path, "killed", "hf_shuffled-0", STREAM_KILL="1/split_end:4:sigkill")
    assert log.count("resumed_from=ckpt-") == 2  # both ranks of the restarted group resumed
    torchrun_helpers.assert_same_result(reference, killed, 2)


def test_inspect_json_shows_each_source_position_of_a_mixture(tmp_path, capsys):
    """After a Mixture run, ``inspect --json`` gives each source's position in the last epoch:
    as many items as the steps of that epoch that saw the source's samples (metrics.jsonl)."""
    run_dir = tmp_path / "run"
    train("mixture-stop", run_dir, keep_last=None)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last_epoch = [row for row in rows if row.get("stage") == "train" and row.get("epoch") == 1 and "metrics" in row]
    from_list = sum(row["metrics"]["first"] >= 1000 for row in last_epoch)
    capsys.readouterr()  # what training printed
    assert main(["inspect", str(run_dir), "--json"]) == 0
    sources = json.loads(capsys.readouterr().out)["data"]["sources"]
    assert sources["list"]["drawn"] == from_list
    assert sources["stream"]["drawn"] == len(last_epoch) - from_list
    assert sources["list"]["passes"] == sources["stream"]["passes"] == 1


@pytest.mark.parametrize("arguments, message", [
    (dict(weights=[1.0]), "weights has 1 entries for 2 sources"),
    (dict(weights=[1.0, -1.0]), "non-negative"),
    (dict(weights=[0, 0]), "not all 0"),
    (dict(weights=[1, 1], on_exhausted="wrap"), "on_exhausted must be one of"),
    (dict(weights=[1, 1], seed=1.5), "seed must be an int"),
])
def test_a_mixture_refuses_bad_settings_naming_them(arguments, message):
    with pytest.raises(engine.ConfigError, match=message):
        engine.data.Mixture({"a": [1], "b": [2]}, **arguments)


def test_which_source_a_position_comes_from_depends_only_on_seed_and_position():
    """Two mixtures of the same seed choose alike whatever their sources hold; the shares
    follow the weights; another seed chooses otherwise."""
    def picks(seed, sources):
        mixture = engine.data.Mixture(sources, weights=[3.0, 1.0], seed=seed, on_exhausted="cycle")
        return [item[0] for item, _ in zip(mixture, range(400))]

    first = picks(1, {"a": [("a", i) for i in range(1000)], "b": [("b", i) for i in range(1000)]})
    assert picks(1, {"a": [("a", None)] * 1000, "b": [("b", None)] * 1000}) == first
    assert 250 < first.count("a") < 350
    assert picks(2, {"a": [("a", i) for i in range(1000)], "b": [("b", i) for i in range(1000)]}) != first


@pytest.mark.parametrize("mode, expected", [
    ("max_size_cycle", [{"a": 1, "b": 10}, {"a": 2, "b": 20}, {"a": 3, "b": 10}]),
    ("min_size", [{"a": 1, "b": 10}, {"a": 2, "b": 20}]),
    ("sequential", [{"a": 1}, {"a": 2}, {"a": 3}, {"b": 10}, {"b": 20}]),
])
def test_several_loaders_combine_as_lightning_modes_do(mode, expected):
    combined = combine_loaders({"a": [1, 2, 3], "b": [10, 20]}, mode)
    assert list(combined) == expected
    assert list(combined) == expected  # the next epoch the same


def test_mode_without_a_dict_of_loaders_or_an_unknown_mode_is_refused():
    with pytest.raises(engine.ConfigError, match="applies to a dict of training loaders"):
        engine.Trainer(engine.TrainerConfig(max_epochs=1, progress_bar="off")).fit(
            stream_train.Model(), stream_train.list_batches(2, 0), mode="min_size")
    with pytest.raises(engine.ConfigError, match="mode must be one of"):
        combine_loaders({"a": [1]}, "max_size")


@pytest.mark.parametrize("on_exhausted", ["stop", "cycle", "drop"])
def test_a_mixture_ends_its_epoch_as_on_exhausted_says(on_exhausted):
    """stop: at the first source that runs out; cycle: once each ran out (the short one
    repeats); drop: when all ran out, each item seen once."""
    short, long = [("s", i) for i in range(3)], [("l", i) for i in range(12)]
    items = list(engine.data.Mixture({"s": short, "l": long}, weights=[1, 1], seed=3, on_exhausted=on_exhausted))
    from_short, from_long = [i for i in items if i[0] == "s"], [i for i in items if i[0] == "l"]
    if on_exhausted == "stop":
        assert from_short == short and from_long == long[:len(from_long)] and len(from_long) < len(long)
    elif on_exhausted == "cycle":
        assert from_long == long and len(from_short) > len(short) and from_short[:3] == short
    else:
        assert from_short == short and from_long == long


@pytest.mark.parametrize("kind", ["combined", "mixture"])
def test_closing_the_run_data_stops_the_workers_of_a_source_left_mid_pass(kind):
    # min_size (and a mixture's end) leave the longer source's pass mid-way: its workers kept
    # prefetching until the source was collected, and a process exiting with them waited for them.
    from engine.data.position import EXHAUSTED, EpochData

    stream = DataLoader(stream_train.CountingStream(24), batch_size=stream_train.BATCH, num_workers=2)
    listed = [torch.zeros(1)] * 2
    if kind == "combined":
        data = combine_loaders({"stream": stream, "list": listed}, "min_size")
    else:
        data = engine.data.Mixture({"stream": stream, "list": listed}, weights=[1.0, 1.0], seed=0, on_exhausted="stop")
    before = set(multiprocessing.active_children())
    epoch = EpochData(data)
    iterator = epoch.open_epoch(0)
    while epoch.next_batch(iterator) is not EXHAUSTED:
        epoch.batch_done()
    workers = set(multiprocessing.active_children()) - before
    assert workers, "the stream's workers did not start"
    epoch.close()
    assert not [worker for worker in workers if worker.is_alive()]
