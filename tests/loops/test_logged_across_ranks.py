"""Logged values reduced across ranks, without a process group: each "rank" is a MetricLogger
of its own and the payloads they would exchange are handed over in rank order (the collectives
themselves are exercised by tests/distributed/test_validation_ranks.py)."""

from __future__ import annotations

import pytest
import torch

import engine
from engine.errors import ModuleContractError
from engine.loops.logged import Aggregate, MetricLogger, Recording, reduce_recordings

# Sums of these depend on the order they are added in (float rounding).
VALUES = [0.1, 0.2, 0.3, 1e16, 1.0, -1e16, 0.7]


def split_of_each_rank(logged: list[list[tuple[str, float, str]]]) -> list[dict[str, float]]:
    """Every rank logs its (name, value, reduce) with sync=True; each ends the split with every
    rank's payload, in rank order."""
    ranks = [MetricLogger() for _ in logged]
    for logger, values in zip(ranks, logged):
        for name, value, reduce in values:
            logger.log(name, value, reduce, sync=True)
    payloads = [logger.synced_split_payload() for logger in ranks]
    return [logger.end_split(payloads) for logger in ranks]


def test_synced_training_values_combine_every_ranks_values_in_rank_order() -> None:
    first = [("loss", 0.1, "mean"), ("loss", 0.2, "mean"), ("n", 2.0, "sum"), ("top", 3.0, "max"),
             ("low", 3.0, "min"), ("lr", 0.5, "last")]
    second = [("loss", 0.3, "mean"), ("n", 5.0, "sum"), ("top", 4.0, "max"), ("low", -1.0, "min"),
              ("lr", 0.25, "last"), ("only_here", 7.0, "mean")]
    rank0, rank1 = split_of_each_rank([first, second])
    assert rank0 == rank1  # the same bits on every rank
    # Each rank's split aggregate, then the ranks' in rank order.
    assert rank0 == {"loss": ((0.1 + 0.2) + 0.3) / 3, "n": 7.0, "top": 4.0, "low": -1.0, "lr": 0.25, "only_here": 7.0}


def test_without_sync_each_rank_keeps_its_own_value_and_nothing_is_sent() -> None:
    ranks = [MetricLogger(), MetricLogger()]
    for value, logger in zip((1.0, 3.0), ranks):
        logger.log("own", value, "mean")
    payloads = [logger.synced_split_payload() for logger in ranks]
    assert payloads == [b"", b""]
    assert [logger.end_split(payloads) for logger in ranks] == [{"own": 1.0}, {"own": 3.0}]


def test_synced_values_feed_the_epoch_aggregate_alike_on_every_rank() -> None:
    ranks = [MetricLogger(), MetricLogger()]
    for split in range(2):
        for rank, logger in enumerate(ranks):
            logger.log("loss", float(split * 10 + rank), "mean", sync=True)
        payloads = [logger.synced_split_payload() for logger in ranks]
        for logger in ranks:
            logger.end_split(payloads)
    assert [logger.end_epoch() for logger in ranks] == [{"loss": (0.5 + 10.5) / 2}] * 2


def test_one_name_logged_with_and_without_sync_in_a_split_is_refused() -> None:
    logger = MetricLogger()
    logger.log("loss", 1.0, "mean", sync=True)
    with pytest.raises(ModuleContractError, match="sync=True and with sync=False in one split"):
        logger.log("loss", 2.0, "mean")
    with pytest.raises(ModuleContractError, match="sync must be True or False, got 'yes'"):
        logger.log("other", 2.0, "mean", sync="yes")  # type: ignore[arg-type]


def test_one_name_with_another_reduce_on_another_rank_is_refused() -> None:
    with pytest.raises(ModuleContractError, match="reduce='mean' on one rank and reduce='sum' on another"):
        split_of_each_rank([[("n", 1.0, "mean")], [("n", 1.0, "sum")]])


@pytest.mark.parametrize("reduce", ["mean", "sum", "max", "min", "last"])
def test_validation_recordings_replayed_in_rank_order_equal_one_process(reduce: str) -> None:
    alone = Aggregate()
    for value in VALUES:
        alone.add("v", value, reduce)
    blocks = [VALUES[:3], VALUES[3:5], VALUES[5:]]  # contiguous blocks, one per rank
    recordings = []
    for block in blocks:
        logger = MetricLogger()
        logger.begin_evaluation()
        for value in block:
            logger.log("v", value, reduce)
        recordings.append(Recording.decode(logger.end_evaluation().encode()))  # as sent between ranks
    assert reduce_recordings(recordings) == alone.values()


def test_the_replay_is_not_a_sum_of_partial_sums() -> None:
    # Why every value is sent: adding each rank's partial sum rounds differently.
    blocks = [VALUES[:3], VALUES[3:5], VALUES[5:]]
    partial = 0.0
    for block in blocks:
        block_sum = block[0]
        for value in block[1:]:
            block_sum += value
        partial += block_sum
    sequential = VALUES[0]
    for value in VALUES[1:]:
        sequential += value
    assert partial != sequential


def test_in_a_single_process_sync_changes_nothing() -> None:
    class Logs(engine.Module):
        def __init__(self, sync: bool) -> None:
            super().__init__()
            self.layer, self.sync = torch.nn.Linear(2, 1), sync

        def training_step(self, batch):
            loss = self.layer(batch).pow(2).mean()
            self.log("loss_logged", loss, sync=self.sync)
            self.log("rows", batch.shape[0], reduce="sum", sync=self.sync)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    results = []
    for sync in (True, False):
        torch.manual_seed(0)
        model = Logs(sync)
        config = engine.TrainerConfig(max_epochs=2, progress_bar="off", checkpoint=None)
        results.append(engine.Trainer(config).fit(model, [torch.ones(3, 2), torch.zeros(2, 2)]).metrics)
    assert results[0] == results[1] and results[0]["rows"] == 5.0
