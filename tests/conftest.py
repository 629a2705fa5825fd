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
