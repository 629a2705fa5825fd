"""The loop classes on their own, with a fake flow: call order, counters, stops, and resuming
from counters alone (no restart branches)."""

from __future__ import annotations

import pytest
import torch

from engine.data.position import EpochData
from engine.loops.context import Position, StopState
from engine.loops.epoch import EpochLoop
from engine.loops.fit import FitLoop
from engine.loops.optimizer import OptimizerLoop, SingleOptimizer
from engine.loops.split import SplitLoop, WholeBatch


class FakeFlow:
    """Records every call; the loss is the split's value, the hidden state counts splits."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def run(self, batch, hidden, optimizer_index, last_split):
        self.calls.append(("run", float(batch), hidden, optimizer_index, last_split))
        return torch.tensor(float(batch)), torch.tensor(0.0 if hidden is None else float(hidden) + 1)

    def end_epoch(self):
        self.calls.append(("end_epoch",))

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def split_in_two(batch, length):
    return [batch * 10, batch * 10 + 1]


def build(batches, epochs=2, stop_after=None, several=False):
    flow = FakeFlow()
    position, stop = Position(), StopState()
    boundaries: list[tuple] = []
    runner = OptimizerLoop(flow, 2) if several else SingleOptimizer(flow)

    def at_split(index, losses):
        boundaries.append((position.epoch, position.batch, index, [float(x) for x in losses]))
        if stop_after is not None and len(boundaries) == stop_after:
            stop.request("test")

    split_loop = SplitLoop(split_in_two, 1, False, runner, position, stop, at_split)
    data = EpochData(batches)
    epoch_loop = EpochLoop(data, split_loop, position, stop, batch_boundary=None)
    epochs_seen: list[int] = []
    fit_loop = FitLoop(epoch_loop, epochs, position, stop, epochs_seen.append)
    return fit_loop, split_loop, flow, boundaries, epochs_seen


def test_the_tree_visits_every_split_in_order_and_ends_each_epoch_once():
    fit_loop, _, flow, boundaries, epochs_seen = build([1, 2], epochs=2)
    fit_loop.run()
    assert [b[:3] for b in boundaries] == [(e, b, s) for e in range(2) for b in range(2) for s in range(2)]
    assert [b[3] for b in boundaries[:4]] == [[10.0], [11.0], [20.0], [21.0]]
    assert epochs_seen == [0, 1]
    assert [c for c in flow.calls if c[0] == "end_epoch"] == [("end_epoch",)] * 2
    runs = [c for c in flow.calls if c[0] == "run"]
    assert [c[4] for c in runs[:2]] == [False, True]  # last_split flags
    assert fit_loop.progress.total.completed == 2


def test_hidden_state_is_carried_between_splits_and_reset_between_batches():
    fit_loop, _, flow, _, _ = build([1, 2], epochs=1)
    fit_loop.run()
    hiddens = [c[2] for c in flow.calls if c[0] == "run"]
    assert hiddens[0] is None and float(hiddens[1]) == 0.0  # second split gets the first's state
    assert hiddens[2] is None  # a new batch starts without hidden state


def test_several_optimizers_run_per_split_and_report_one_loss_each():
    fit_loop, _, flow, boundaries, _ = build([1], epochs=1, several=True)
    fit_loop.run()
    assert [c[3] for c in flow.calls if c[0] == "run"] == [0, 1, 0, 1]
    assert boundaries[0][3] == [10.0, 10.0]


def test_a_stop_request_ends_the_run_at_the_boundary_without_ending_the_epoch():
    fit_loop, split_loop, flow, boundaries, epochs_seen = build([1, 2], epochs=2, stop_after=3)
    fit_loop.run()
    assert len(boundaries) == 3
    assert epochs_seen == [] and ("end_epoch",) not in flow.calls
    assert split_loop.progress.current.completed == 1  # the second batch is half done


@pytest.mark.filterwarnings("ignore:resuming list")
def test_a_restored_tree_carries_on_from_its_counters():
    reference, _, _, all_boundaries, _ = build([1, 2], epochs=2)
    reference.run()
    # Stop after 3 splits, then hand the counters and the data position to a fresh tree.
    first, split_loop, _, boundaries, _ = build([1, 2], epochs=2, stop_after=3)
    first.run()
    second, second_split, _, later, _ = build([1, 2], epochs=2)
    for mine, theirs in [(second, first), (second.epoch_loop, first.epoch_loop), (second_split, split_loop)]:
        mine.progress.total, mine.progress.current = theirs.progress.total, theirs.progress.current
    second_split.hidden = split_loop.hidden
    second.epoch_loop.data.load_state_dict(first.epoch_loop.data.state_dict())
    second.run()
    assert boundaries + later == all_boundaries


def test_without_tbptt_a_batch_is_one_unit_and_its_losses_reach_the_boundary():
    flow = FakeFlow()
    position, stop = Position(), StopState()
    seen: list[tuple] = []
    epoch_loop = EpochLoop(EpochData([3, 4]), WholeBatch(SingleOptimizer(flow)), position, stop,
                           batch_boundary=lambda index, losses: seen.append((position.batch, [float(x) for x in losses])))
    FitLoop(epoch_loop, 1, position, stop, lambda epoch: None).run()
    assert seen == [(0, [3.0]), (1, [4.0])]
    assert [c[4] for c in flow.calls if c[0] == "run"] == [True, True]
