"""Compare the final state of two runs through their checkpoints, bit for bit (through the
public harness), and copy a run up to a checkpoint."""

from __future__ import annotations

import fsspec

from engine.testing import compare_runs


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
