"""Tiny models run fastest, and least disturbed by other processes, on one thread.

Test folders mirror the package layout, except that the tests of ``progress/`` live in
``tests/progress_pkg/``: a folder named ``tests/progress`` would shadow the real ``progress``
package (as a namespace package) for scripts started from ``tests/``."""

import os
import sys

# Hundreds of interpreters the tests start import torch. The README's install leaves byte-compiling
# to the first import (pip --no-compile, uv's default); with PYTHONDONTWRITEBYTECODE set (some
# shells and containers set it) nothing would be cached and each process would compile torch's
# sources again, seconds of CPU each (the suite took 9:28 instead of 5:50). Bytecode is written on
# first import, by this process and every process it starts.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

import torch  # noqa: E402 - after the bytecode setting

torch.set_num_threads(1)

import pytest
from fsspec.implementations.memory import MemoryFileSystem

import writer_switch


@pytest.fixture
def test_writer(request, monkeypatch):
    """The checkpoint writer of the scenarios this test runs, in process or in the processes it
    starts (tests/writer_switch.py): the test's parameter when it has one (parametrize with
    ``indirect=True``), else what SPLITLOOP_TEST_WRITER says (None: the scenario's own)."""
    writer = getattr(request, "param", None)
    if writer is not None:
        monkeypatch.setenv(writer_switch.VARIABLE, writer)
    return writer_switch.requested_writer()


@pytest.fixture(autouse=True)
def empty_memory_filesystem():
    """memory:// is one store per process; start every test with it empty."""
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]
    yield
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need a CUDA device; without one they are skipped, saying so
    (benchmarks/gpu_check.sh runs them on a GPU machine). Tests marked ``cpu_bf16_lstm`` run a
    bfloat16 LSTM on the CPU; where oneDNN has none (no AVX-512) they are skipped, naming what
    the CPU lacks (tests/cpu_features.py)."""
    _skip_marked(items, "gpu", None if torch.cuda.is_available() else
                 "needs a CUDA device (run benchmarks/gpu_check.sh on a GPU machine)")
    if any(item.get_closest_marker("cpu_bf16_lstm") for item in items):
        from cpu_features import bf16_lstm_unavailable

        _skip_marked(items, "cpu_bf16_lstm", bf16_lstm_unavailable())
    _heaviest_files_first(items)


def _heaviest_files_first(items):
    """Hand the torchrun files out first, then the other files with subprocess tests: with
    ``pytest -n 3`` a minute-long test that starts last keeps one core busy while the other
    idles. Files stay whole (a module fixture is set up once per worker)."""
    def weight(item):
        path = item.path.as_posix()
        if "/tests/distributed/" in path:
            return 0
        return 1 if path in slow_files else 2

    slow_files = {item.path.as_posix() for item in items if item.get_closest_marker("slow")}
    items.sort(key=weight)


def _skip_marked(items, marker, reason):
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker(marker) is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_collection_finish(session):
    """Start the fork server (tests/forkserver.py) while the first tests run, if a subprocess
    test is going to need it: it imports torch once for all of them."""
    if any(item.get_closest_marker("slow") for item in session.items):
        import forkserver

        forkserver.start()


STARTED_FILE_VARIABLE = "SPLITLOOP_TESTS_STARTED_FILE"


def pytest_sessionstart(session):
    """Create the file SPLITLOOP_TESTS_STARTED_FILE names, if set: .ci/run starts its static
    checks beside the tests once the test environment is installed, which this marks."""
    path = os.environ.get(STARTED_FILE_VARIABLE)
    if path and not hasattr(session.config, "workerinput"):  # the controller, not each xdist worker
        open(path, "a").close()
