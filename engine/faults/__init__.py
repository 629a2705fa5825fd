"""Fault injection: named points (:mod:`engine.faults.points`), a faulty filesystem, the
fault-tolerance harness and ``chaos``. The public testing API is :mod:`engine.testing`."""

from engine.faults.points import (
    ENVIRONMENT_VARIABLE,
    KINDS,
    POINTS,
    Fault,
    arm_from_environment,
    armed_at,
    arrivals,
    clear,
    fired,
    inject,
    io_error_due,
    parse_faults,
    reach,
)

__all__ = [
    "ENVIRONMENT_VARIABLE", "KINDS", "POINTS", "Fault", "arm_from_environment", "armed_at", "arrivals", "clear",
    "fired", "inject", "io_error_due", "parse_faults", "reach",
]
