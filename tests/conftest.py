"""Tiny models run fastest, and least disturbed by other processes, on one thread."""

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
