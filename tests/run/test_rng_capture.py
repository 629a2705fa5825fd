"""The Python random state in a checkpoint is always the current one, also when consecutive
checkpoints see the same state (its tensor is then reused, not rebuilt)."""

import random

import torch

from engine.rng import RngSnapshot, capture_global_rng, restore_global_rng


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
