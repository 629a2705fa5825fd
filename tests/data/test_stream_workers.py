"""A stream with state read by several DataLoader workers whose shares differ: a worker whose
pass had ended at the checkpoint stays ended after the resume (torchdata 0.11 reloaded its
state and, for a stream that resets its position at the end of a pass, began the pass again)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from engine.data.position import EXHAUSTED, EpochData

BATCH = 4


class UnevenStream(IterableDataset):
    """Worker w yields SHARES[w] samples (ids 100 * w + i), then resets its position to 0."""

    SHARES = (4, 13)

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self):
        info = get_worker_info()
        worker = 0 if info is None else info.id
        while self.position < self.SHARES[worker]:
            self.position += 1
            yield torch.tensor(100 * worker + self.position - 1)
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def batches_from(data: EpochData, iterator) -> list[list[int]]:
    seen = []
    while (batch := data.next_batch(iterator)) is not EXHAUSTED:
        seen.append(batch.tolist())
        data.batch_done()
    data.close()
    return seen


# Persistent workers by default (the same repair; the other case is slower): both with -m exhaustive.
@pytest.mark.parametrize("persistent_workers", [pytest.param(False, marks=pytest.mark.exhaustive), True])
def test_a_worker_whose_pass_ended_stays_ended_after_a_resume(persistent_workers):
    def epoch_data() -> EpochData:
        return EpochData(DataLoader(UnevenStream(), batch_size=BATCH, num_workers=2,
                                    persistent_workers=persistent_workers))

    uninterrupted = batches_from(data := epoch_data(), data.open_epoch(0))
    assert len(uninterrupted) == 5  # 1 batch of worker 0, 4 of worker 1 (the last one short)
    for consumed in range(1, len(uninterrupted)):
        data = epoch_data()
        iterator = data.open_epoch(0)
        head = []
        for _ in range(consumed):
            head.append(data.next_batch(iterator).tolist())
            data.batch_done()
        state = data.state_dict()
        data.close()
        resumed = epoch_data()
        resumed.load_state_dict(state)
        assert head + batches_from(resumed, resumed.open_epoch(0)) == uninterrupted, f"resumed after {consumed}"
