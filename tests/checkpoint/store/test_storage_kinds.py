"""Storage picks its implementation once, from the run directory's filesystem."""

from __future__ import annotations

import pathlib
import pickle
import uuid

from fsspec.implementations.local import LocalFileSystem

from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.fsspec_storage import FsspecStorage
from engine.checkpoint.store.local_storage import LocalStorage
from engine.faults.faulty_fs import FaultyFileSystem


def test_a_local_path_gets_the_local_storage_and_memory_the_fsspec_one(tmp_path: pathlib.Path) -> None:
    local = Storage(str(tmp_path / "run"))
    memory = Storage(f"memory://kinds-{uuid.uuid4().hex}/run")
    assert isinstance(local, LocalStorage) and local.is_local and local.rename_is_atomic
    assert type(memory) is FsspecStorage and not memory.is_local and not memory.exclusive_create


def test_a_wrapped_local_filesystem_keeps_the_local_storage(tmp_path: pathlib.Path) -> None:
    storage = Storage(str(tmp_path / "run"), filesystem=FaultyFileSystem(LocalFileSystem()))
    assert isinstance(storage, LocalStorage)


def test_a_storage_survives_pickling_with_its_kind_and_root(tmp_path: pathlib.Path) -> None:
    for url in (str(tmp_path / "run"), f"memory://kinds-{uuid.uuid4().hex}/run"):
        storage = Storage(url)
        storage.write("note", [b"kept"], durable=True)
        storage.sync(["note"])  # a local storage now holds a thread pool, which is not pickled
        copy = pickle.loads(pickle.dumps(storage))
        assert type(copy) is type(storage) and copy.root == storage.root
        assert copy.read("note") == b"kept"
