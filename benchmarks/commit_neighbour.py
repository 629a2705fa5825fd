"""The other process of ``commit_contention.py``: a Python busy loop (``spin``) or the file system
work of a checkpoint commit in a loop (``commit``), until SIGTERM; prints ``ready`` when started
and what it counted when stopped. Standard library only, so that it starts in milliseconds and
holds none of torch's memory or threads.

Usage: ``python benchmarks/commit_neighbour.py {spin,commit} DIR TENSOR_BYTES``
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal

SMALL_FILES = (("state.msgpack", 3800), ("progress.msgpack", 600), ("MANIFEST.json", 330))
LOG_LINE = b'{"stage": "train", "loss": 4.1588}\n'


# ---- the other process ---------------------------------------------------------------------------
class Stop:
    """Set by SIGTERM: the loop ends after its current iteration."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._request)

    def _request(self, *_: object) -> None:
        self.requested = True


def spin(stop: Stop) -> int:
    iterations = 0
    while not stop.requested:
        iterations += 1
    return iterations


def write_file(path: str, data: bytes) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(descriptor, data)
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_path(path: str, flags: int = os.O_RDONLY) -> None:
    descriptor = os.open(path, flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def commit_loop(stop: Stop, root: str, tensor_bytes: int) -> int:
    """Durable commits of a checkpoint of ``tensor_bytes`` into ``root`` until stopped; the count."""
    tensors = os.urandom(tensor_bytes)
    small = [(name, os.urandom(size)) for name, size in SMALL_FILES]
    checkpoints, log = os.path.join(root, "checkpoints"), os.path.join(root, "metrics.jsonl")
    os.makedirs(checkpoints)
    committed: list[str] = []
    while not stop.requested:
        sequence = len(committed) + 1
        staging = os.path.join(checkpoints, f"tmp-{sequence:010d}")
        os.mkdir(staging)
        write_file(os.path.join(staging, "tensors.bin"), tensors)
        for name, data in small:
            write_file(os.path.join(staging, name), data)
        fsync_path(staging)
        with open(log, "ab") as handle:
            handle.write(LOG_LINE)
            handle.flush()
            os.fsync(handle.fileno())
        final = os.path.join(checkpoints, f"ckpt-{sequence:010d}")
        os.rename(staging, final)
        fsync_path(checkpoints)
        committed.append(final)
        if len(committed) > 2:  # keep_last=2
            shutil.rmtree(committed[-3])
    return len(committed)


def main() -> None:
    parser = argparse.ArgumentParser(prog="commit_neighbour.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["spin", "commit"])
    parser.add_argument("root", help="an empty directory for the commits")
    parser.add_argument("tensor_bytes", type=int, help="the size of each checkpoint's tensor file")
    arguments = parser.parse_args()
    kind, root, tensor_bytes = arguments.kind, arguments.root, arguments.tensor_bytes
    stop = Stop()
    print("ready", flush=True)
    count = spin(stop) if kind == "spin" else commit_loop(stop, root, tensor_bytes)
    print(count, flush=True)


if __name__ == "__main__":
    main()
