"""Checkpoint write throughput against a raw durable write, and the cost of resuming.

What is measured, every figure a ratio of two things timed side by side in one process,
interleaved (the order inside each pair alternates), over several repeats, medians reported:

1. Write: one checkpoint of a realistic state tree (a model ``state_dict`` of float32 tensors of
   mixed sizes plus the state of an Adam optimizer after one step), of about 100 MB and about
   1 MB, through the engine's own machinery: ``engine.checkpoint.format.codec.encode_state`` then
   ``CheckpointStore(Storage(dir)).write(...)`` (which writes four files, fsyncs each, fsyncs
   the staging directory, renames it and fsyncs ``checkpoints/``), against a raw sequential
   write of the same number of bytes (the same tensor bytes) to one file, fsynced, with its
   directory fsynced. ``os.sync()`` runs (untimed) before each timed write so that neither
   side pays for the other's dirty pages. Throughput ratio = raw time / checkpoint time
   (1.0 is as fast as the disk allows; the goal is >= 0.8).
2. Load: ``CheckpointStore.load`` of the 100 MB checkpoint (read, CRC-32C verify, decode)
   against a raw read of the same files (page cache warm on both sides).
3. Resume: a subprocess that builds a model (the demo of ``engine.demo``, then the small and
   the 25M LSTM language models of benchmarks/checkpoint_overhead.py) and resumes it from a run
   directory, timed from just before the process is spawned to its first resumed split,
   against a subprocess that starts the demo fresh (no run directory) to its first split plus
   a raw read of the checkpoint's files.

The temporary directory is created under the current directory (or ``--dir``), on a real
filesystem, never /dev/shm, and removed at the end.

Reproduce (from the repository root, in the environment of the README)::

    python benchmarks/checkpoint_io.py              # 1.5-2.5 minutes on 2 shared cores
    python benchmarks/checkpoint_io.py --quick      # fewer repeats, 30-50 s
    python benchmarks/checkpoint_io.py --smoke      # every step once at 1 MB, the demo's resume only:
                                                    # proves the script runs (CI); figures mean nothing

The last line is ``write throughput ratio: X.XX (checkpoint / raw write, 100 MB state)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch

import engine
import progress
from engine.checkpoint.format.checksum import checksum
from engine.checkpoint.format.codec import encode_state
from engine.checkpoint.store.request import CommitRequest
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.storage import Storage

SIZES_MB = (100, 1)
SMOKE_SIZES_MB = (1,)
THREADS = 1
SEED = 1234
RAW_FILE = "raw.bin"
RESUME_MODELS = ("demo", "small", "25M")
SMOKE_RESUME_MODELS = ("demo",)

StateTree = dict[str, Any]


# ---- the state tree -----------------------------------------------------------------------
def build_model(megabytes: int) -> torch.nn.Module:
    """A transformer-shaped stack (embedding, attention and MLP projections, layer norms, head)
    whose parameters plus two Adam moments come to about ``megabytes``."""
    width = 512 if megabytes >= 10 else 64
    vocabulary = 4 * width
    parameters = megabytes * 2**20 // (3 * 4)
    blocks = max(1, round((parameters - 2 * vocabulary * width) / (12 * width * width)))
    layers: list[torch.nn.Module] = [torch.nn.Embedding(vocabulary, width)]
    for _ in range(blocks):
        layers += [torch.nn.LayerNorm(width), torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width),
                   torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)]
    layers.append(torch.nn.Linear(width, vocabulary))
    return torch.nn.Sequential(*layers)


def build_state_tree(megabytes: int) -> StateTree:
    """What the engine saves for such a model: module, optimizer (after one Adam step), RNG and
    a few plain values."""
    torch.manual_seed(SEED)
    model = build_model(megabytes)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    optimizer.step()
    return {
        "module": model.state_dict(),
        "optimizers": [optimizer.state_dict()],
        "schedulers": [],
        "rng": {"torch_cpu": torch.get_rng_state()},
        "metrics_bytes": 0,
        "elapsed_seconds": 0.0,
    }


# ---- the two ways of writing ----------------------------------------------------------------
@dataclasses.dataclass
class WriteCase:
    """One state size: the state, a store to write it to, and the raw side's bytes."""

    megabytes: int
    state: StateTree
    progress_bytes: bytes
    store: CheckpointStore
    kept_checkpoint: str
    raw_directory: str
    raw_chunks: list[Any]
    total_bytes: int


def checkpoint_files(store: CheckpointStore, name: str) -> list[str]:
    directory = os.path.join(store.storage.root, "checkpoints", name)
    return [os.path.join(directory, file_name) for file_name in sorted(os.listdir(directory))]


def prepare_case(megabytes: int, work: str) -> WriteCase:
    """Build the state; write one checkpoint untimed (warm-up, kept for the load test); give the
    raw side the same bytes: the tensors, the headers, and padding up to the checkpoint's size."""
    state = build_state_tree(megabytes)
    progress_bytes = progress.encode_tree(progress.ProgressTree())
    store = CheckpointStore(Storage(os.path.join(work, f"run-{megabytes}mb")))
    encoded = encode_state(state)
    kept = store.write(CommitRequest.of_state(encoded, progress_bytes, cursor=None, generation=0))
    total = sum(os.path.getsize(path) for path in checkpoint_files(store, kept))
    chunks = [*encoded.tensor_chunks(), encoded.header, progress_bytes]
    chunks.append(bytes(total - sum(chunk_size(chunk) for chunk in chunks)))  # the manifest's share
    raw_directory = os.path.join(work, f"raw-{megabytes}mb")
    os.makedirs(raw_directory)
    return WriteCase(megabytes, state, progress_bytes, store, kept, raw_directory, chunks, total)


def chunk_size(chunk: Any) -> int:
    return chunk.nbytes if isinstance(chunk, memoryview) else len(chunk)


def time_checkpoint_write(case: WriteCase) -> float:
    """Encode and commit one checkpoint, as ``FitRun._save`` does; the checkpoint is then deleted."""
    os.sync()
    started = time.perf_counter()
    encoded = encode_state(case.state)
    name = case.store.write(CommitRequest.of_state(encoded, case.progress_bytes, cursor=None, generation=0))
    seconds = time.perf_counter() - started
    case.store.storage.remove_tree(f"checkpoints/{name}")
    return seconds


def fsync_directory(directory: str) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def time_raw_write(case: WriteCase) -> float:
    """Write the same bytes sequentially to one new file; fsync it and its directory."""
    path = os.path.join(case.raw_directory, RAW_FILE)
    os.sync()
    started = time.perf_counter()
    with open(path, "wb") as handle:
        for chunk in case.raw_chunks:
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    fsync_directory(case.raw_directory)
    seconds = time.perf_counter() - started
    os.remove(path)
    return seconds


# ---- measuring side by side -----------------------------------------------------------------
def interleaved(first: Callable[[], float], second: Callable[[], float], repeats: int) -> list[tuple[float, float]]:
    """``repeats`` pairs (first, second) timed back to back; odd pairs run second first."""
    pairs = []
    for index in range(repeats):
        if index % 2 == 0:
            a = first()
            b = second()
        else:
            b = second()
            a = first()
        pairs.append((a, b))
    return pairs


def medians(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """The median of each side."""
    return statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)


def median_ratio(pairs: list[tuple[float, float]], numerator: int) -> float:
    """The median of the per-pair ratios side ``numerator`` / the other side. Per-pair ratios
    cancel the drift of a shared machine better than a ratio of medians."""
    return statistics.median(pair[numerator] / pair[1 - numerator] for pair in pairs)


def report_write(case: WriteCase, repeats: int) -> tuple[float, float]:
    """Print the write comparison of one size; returns the throughput ratio raw / checkpoint
    and the extra seconds of the checkpoint (difference of the medians)."""
    pairs = interleaved(lambda: time_checkpoint_write(case), lambda: time_raw_write(case), repeats)
    for index, (checkpoint_seconds, raw_seconds) in enumerate(pairs):
        print(f"  pair {index + 1}: checkpoint {checkpoint_seconds * 1e3:.1f} ms, raw {raw_seconds * 1e3:.1f} ms")
    checkpoint_median, raw_median = medians(pairs)
    ratio = median_ratio(pairs, numerator=1)  # raw time / checkpoint time: throughput ratio
    megabytes = case.total_bytes / 1e6
    print(f"{megabytes:.1f} MB: median checkpoint {checkpoint_median * 1e3:.1f} ms "
          f"({megabytes / checkpoint_median:.0f} MB/s), median raw {raw_median * 1e3:.1f} ms "
          f"({megabytes / raw_median:.0f} MB/s), throughput ratio raw/checkpoint {ratio:.2f}")
    return ratio, checkpoint_median - raw_median


def report_breakdown(case: WriteCase, repeats: int, extra_seconds: float) -> None:
    """Where the checkpoint's extra time goes: encoding, the CRC-32C computed while writing, and
    the rest (three more files, four more fsyncs, mkdir, rename, listing)."""
    encode_seconds = statistics.median(time_call(lambda: encode_state(case.state)) for _ in range(repeats))
    chunks = case.raw_chunks[:-1]
    crc_seconds = statistics.median(time_call(lambda: checksum(chunks)) for _ in range(repeats))
    print(f"  checkpoint - raw = {extra_seconds * 1e3:.1f} ms: encode_state {encode_seconds * 1e3:.1f} ms, "
          f"CRC-32C of the data {crc_seconds * 1e3:.1f} ms ({case.total_bytes / 1e6 / crc_seconds:.0f} MB/s), "
          f"rest {(extra_seconds - encode_seconds - crc_seconds) * 1e3:.1f} ms "
          "(4 files and 6 fsyncs against 1 file and 2 fsyncs, mkdir, rename)")


def time_call(function: Callable[[], object]) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started




# ---- loading ----------------------------------------------------------------------------------
def read_files(paths: list[str]) -> int:
    total = 0
    for path in paths:
        with open(path, "rb") as handle:
            total += len(handle.read())
    return total


def report_load(case: WriteCase, repeats: int) -> None:
    """``CheckpointStore.load`` (read, verify, decode) against a raw read of the same files."""
    paths = checkpoint_files(case.store, case.kept_checkpoint)
    read_files(paths)  # warm the page cache for both sides
    pairs = interleaved(lambda: time_call(lambda: case.store.load(case.kept_checkpoint)),
                        lambda: time_call(lambda: read_files(paths)), repeats)
    load_median, read_median = medians(pairs)
    print(f"load {case.total_bytes / 1e6:.1f} MB (page cache warm): median CheckpointStore.load "
          f"{load_median * 1e3:.1f} ms, median raw read {read_median * 1e3:.1f} ms, "
          f"time ratio load / raw read {median_ratio(pairs, numerator=0):.2f}")


# ---- resuming the demo in a subprocess ----------------------------------------------------------
class StopAfterSplits(engine.Callback):
    """Notes when the first split of this process ends; asks to stop after ``splits`` splits."""

    def __init__(self, splits: int) -> None:
        self.splits = splits
        self.seen = 0
        self.first_split_unix: float | None = None

    def on_split_end(self, view: engine.RunView) -> None:
        self.seen += 1
        if self.first_split_unix is None:
            self.first_split_unix = time.time()
        if self.seen >= self.splits:
            view.request_stop("benchmark")


def build_resume_model(model: str) -> tuple[Any, Any]:
    """The module and data of ``model``: the demo, or the small / 25M LSTM language models of
    benchmarks/checkpoint_overhead.py."""
    if model == "demo":
        from engine.demo import build_demo

        return build_demo(SEED)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import checkpoint_overhead

    workload = {"small": checkpoint_overhead.SMALL, "25M": checkpoint_overhead.LARGE}[model]
    return checkpoint_overhead.fresh_model(workload), checkpoint_overhead.make_batches(workload)


def child_main(mode: str, run_dir: str | None, model: str) -> None:
    """Inside a child process: ``prepare`` trains ``model`` 3 splits into ``run_dir``;
    ``resume`` resumes it there; ``fresh`` starts without a run directory. Each prints when its
    first split ended."""
    torch.set_num_threads(THREADS)
    module, loader = build_resume_model(model)
    stopper = StopAfterSplits(3 if mode == "prepare" else 1)
    checkpoint = engine.CheckpointConfig() if run_dir is not None else None
    # The prepared run ended by a callback's stop: the resuming child raises max_epochs to train on.
    config = engine.TrainerConfig(max_epochs=2 if mode == "resume" else 1, run_dir=run_dir, checkpoint=checkpoint,
                                  progress_bar="off")
    result = engine.Trainer(config, callbacks=[stopper]).fit(module, loader, resume="latest" if mode == "resume" else "off")
    print(f"resumed from {result.resumed_from}")
    print(f"first split at {stopper.first_split_unix!r}")


def time_child(mode: str, run_dir: str | None, model: str) -> float:
    """Seconds from just before spawning the child to the end of its first split."""
    command = [sys.executable, os.path.abspath(__file__), "--child", mode, "--model", model]
    if run_dir is not None:
        command += ["--run-dir", run_dir]
    started = time.time()
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"child {mode} failed:\n{completed.stderr}")
    if mode == "resume" and "resumed from None" in completed.stdout:
        raise RuntimeError("the resume child started fresh instead of resuming")
    match = re.search(r"^first split at (\S+)$", completed.stdout, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"child {mode} printed no first split time:\n{completed.stdout}")
    return float(match.group(1)) - started


def time_resume(template: str, work: str, index: int, model: str) -> float:
    """Resume from a fresh copy of the prepared run directory (the resumed child writes a
    checkpoint of its own when it stops; every repeat must resume from the same one)."""
    run_dir = os.path.join(work, f"resume-{index}")
    shutil.copytree(template, run_dir)
    try:
        return time_child("resume", run_dir, model)
    finally:
        shutil.rmtree(run_dir)


def report_resume(work: str, repeats: int, model: str) -> None:
    template = os.path.join(work, f"{model}-template")
    time_child("prepare", template, model)
    store = CheckpointStore(Storage(template))
    paths = checkpoint_files(store, store.names()[-1])
    megabytes = sum(os.path.getsize(path) for path in paths) / 1e6
    indices = iter(range(repeats))
    pairs = interleaved(lambda: time_resume(template, work, next(indices), model),
                        lambda: time_child("fresh", None, model) + time_call(lambda: read_files(paths)), repeats)
    resume_median, fresh_median = medians(pairs)
    shutil.rmtree(template)
    print(f"resume the {model} model ({megabytes:.2f} MB checkpoint), process start to first split: median resume "
          f"{resume_median:.2f} s, median fresh start + raw read {fresh_median:.2f} s, "
          f"time ratio resume / (fresh + raw read) {median_ratio(pairs, numerator=0):.2f}")


# ---- entry point --------------------------------------------------------------------------------
def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=None, help="interleaved write/load pairs (default 7, 3 with --quick)")
    parser.add_argument("--resume-repeats", type=int, default=None, help="interleaved resume pairs (default 5, 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--smoke", action="store_true",
                        help="every step once at the smallest size (CI runs it; the figures mean nothing)")
    parser.add_argument("--dir", default=None, help="where to create the temporary directory (default: the current directory)")
    parser.add_argument("--child", choices=["prepare", "resume", "fresh"], help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=list(RESUME_MODELS), default="demo", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.repeats is None:
        arguments.repeats = 1 if arguments.smoke else 3 if arguments.quick else 7
    if arguments.resume_repeats is None:
        arguments.resume_repeats = 1 if arguments.quick or arguments.smoke else 5
    if arguments.repeats < 1 or arguments.resume_repeats < 1:
        parser.error("--repeats and --resume-repeats must be positive")
    return arguments


def run_benchmark(arguments: argparse.Namespace, work: str, sizes_mb: tuple[int, ...]) -> float:
    """Every measurement; returns the write throughput ratio of the largest state."""
    ratios = {}
    for megabytes in sizes_mb:
        case = prepare_case(megabytes, work)
        print(f"state of about {megabytes} MB: {case.total_bytes / 1e6:.1f} MB on disk")
        ratios[megabytes], extra_seconds = report_write(case, arguments.repeats)
        report_breakdown(case, arguments.repeats, extra_seconds)
        if megabytes == max(sizes_mb):
            report_load(case, arguments.repeats)
    for model in SMOKE_RESUME_MODELS if arguments.smoke else RESUME_MODELS:
        report_resume(work, arguments.resume_repeats, model)
    return ratios[max(sizes_mb)]


def main() -> None:
    arguments = parse_arguments()
    if arguments.child is not None:
        child_main(arguments.child, arguments.run_dir, arguments.model)
        return
    torch.set_num_threads(THREADS)
    work = os.path.abspath(tempfile.mkdtemp(prefix="checkpoint_io-", dir=arguments.dir or os.getcwd()))
    print(f"temporary directory {work}, torch {torch.__version__}")
    sizes_mb = SMOKE_SIZES_MB if arguments.smoke else SIZES_MB
    try:
        ratio = run_benchmark(arguments, work, sizes_mb)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"write throughput ratio: {ratio:.2f} (checkpoint / raw write, {max(sizes_mb)} MB state)")


if __name__ == "__main__":
    main()
