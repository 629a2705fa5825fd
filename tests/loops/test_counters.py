"""Progress counters after small runs, as literal expectations.

Every scenario: 2 epochs x 3 batches (12 samples, batch 4); TBPTT cuts a batch into 4 splits.
"""

import pytest

import engine
from progress import Cursor
from scenarios import run_engine


def totals(result):
    return {name: record.total.completed for name, record in result.progress.records.items()}


@pytest.mark.parametrize(
    "name, expected",
    [
        ("tbptt", {"fit.epochs": 2, "epoch.batches": 6, "split.splits": 24, "flow.optimizer_steps": 24}),
        ("plain", {"fit.epochs": 2, "epoch.batches": 6, "flow.optimizer_steps": 6}),
        # 12 splits per epoch, a step every 5 splits, the open window (2 splits) stepped at epoch end
        ("accumulate_splits", {"fit.epochs": 2, "epoch.batches": 6, "split.splits": 24, "flow.optimizer_steps": 6}),
        # 3 batches per epoch, a step every 2 batches, the last batch stepped at epoch end
        ("accumulate_batches", {"fit.epochs": 2, "epoch.batches": 6, "split.splits": 24, "flow.optimizer_steps": 4}),
        # two optimizers step once per batch each
        ("several_optimizers", {"fit.epochs": 2, "epoch.batches": 6, "optimizer.optimizers": 12, "flow.optimizer_steps": 12}),
        ("tbptt_several_optimizers", {"fit.epochs": 2, "epoch.batches": 6, "split.splits": 24,
                                      "optimizer.optimizers": 48, "flow.optimizer_steps": 48}),
        # manual optimization: the step calls optimizer.step() itself; the engine still counts
        ("manual", {"fit.epochs": 2, "epoch.batches": 6, "split.splits": 24, "flow.optimizer_steps": 24}),
    ],
)
def test_counts_after_a_full_run(name, expected):
    result = run_engine(name)[2]
    assert totals(result) == expected
    assert result.epochs_completed == 2
    last_optimizer = 1 if "optimizer.optimizers" in expected else 0  # the cursor names the split's last optimizer
    assert result.cursor == Cursor(1, 2, 3 if "splits" in " ".join(expected) else 0, last_optimizer)
    for record in result.progress.records.values():
        # nothing in flight at the end; current counts of inner loops were reset by their parent
        assert record.total.started == record.total.completed
    assert result.progress.records["epoch.batches"].current.completed == 0


def test_max_steps_stops_inside_a_batch():
    _, losses, result = run_engine("tbptt", epochs=5, max_steps=7)
    assert result.optimizer_steps == 7
    assert len(losses) == 7
    assert result.cursor == Cursor(0, 1, 2, 0)  # 7th split: batch 1, split 2 of epoch 0
    assert result.epochs_completed == 0
    assert "max_steps" in result.stop_reason
    records = result.progress.records
    assert records["split.splits"].total.completed == 7
    assert records["split.splits"].current.completed == 3
    assert records["epoch.batches"].total.started == 2 and records["epoch.batches"].total.completed == 1


def test_max_steps_counts_all_optimizers():
    result = run_engine("tbptt_several_optimizers", epochs=5, max_steps=5)[2]
    # checked at split boundaries: 2 steps per split, so the 3rd split reaches 6 >= 5
    assert result.optimizer_steps == 6
    assert result.cursor == Cursor(0, 0, 2, 1)


class StopAfter(engine.Callback):
    def __init__(self, splits):
        self.splits = splits
        self.seen = 0

    def on_split_end(self, view):
        self.seen += 1
        if self.seen == self.splits:
            view.request_stop("enough")


def test_a_callback_can_stop_the_run():
    from scenarios import build

    model, loader = build("tbptt")
    stopper = StopAfter(10)
    config = engine.TrainerConfig(max_epochs=3, run_dir=None, checkpoint=None, progress_bar="off")
    result = engine.Trainer(config, callbacks=[stopper]).fit(model, loader)
    assert result.stop_reason == "enough"
    assert result.cursor == Cursor(0, 2, 1, 0)
    assert result.optimizer_steps == 10
