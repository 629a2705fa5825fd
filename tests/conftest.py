"""Tiny models run fastest, and least disturbed by other processes, on one thread.

Test folders mirror the package layout, except that the tests of ``progress/`` live in
``tests/progress_pkg/``: a folder named ``tests/progress`` would shadow the real ``progress``
package (as a namespace package) for scripts started from ``tests/``."""

import torch

torch.set_num_threads(1)

import pytest
from fsspec.implementations.memory import MemoryFileSystem


@pytest.fixture(autouse=True)
def empty_memory_filesystem():
    """memory:// is one store per process; start every test with it empty."""
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]
    yield
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]


def pytest_collection_finish(session):
    """Start the fork server (tests/forkserver.py) while the first tests run, if a subprocess
    test is going to need it: it imports torch once for all of them."""
    if any(item.get_closest_marker("slow") for item in session.items):
        import forkserver

        forkserver.start()
