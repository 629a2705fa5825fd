"""CheckpointConfig(every_n_splits="auto", max_overhead=...): the interval follows the whole
measured cost of a checkpoint (blocking plus the slowdown of the splits its background write
overlapped), is bounded, robust to one slow split, reported, and a run checkpointed that way
resumes exactly.

The estimator tests feed literal split times: with ``max_overhead=0.1`` and a baseline split of
10 ms, the budget per split is 1 ms, so the interval is the cost in milliseconds rounded up."""

import threading
import time
import uuid

import pytest
import torch

import engine
import engine.errors
from engine import faults
from engine.checkpoint.budget import AUTO_MAX_INTERVAL, OverheadBudget, young_daly_interval
from engine.checkpoint.format.codec import encode_state
from engine.checkpoint.store.request import CommitRequest
from engine.checkpoint.store.retention import Retention
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.tiers.fast import DurablePromoter
from engine.checkpoint.writers.pending import PendingCheckpoint
from engine.checkpoint.writers.writer import BackgroundWriter
from progress import ProgressTree, encode_tree
from kill_helpers import run_until_done
from paced_writes import PacedWrites
from resume_helpers import assert_same_run
from scenarios import SCENARIOS, build, train_with_checkpoints

SPLIT = 0.010  # the baseline split of the literal scenarios: 10 ms


def splits(budget, free=(), overlapped=()):
    for seconds in free:
        budget.note_split(seconds, overlapped=False)
    for seconds in overlapped:
        budget.note_split(seconds, overlapped=True)


def settled_budget(mtbf_seconds=None):
    """A budget past its start, at max_overhead 0.1: baseline 10 ms, each checkpoint blocking
    1.5 ms and slowing the next split to 12 ms (cost 3.5 ms: an interval of 4), for six
    cycles, so that the windows of five hold only these samples."""
    budget = OverheadBudget(0.1, mtbf_seconds)
    splits(budget, free=[2.0])  # the first split of a run: first-call costs, not a sample
    budget.record(0.0015)
    for _ in range(6):
        splits(budget, free=[SPLIT, SPLIT], overlapped=[0.012])
        budget.record(0.0015)
    return budget


def test_the_start_grows_the_interval_until_baseline_and_cost_are_known():
    budget = OverheadBudget(0.1)
    splits(budget, free=[5.0])  # the first split: 5 s of first-call costs, left out
    assert budget.record(0.0042) == 2  # nothing known: one more split, to time one free of writes
    splits(budget, free=[SPLIT, SPLIT])
    # Baseline 10 ms; the first checkpoint cost 4.2 ms (blocking only, nothing overlapped).
    assert budget.record(0.00235) == 5
    splits(budget, free=[SPLIT] * 5)
    assert budget.record(0.0011) == 4  # costs 4.2 and 2.35 ms: median 3.275 ms
    splits(budget, free=[SPLIT] * 4)
    assert budget.record(0.0011) == 3  # costs 4.2, 2.35 and 1.1 ms: median 2.35 ms


def test_the_extra_time_of_overlapped_splits_is_part_of_the_cost():
    budget = OverheadBudget(0.1)
    splits(budget, free=[1.0])
    budget.record(0.001)
    # The cycle after the first checkpoint: its write in flight slows one split to 16.5 ms.
    splits(budget, free=[SPLIT], overlapped=[0.0165])
    # 1 ms blocked + 6.5 ms extra = 7.5 ms: 8 splits (blocking alone would give 1).
    assert budget.record(0.001) == 8


def test_the_extra_time_is_measured_against_the_baseline_of_free_splits():
    budget = OverheadBudget(0.1)
    splits(budget, free=[1.0])
    budget.record(0.001)
    # Two overlapped splits of 12.5 and 13 ms: 5.5 ms above two baseline splits, + 1 ms blocked.
    splits(budget, free=[SPLIT], overlapped=[0.0125, 0.013])
    assert budget.record(0.001) == 7


def test_without_any_overlap_the_cost_is_the_blocking_time():
    budget = OverheadBudget(0.1)
    splits(budget, free=[1.0])
    budget.record(0.0031)
    for _ in range(3):
        splits(budget, free=[SPLIT] * 4)
        budget.record(0.0031)
    assert budget.interval == 4  # 3.1 ms per checkpoint, 1 ms of budget per split


def test_one_slow_split_does_not_move_the_interval():
    budget = settled_budget()
    assert budget.interval == 4
    splits(budget, free=[SPLIT, SPLIT], overlapped=[1.2])  # 100x: a GC pause during a write
    assert budget.record(0.0015) == 4
    splits(budget, free=[SPLIT, 1.2], overlapped=[0.012])  # 100x on a write-free split
    assert budget.record(0.0015) == 4


def test_overlapped_splits_faster_than_the_baseline_make_it_measured_again():
    budget = OverheadBudget(0.1)
    splits(budget, free=[1.0])
    budget.record(0.0012)
    intervals = []
    # The only write-free split so far was slow (80 ms): the baseline is too high.
    splits(budget, overlapped=[0.0135], free=[0.080])
    intervals.append(budget.record(0.0012))  # 1.2 ms against 8 ms of budget per split
    splits(budget, overlapped=[0.0135])  # faster than the baseline: time a free split again
    intervals.append(budget.record(0.0012))
    for _ in range(3):  # baseline 10 ms: each checkpoint costs 1.2 + 3.5 ms
        splits(budget, overlapped=[0.0135], free=[SPLIT] * (budget.interval - 1))
        intervals.append(budget.record(0.0012))
    # Costs so far 1.2, 1.2, then 4.7 ms: medians 1.2, 2.95 and 4.7 ms.
    assert intervals == [1, 2, 2, 3, 5]


def test_a_lasting_change_of_cost_takes_over_at_the_third_checkpoint():
    budget = settled_budget()
    intervals = []
    for _ in range(3):
        splits(budget, free=[SPLIT, SPLIT], overlapped=[0.022])  # now 1.5 + 12 ms per checkpoint
        intervals.append(budget.record(0.0015))
    assert intervals == [4, 4, 14]


def test_a_lasting_slowdown_of_training_raises_the_baseline_after_five_checkpoints():
    budget = settled_budget()
    intervals = []
    for _ in range(7):  # splits now take 20 ms, 22 ms with a write in flight
        splits(budget, free=[0.020, 0.020], overlapped=[0.022])
        intervals.append(budget.record(0.0015))
    # While the baseline stays at 10 ms (the smallest of its last five samples) a checkpoint
    # seems to cost 1.5 + 12 ms: the cost's median takes that at the third cycle (14 splits of
    # 1 ms). At the fifth the baseline is 20 ms (2 ms of budget per split) and the cost
    # 1.5 + 2 ms, which the median takes two cycles later.
    assert intervals == [4, 4, 14, 14, 7, 7, 2]


def test_a_baseline_without_samples_is_refreshed_by_longer_intervals():
    budget = settled_budget()
    intervals = []
    for _ in range(9):  # every split overlaps a write: no baseline sample
        splits(budget, overlapped=[0.0105] * budget.interval)
        intervals.append(budget.record(0.0015))
    assert intervals == [4] * 7 + [5, 6]
    splits(budget, free=[SPLIT], overlapped=[0.0105] * 5)
    assert budget.record(0.0015) == 4  # a split ran free: back to what the cost asks for


def test_splits_that_all_overlap_from_the_start_grow_the_interval_until_one_is_free():
    budget = OverheadBudget(0.1)
    splits(budget, free=[1.0])
    assert budget.record(0.001) == 2
    splits(budget, overlapped=[0.020, 0.020])
    assert budget.record(0.001) == 3
    splits(budget, overlapped=[0.0203, 0.0203], free=[SPLIT])
    # Baseline 10 ms, known only now: the cost of the checkpoint that opened this cycle (the
    # second) is 1 ms + 2 x 10.3 ms extra = 21.6 ms.
    assert budget.record(0.001) == 22


def test_the_interval_is_bounded():
    expensive = OverheadBudget(0.1)
    splits(expensive, free=[1.0])
    for _ in range(3):
        expensive.record(5.0)  # 5 s per checkpoint against 1 ms of budget per split
        splits(expensive, free=[SPLIT] * expensive.interval)
    assert expensive.record(5.0) == AUTO_MAX_INTERVAL == 64
    cheap = OverheadBudget(0.1)
    splits(cheap, free=[1.0])
    for _ in range(3):
        cheap.record(0.00001)
        splits(cheap, free=[SPLIT] * cheap.interval)
    assert cheap.record(0.00001) == 1


# ---- the background writer tells which splits overlapped a write ------------------------------
@pytest.mark.parametrize("mtbf_seconds, interval", [
    # Young: sqrt(2 x 3.5 ms x 10 s) = 0.2646 s of training, 26 splits of 10 ms: rarer than the budget's 4.
    (10.0, 26),
    # sqrt(2 x 3.5 ms x 50 ms) = 18.7 ms, 2 splits: the budget's 4 (how often checkpoints may cost) wins.
    (0.05, 4),
    # A failure a year: the most a kill may lose wins.
    (3.2e7, AUTO_MAX_INTERVAL),
])
def test_a_failure_rate_makes_the_interval_the_one_of_least_expected_waste(mtbf_seconds, interval):
    assert settled_budget(mtbf_seconds).interval == interval
    assert settled_budget().interval == 4


def test_the_least_waste_interval_is_youngs_to_first_order():
    # waste(T) = cost / T + T / (2 MTBF) is least where its derivative vanishes: sqrt(2 cost MTBF).
    cost, mtbf = 0.2, 3600.0
    best = young_daly_interval(cost, mtbf)
    assert best == pytest.approx((2 * cost * mtbf) ** 0.5, rel=0.01)
    waste = lambda interval: cost / interval + interval / (2 * mtbf)  # noqa: E731
    assert waste(best) < waste(best * 0.9) and waste(best) < waste(best * 1.1)


def test_the_background_writer_reports_when_it_was_writing():
    store = CheckpointStore(Storage(f"memory://budget-{uuid.uuid4().hex}"))
    writer = BackgroundWriter(store, None, Retention(keep_last=None), lambda: [], max_in_flight=1, when_behind="wait")
    entered, leave = threading.Event(), threading.Event()

    def commit(pending):
        entered.set()
        assert leave.wait(30)

    writer.commit_one = commit
    try:
        before = time.monotonic()
        assert not writer.wrote_since(before)  # nothing submitted yet
        writer.submit(PendingCheckpoint(encode_state({"weights": torch.zeros(3)}), b"", None))
        assert writer.wrote_since(before)  # queued or being written
        assert entered.wait(30)
        assert writer.wrote_since(time.monotonic())  # being written
        leave.set()
        writer.flush()
        after = time.monotonic()
        assert writer.wrote_since(before)  # it ended after ``before``
        assert not writer.wrote_since(after)  # a split starting after the end overlapped nothing
    finally:
        leave.set()
        writer.close()


def test_the_durable_tier_promoter_reports_when_it_was_copying(tmp_path):
    fast = CheckpointStore(Storage(str(tmp_path / "fast")))
    durable = CheckpointStore(Storage(f"memory://budget-{uuid.uuid4().hex}"))
    name = fast.write(CommitRequest.of_state(encode_state({"weights": torch.zeros(3)}), encode_tree(ProgressTree()), None, 1))
    entered, leave = threading.Event(), threading.Event()
    original = durable.copy_from

    def copy_from(*args, **kwargs):
        entered.set()
        assert leave.wait(30)
        return original(*args, **kwargs)

    durable.copy_from = copy_from
    promoter = DurablePromoter(fast, durable, Retention(keep_last=None), lambda: [], None, None)
    try:
        before = time.monotonic()
        assert not promoter.copied_since(before)  # nothing requested yet
        promoter.request(name)
        assert promoter.copied_since(before)  # requested or being copied
        assert entered.wait(30)
        assert promoter.copied_since(time.monotonic())  # being copied
        leave.set()
        promoter.close(None)
        after = time.monotonic()
        assert durable.names() == [name]
        assert promoter.copied_since(before)  # it ended after ``before``
        assert not promoter.copied_since(after)
    finally:
        leave.set()
        promoter.close(None)


# ---- end to end ---------------------------------------------------------------------------------
class SyntheticSplitTimes:
    """What the budget is told, made independent of this machine's speed and load: every split
    takes 10 ms, plus ``slowdown`` seconds when the run reports that a background write
    overlapped it, and every checkpoint blocks 1 ms. Each write lasts until the training thread
    has timed one more split (tests/paced_writes.py), so the split after a checkpoint overlaps
    its write however the threads are scheduled, and the training thread then waits for the
    write (or copy) to end, so a slow disk on a loaded machine never makes the following splits
    overlap too (a run where every split overlaps never learns its baseline). The interval then
    depends only on which splits the run reports as overlapped, never on a measured time."""

    def __init__(self, monkeypatch, slowdown):
        self.slowdown = slowdown
        paced = PacedWrites(monkeypatch)
        original_note, original_record = OverheadBudget.note_split, OverheadBudget.record
        times = self

        def note_split(budget, seconds, overlapped):
            paced.split_done()  # after the run asked whether a write overlapped the split
            paced.wait_until_idle()
            return original_note(budget, SPLIT + (times.slowdown if overlapped else 0.0), overlapped)

        monkeypatch.setattr(OverheadBudget, "note_split", note_split)
        monkeypatch.setattr(OverheadBudget, "record", lambda budget, blocked_seconds: original_record(budget, 0.001))


def auto_interval(tmp_path, when_behind, fast_tier, asynchronous=True, durable_every_n_splits=6):
    model, loader = build("tbptt")
    tier = dict(local_tier=str(tmp_path / f"tier-{uuid.uuid4().hex}"),
                durable_every_n_splits=durable_every_n_splits) if fast_tier else {}
    checkpoint = engine.CheckpointConfig(every_n_splits="auto", max_overhead=0.5, writer="thread" if asynchronous else "sync",
                                         when_behind=when_behind, keep_last=2, **tier)
    run_dir = str(tmp_path / f"run-{uuid.uuid4().hex}") if fast_tier else f"memory://budget-{uuid.uuid4().hex}"
    config = engine.TrainerConfig(max_epochs=2, run_dir=run_dir, checkpoint=checkpoint, progress_bar="off",
                                  **SCENARIOS["tbptt"].config_kwargs())
    return engine.Trainer(config).fit(model, loader).checkpoint_interval


@pytest.mark.parametrize("when_behind, fast_tier", [("skip", False), ("wait", False), ("wait", True)])
def test_auto_checkpoints_less_often_when_background_writes_slow_training(monkeypatch, tmp_path, when_behind,
                                                                          fast_tier):
    # With "skip" training never waits for the writer: only the slowdown of the splits that
    # overlapped a write shows the cost. With a fast tier the slow write is the fast tier's.
    times = SyntheticSplitTimes(monkeypatch, slowdown=0.0)
    plain = auto_interval(tmp_path, when_behind, fast_tier)
    times.slowdown = 1.0  # a write slows the split it overlaps by 1 s: 100 baseline splits
    slowed = auto_interval(tmp_path, when_behind, fast_tier)
    # 1 ms per checkpoint is within a 50% budget at every split; 1 s needs the longest interval.
    assert plain < AUTO_MAX_INTERVAL and slowed == AUTO_MAX_INTERVAL


@pytest.mark.parametrize("asynchronous", [False, True])
def test_splits_that_ran_during_a_copy_into_the_durable_tier_are_not_write_free(monkeypatch, tmp_path,
                                                                                 asynchronous):
    # The copy runs in the background even when the fast tier is written synchronously: the
    # splits it overlaps are part of its cost, never a baseline sample.
    original_copy, original_note = CheckpointStore.copy_from, OverheadBudget.note_split
    copying, noted = threading.Event(), []

    def copy_from(self, *args, **kwargs):
        copying.set()
        time.sleep(0.2)
        try:
            return original_copy(self, *args, **kwargs)
        finally:
            copying.clear()

    def note_split(self, seconds, overlapped):
        noted.append((copying.is_set(), overlapped))
        return original_note(self, seconds, overlapped)

    monkeypatch.setattr(CheckpointStore, "copy_from", copy_from)
    monkeypatch.setattr(OverheadBudget, "note_split", note_split)
    auto_interval(tmp_path, "wait", True, asynchronous, durable_every_n_splits=1)
    during_a_copy = [overlapped for copy_running, overlapped in noted if copy_running]
    assert during_a_copy and all(during_a_copy)


@pytest.mark.parametrize("settings, field", [(dict(every_n_splits="sometimes"), "every_n_splits"),
                                             (dict(every_n_splits="auto", max_overhead=0), "max_overhead"),
                                             (dict(every_n_splits="auto", max_overhead=1.5), "max_overhead"),
                                             (dict(every_n_splits="auto", mtbf_seconds=0), "mtbf_seconds"),
                                             (dict(every_n_splits="auto", mtbf_seconds=float("inf")), "mtbf_seconds"),
                                             (dict(every_n_splits=4, mtbf_seconds=3600.0), "mtbf_seconds=3600.0 applies "
                                                                                           "to every_n_splits='auto' only")])
def test_budget_settings_are_validated(settings, field):
    with pytest.raises(engine.ConfigError, match=field):
        engine.CheckpointConfig(**settings)


def test_the_interval_is_reported_in_the_result_and_the_log(tmp_path, capsys):
    result = train_with_checkpoints("tbptt", str(tmp_path / "run"), every="auto", progress_bar="log")
    assert isinstance(result.checkpoint_interval, int) and 1 <= result.checkpoint_interval <= AUTO_MAX_INTERVAL
    assert f"(every {result.checkpoint_interval} splits)" in capsys.readouterr().err
    fixed = train_with_checkpoints("tbptt", str(tmp_path / "fixed"), every=3)
    assert fixed.checkpoint_interval == 3


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_run_checkpointed_by_budget_resumes_exactly(tmp_path, asynchronous):
    reference = str(tmp_path / "reference")
    train_with_checkpoints("tbptt", reference)
    run_dir = str(tmp_path / "run")
    faults.inject([faults.Fault("split_end", 11, "raise")])
    try:
        with pytest.raises(engine.errors.InjectedFault):
            train_with_checkpoints("tbptt", run_dir, every="auto", asynchronous=asynchronous)
    finally:
        faults.clear()
    result = train_with_checkpoints("tbptt", run_dir, every="auto", asynchronous=asynchronous)
    assert result.resumed_from is not None
    assert_same_run(reference, run_dir)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode, kill_point", [([], "split_end_after_checkpoint:4"),
                                              (["--async"], "checkpoint_before_manifest:3")])
def test_sigkill_with_auto_checkpoints_resumes_exactly(tmp_path, mode, kill_point, test_writer):
    """Each process is SIGKILLed, resumed, killed again...: the run ends bit-exact. Synchronous:
    after its fourth split (by then "auto" checkpointed after its first and third). Asynchronous:
    midway through writing its third checkpoint while training goes on; the writer is sequential,
    so the first two committed and every process moves the run forward (a kill at a split
    boundary would not promise that: on a loaded machine a background write can take longer
    than the splits before the kill, and the run would restart from the same point forever).
    With a writer process, a checkpoint_* point kills the writer process, once: the training
    process starts another (not armed) and ends the run."""
    reference = str(tmp_path / "reference")
    train_with_checkpoints("tbptt", reference)
    run_dir = str(tmp_path / "run")
    kills = run_until_done("tbptt", run_dir, f"{kill_point}:sigkill", "--every", "auto", *mode)
    assert kills >= (1 if test_writer == "process" and kill_point.startswith("checkpoint_") else 5)
    assert_same_run(reference, run_dir)
