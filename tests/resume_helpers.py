"""Compare the final state of two runs through their checkpoints, bit for bit."""

from __future__ import annotations

from typing import Any

import fsspec
import torch

from engine.checkpoint.store import CheckpointStore
from engine.checkpoint.storage import Storage


def latest_state(run_dir: str) -> tuple[Any, Any]:
    loaded = CheckpointStore(Storage(run_dir)).latest()
    assert loaded is not None, f"no valid checkpoint in {run_dir}"
    return loaded.state, loaded.progress


def assert_equal_trees(a: Any, b: Any, path: str = "state") -> None:
    """Equal structure; tensors torch.equal with equal dtype and shape; plain values ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for key in a:
            assert_equal_trees(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for index, (x, y) in enumerate(zip(a, b)):
            assert_equal_trees(x, y, f"{path}[{index}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def read_metrics(run_dir: str) -> bytes:
    fs, root = fsspec.core.url_to_fs(run_dir)
    return fs.cat_file(root.rstrip("/") + "/metrics.jsonl")


def assert_same_run(reference_dir: str, resumed_dir: str) -> None:
    """Final model, optimizers, schedulers, accumulated-gradient state, RNG, progress and
    metrics.jsonl of two runs are identical."""
    reference_state, reference_progress = latest_state(reference_dir)
    resumed_state, resumed_progress = latest_state(resumed_dir)
    for key in ("module", "optimizers", "schedulers", "loops", "rng", "callbacks", "metrics_bytes"):
        assert_equal_trees(reference_state[key], resumed_state[key], key)
    assert reference_progress.to_dict() == resumed_progress.to_dict()
    assert read_metrics(reference_dir) == read_metrics(resumed_dir)


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
