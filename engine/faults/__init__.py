"""Fault injection: named points (:mod:`engine.faults.points`), a faulty filesystem and
``chaos``. The harness that proves a run resumes exactly is :mod:`engine.testing`."""

from engine.faults.points import (
    ENVIRONMENT_VARIABLE,
    HANG_KINDS,
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
    "ENVIRONMENT_VARIABLE", "HANG_KINDS", "KINDS", "POINTS", "Fault", "arm_from_environment", "armed_at", "arrivals", "clear",
    "fired", "inject", "io_error_due", "parse_faults", "reach",
]
