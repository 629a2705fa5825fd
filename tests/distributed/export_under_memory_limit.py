"""Export a run's weights with an address-space limit of 1 GiB above what this process maps
once the engine is imported: an allocation for a huge shape read from a file fails here with a
raw RuntimeError, where the engine must refuse the file first. Prints the checkpoint exported
("latest"), then the checkpoint the refusal of the newest one by name names.

    python export_under_memory_limit.py RUN_DIR OUT_FILE
"""

from __future__ import annotations

import resource
import sys
import warnings

import engine
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore


def _limit_address_space(extra: int) -> None:
    with open("/proc/self/status") as status:
        mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (mapped + extra, mapped + extra))


def main(run_dir: str, out_file: str) -> None:
    newest = CheckpointStore(Storage(run_dir), create=False).names()[-1]
    _limit_address_space(1 << 30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        print(engine.export_weights(run_dir, out_file))
    try:
        engine.export_weights(run_dir, out_file, checkpoint=newest)
    except engine.CheckpointCorrupt as error:
        print(str(error).split(":")[0])


if __name__ == "__main__":
    main(*sys.argv[1:])
