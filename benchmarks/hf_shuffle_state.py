"""What saving a Hugging Face shuffle buffer costs: state size and state_dict() time by buffer_size.

What is measured: a ``datasets`` stream over local JSONL shards (each example an id and a text
of about 100 characters), ``.shuffle(seed, buffer_size)`` before a ``.map`` (``datasets``
shuffles Arrow tables there) and after one (examples), iterated half-way. Then the stream's
``state_dict()`` is taken ``--repeats`` times (the median time is printed: a ``StatefulDataLoader``
worker takes it after each batch) and encoded with the checkpoint codec (its size is printed).
Nothing is asserted: the figures grow with ``buffer_size``, roughly as the examples' size.

Reproduce (from the repository root, with the ``hf`` extra installed)::

    python benchmarks/hf_shuffle_state.py     # about half a minute on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile
import time
from typing import Any

from engine.checkpoint.format.codec import encode_state
from engine.data.hf_streams import repair_state_loading

EXAMPLES, SHARDS = 40_000, 4


def write_shards(folder: pathlib.Path) -> list[str]:
    paths = []
    for shard in range(SHARDS):
        path = folder / f"shard-{shard}.jsonl"
        lines = (json.dumps({"id": i, "text": f"example {i:08d} " + "x" * 84}) for i in range(shard, EXAMPLES, SHARDS))
        path.write_text("\n".join(lines) + "\n")
        paths.append(str(path))
    return paths


def shuffled_stream(files: list[str], buffer_size: int, place: str) -> Any:
    import datasets

    stream = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
    if place == "before-map":
        stream = stream.shuffle(seed=0, buffer_size=buffer_size)
    stream = stream.map(lambda example: {"length": len(example["text"])})
    if place == "after-map":
        stream = stream.shuffle(seed=0, buffer_size=buffer_size)
    repair_state_loading(stream)
    return stream


def measure(files: list[str], buffer_size: int, place: str, repeats: int) -> tuple[int, float]:
    """(encoded state bytes, median seconds per state_dict()) half-way through the stream."""
    stream = shuffled_stream(files, buffer_size, place)
    iterator = iter(stream)
    for _ in range(EXAMPLES // 2):
        next(iterator)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state = stream.state_dict()
        times.append(time.perf_counter() - start)
    return len(encode_state(state).header), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1_000, 10_000])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    with tempfile.TemporaryDirectory() as folder:
        files = write_shards(pathlib.Path(folder))
        for place in ("before-map", "after-map"):
            for size in args.sizes:
                state_bytes, seconds = measure(files, size, place, args.repeats)
                print(f"shuffle {place:10s} buffer_size {size:>6,}: state {state_bytes:>12,} bytes, "
                      f"state_dict() {seconds * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
