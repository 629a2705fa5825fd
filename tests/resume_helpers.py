"""Compare the final state of two runs through their checkpoints, bit for bit (through the
public harness), copy a run up to a checkpoint, and resume such copies and compare them with the
run they were copied from."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import fsspec

from engine.testing import compare_runs

if TYPE_CHECKING:
    from engine import FitResult


def memory_url(prefix: str) -> str:
    """A run directory of its own on the in-memory filesystem (``memory://PREFIX-HEX``)."""
    return f"memory://{prefix}-{uuid.uuid4().hex}"


def read_metrics(run_dir: str) -> bytes:
    fs, root = fsspec.core.url_to_fs(run_dir)
    return fs.cat_file(root.rstrip("/") + "/metrics.jsonl")


def assert_same_run(reference_dir: str, resumed_dir: str) -> None:
    """Final model, optimizers, schedulers, loop states, RNG, callbacks, progress and
    metrics.jsonl of two runs are identical (the public harness's comparison)."""
    differences = compare_runs(reference_dir, resumed_dir)
    assert not differences, differences


def copy_run_until(source, target, keep_name):
    """A copy of ``source`` whose newest checkpoint is ``keep_name``; later ones removed and
    metrics.jsonl left as it was at the end (longer than the checkpoint recorded)."""
    source_fs, source_root = fsspec.core.url_to_fs(source)
    target_fs, target_root = fsspec.core.url_to_fs(target)
    for path in source_fs.find(source_root):
        relative = path[len(source_root.rstrip("/")) + 1:]
        if relative.startswith("checkpoints/ckpt-") and relative.split("/")[1] > keep_name:
            continue
        target_fs.makedirs(target_fs._parent(f"{target_root}/{relative}"), exist_ok=True)
        target_fs.pipe_file(f"{target_root}/{relative}", source_fs.cat_file(path))


def assert_resumes_are_exact(reference: str, names: Iterable[str], train: Callable[[str], FitResult],
                             run_dir_for: Callable[[str], str] | None = None, source: str | None = None) -> None:
    """For each checkpoint of ``names``, in order: copy ``source`` (by default ``reference``) up
    to it into ``run_dir_for(name)`` (by default a fresh ``memory://`` directory), train that
    copy with ``train(run_dir)``, and check that the run resumed from that checkpoint and ended
    identical to ``reference`` (:func:`assert_same_run`)."""
    for name in names:
        resumed = run_dir_for(name) if run_dir_for is not None else memory_url("resumed")
        copy_run_until(source if source is not None else reference, resumed, name)
        result = train(resumed)
        assert result.resumed_from == name, (name, result.resumed_from)
        assert_same_run(reference, resumed)
