"""The writer process (CheckpointConfig(writer="process")) runs without torch or NumPy: its start
costs a fraction of a second of CPU instead of torch's import, which a short run waits for at
its end (docs/performance.md, "A writer process")."""

import os
import subprocess
import sys
import time

import engine
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from process_table import WRITER_MODULE, writer_processes_of
from scenarios import train_with_checkpoints

# A process that imported torch or NumPy maps their native libraries.
HEAVY_LIBRARIES = ("libtorch", "torch/_C", "numpy/")
WAIT_SECONDS = 120


def test_importing_the_writer_process_module_imports_neither_torch_nor_numpy():
    script = (f"import sys, {WRITER_MODULE}\n"
              "loaded = sorted(name for name in ('torch', 'numpy') if name in sys.modules)\n"
              "assert not loaded, loaded\n")
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT_SECONDS)
    assert completed.returncode == 0, completed.stderr


def heavy_libraries_mapped_by(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/" in line}
    return sorted(path for path in paths if any(library in path for library in HEAVY_LIBRARIES))


class InspectWriterProcess(engine.Callback):
    """Once the writer process has committed a checkpoint (it imported all it needs by then),
    record the libraries of torch or NumPy its memory maps."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.splits = 0
        self.inspected: dict[int, list[str]] = {}

    def on_split_end(self, view: engine.RunView) -> None:
        self.splits += 1
        # The first checkpoint is submitted after the first split's callbacks.
        if self.splits < 2 or self.inspected:
            return
        deadline = time.monotonic() + WAIT_SECONDS
        while not CheckpointStore(Storage(self.run_dir)).names():
            assert time.monotonic() < deadline, "the writer process committed nothing"
            time.sleep(0.05)
        self.inspected = {pid: heavy_libraries_mapped_by(pid) for pid in writer_processes_of(os.getpid())}


def test_the_writer_process_of_a_run_has_neither_torch_nor_numpy_loaded(tmp_path):
    run_dir = str(tmp_path / "run")
    inspector = InspectWriterProcess(run_dir)
    train_with_checkpoints("tbptt", run_dir, epochs=1, writer="process", callbacks=(inspector,))
    assert len(inspector.inspected) == 1, "expected one writer process"
    assert list(inspector.inspected.values()) == [[]]
    # Control: this process has torch, and the check sees it.
    assert heavy_libraries_mapped_by(os.getpid())
