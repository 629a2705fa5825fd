"""Transparency: the engine gives bit-identical losses and parameters to a hand-written loop."""

import pytest
import torch

from scenarios import SCENARIOS, run_by_hand, run_engine, scenario_params


@pytest.mark.parametrize("name", scenario_params())
def test_engine_matches_hand_written_loop(name):
    engine_model, engine_losses, _ = run_engine(name)
    hand_model, hand_losses = run_by_hand(name)
    assert len(engine_losses) == len(hand_losses) > 0
    assert engine_losses == hand_losses
    for (key, engine_value), (_, hand_value) in zip(engine_model.state_dict().items(), hand_model.state_dict().items()):
        assert torch.equal(engine_value, hand_value), key
    for engine_opt, hand_opt in zip(engine_model._engine_optimizers, hand_model._engine_optimizers):
        engine_state, hand_state = engine_opt.state_dict(), hand_opt.state_dict()
        assert engine_state["param_groups"] == hand_state["param_groups"]
        for pid, entries in hand_state["state"].items():
            for entry, value in entries.items():
                assert torch.equal(torch.as_tensor(engine_state["state"][pid][entry]), torch.as_tensor(value))


def test_parity_detects_a_difference():
    """The comparison above can fail: a different seed gives different losses."""
    _, losses_a, _ = run_engine("tbptt")
    import scenarios

    original = scenarios.SEED
    try:
        scenarios.SEED = original + 1
        _, losses_b = run_by_hand("tbptt")
    finally:
        scenarios.SEED = original
    assert losses_a != losses_b
