"""Check a run directory before anything is written to it, so that a wrong path fails with
one message that names the path and what to do, not an ``OSError`` from deep inside the
checkpoint code.

:func:`check_run_dir` is for a run that will write (``Trainer.fit``): the directory is created
when missing. :func:`check_existing_run_dir` is for readers (``python -m engine inspect``).
"""

from __future__ import annotations

import os
import tempfile

import fsspec
from fsspec.implementations.local import LocalFileSystem

from engine.checkpoint.store.storage import open_filesystem
from engine.checkpoint.store.lease import LEASE_FILE
from engine.checkpoint.store.metrics_log import METRICS_FILE
from engine.checkpoint.format.names import CHECKPOINT_DIR, CHECKPOINT_NAME
from engine.checkpoint.tiers.fast import MARKER_FILE, RUN_ID_FILE
from engine.errors import ConfigError

# Entries of a run directory that must be directories / regular files when they exist.
DIRECTORY_ENTRIES = (CHECKPOINT_DIR,)
FILE_ENTRIES = (METRICS_FILE, LEASE_FILE, RUN_ID_FILE)


def check_run_dir(url: str, field: str = "TrainerConfig.run_dir") -> None:
    """Create the run directory ``url`` if it is missing and check that a run can write there.

    Raises:
        ConfigError: ``url`` is a file, a component of it is a file, it cannot be created or
            written to, or its ``checkpoints`` entry is not a directory.
    """
    filesystem, root = _filesystem(url, field)
    if filesystem.isfile(root):
        raise ConfigError(f"{field}: {url!r} is an existing file, not a directory; "
                          "pass the path of a directory (it is created if missing)")
    try:
        filesystem.makedirs(root, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as error:
        raise ConfigError(f"{field}: cannot create {url!r}: a part of the path is a file, not a directory "
                          f"({error}); pass a path whose parents are directories") from error
    except OSError as error:
        raise ConfigError(f"{field}: cannot create {url!r}: {_reason(error)}; "
                          "choose a location you can write to") from error
    if isinstance(filesystem, LocalFileSystem):
        _check_writable(url, root, field)
    _check_entries(url, filesystem, root, field)


def check_local_tier(local_tier: str, run_dir: str, field: str = "CheckpointConfig.local_tier") -> None:
    """Refuse a fast-tier directory that would destroy checkpoints or defeat its purpose: the run
    directory itself or a directory inside it, one holding the run directory in its
    ``checkpoints`` directory, or a directory that holds another run's checkpoints (the fast tier
    deletes checkpoints it did not write). Reads only.

    Raises:
        ConfigError: naming ``local_tier`` and what to do.
    """
    tier = os.path.realpath(os.path.expanduser(local_tier))
    filesystem, root = _filesystem(run_dir, "TrainerConfig.run_dir")
    if isinstance(filesystem, LocalFileSystem):
        run = os.path.realpath(root)
        if tier == run:
            raise ConfigError(f"{field}: {local_tier!r} is the run directory itself; give the fast tier a "
                              "directory of its own (e.g. under /dev/shm)")
        if _is_within(tier, run):
            raise ConfigError(f"{field}: {local_tier!r} lies inside TrainerConfig.run_dir {run_dir!r}: the fast tier "
                              "is node-local storage apart from the run directory (inside it, every checkpoint would "
                              "be written twice to the same filesystem, next to the run's own checkpoints); give the "
                              "fast tier a directory of its own (e.g. /dev/shm/<run name>)")
        if _is_within(run, os.path.join(tier, CHECKPOINT_DIR)):
            raise ConfigError(f"{field}: TrainerConfig.run_dir {run_dir!r} lies inside the {CHECKPOINT_DIR!r} "
                              f"directory of the fast tier {local_tier!r}, where the fast tier deletes checkpoints "
                              "it did not write; give the fast tier a directory of its own (e.g. under /dev/shm)")
    if not os.path.isdir(tier) or os.path.exists(os.path.join(tier, MARKER_FILE)):
        return
    run_files = [name for name in FILE_ENTRIES if os.path.exists(os.path.join(tier, name))]
    checkpoints = os.path.join(tier, CHECKPOINT_DIR)
    if os.path.isdir(checkpoints):
        run_files += [f"{CHECKPOINT_DIR}/{name}" for name in sorted(os.listdir(checkpoints)) if CHECKPOINT_NAME.fullmatch(name)][:3]
    if run_files:
        raise ConfigError(f"{field}: {local_tier!r} looks like another run's directory (it holds {run_files}, and no "
                          f"{MARKER_FILE} of a fast tier); the fast tier would delete those checkpoints. Give the "
                          "fast tier a new or empty directory of its own (e.g. /dev/shm/<run name>)")


def _is_within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def check_existing_run_dir(url: str, field: str = "run directory") -> None:
    """Check that ``url`` is an existing directory (never creates it).

    Raises:
        ConfigError: it does not exist, or it is a file.
    """
    filesystem, root = _filesystem(url, field)
    if filesystem.isfile(root):
        raise ConfigError(f"{field} {url!r} is a file, not a run directory; pass the directory that was given "
                          "as run_dir (the one holding checkpoints/ and metrics.jsonl)")
    if not filesystem.isdir(root):
        raise ConfigError(f"{field} {url!r} does not exist")


def _filesystem(url: str, field: str) -> tuple[fsspec.AbstractFileSystem, str]:
    if not isinstance(url, str) or not url:
        raise ConfigError(f"{field}: expected a non-empty path or URL, got {url!r}")
    try:
        filesystem, root = open_filesystem(url, field)
    except ConfigError:
        raise
    except (ValueError, ImportError) as error:
        raise ConfigError(f"{field}: cannot open {url!r}: {error}") from error
    return filesystem, root.rstrip("/") or "/"


def _check_writable(url: str, root: str, field: str) -> None:
    # An unnamed temporary file (O_TMPFILE where supported) leaves nothing behind even when
    # the process is killed right here; os.access would not see a read-only mount as root.
    try:
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as error:
        raise ConfigError(f"{field}: cannot write to {url!r}: {_reason(error, with_file=False)}; "
                          "choose a directory you can write to") from error


def _check_entries(url: str, filesystem: fsspec.AbstractFileSystem, root: str, field: str) -> None:
    for name in DIRECTORY_ENTRIES:
        path = f"{root}/{name}"
        if filesystem.exists(path) and not filesystem.isdir(path):
            raise ConfigError(f"{field}: {url!r} holds a file named {name!r}, where the run keeps its "
                              f"{name} directory; move that file away or choose another run directory")
    for name in FILE_ENTRIES:
        path = f"{root}/{name}"
        if filesystem.isdir(path):
            raise ConfigError(f"{field}: {url!r} holds a directory named {name!r}, where the run keeps "
                              "a file of that name; move it away or choose another run directory")


def _reason(error: OSError, with_file: bool = True) -> str:
    text = f"{type(error).__name__}: {error.strerror or error}"
    return text + (f": {error.filename!r}" if with_file and error.filename else "")
