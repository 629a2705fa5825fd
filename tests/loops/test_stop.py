"""Stop conditions are pure functions of (progress counts, limits)."""

import pytest

from engine.loops.stop import epochs_done, split_boundary_stop_reason


@pytest.mark.parametrize("completed, limit, expected", [
    (0, 1, False), (1, 1, True), (2, 1, True), (4, 5, False), (5, 5, True), (100, None, False),
])
def test_epochs_done(completed, limit, expected):
    assert epochs_done(completed, limit) is expected


def test_no_limit_never_stops():
    assert split_boundary_stop_reason(10**9, None, 1e9, None) is None


@pytest.mark.parametrize("steps, expected", [(4, None), (5, "max_steps=5 reached"), (6, "max_steps=5 reached")])
def test_max_steps(steps, expected):
    assert split_boundary_stop_reason(steps, 5, 0.0, None) == expected


@pytest.mark.parametrize("elapsed, expected", [(9.99, None), (10.0, "max_time=10.0s reached"), (11.0, "max_time=10.0s reached")])
def test_max_time(elapsed, expected):
    assert split_boundary_stop_reason(0, None, elapsed, 10.0) == expected


def test_max_steps_is_named_before_max_time_when_both_hold():
    assert split_boundary_stop_reason(5, 5, 20.0, 10.0) == "max_steps=5 reached"
