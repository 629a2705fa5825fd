"""Public testing API: prove that your own training resumes bit-exactly under faults.

Arm named faults (:class:`Fault`, :func:`inject`, or the ``SPLITLOOP_FAULTS`` environment
variable), make the run directory's filesystem fail (:class:`FaultyFileSystem`), and let the
harness train, fault, resume and compare (:func:`check_fault_tolerance`, :func:`compare_runs`)::

    from engine.testing import Fault, check_fault_tolerance
    report = check_fault_tolerance(make_run, [Fault("split_end", 3, "raise")], work_dir="/tmp/ft")
    assert report.all_exact, report.table()

See docs/fault-injection.md.
"""

from engine.faults.faulty_fs import FaultyFileSystem
from engine.testing.harness import FaultReport, check_fault_tolerance, compare_runs
from engine.faults.points import (
    ENVIRONMENT_VARIABLE,
    KINDS,
    POINTS,
    Fault,
    arrivals,
    clear,
    fired,
    inject,
    parse_faults,
)

__all__ = [
    "ENVIRONMENT_VARIABLE",
    "KINDS",
    "POINTS",
    "Fault",
    "FaultReport",
    "FaultyFileSystem",
    "arrivals",
    "check_fault_tolerance",
    "clear",
    "compare_runs",
    "fired",
    "inject",
    "parse_faults",
]
