"""Offline W&B runs read back for the tests, with wandb's own reader of run files
(``wandb leet inspect --json``, one JSON line per record of a ``run-<id>.wandb`` file).

``wandb_environment`` keeps W&B offline, silent and inside the test's temporary directory; no
test reaches the network.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

from tracker_histories import History
STEP_METRIC = "trainer/global_step"


def wandb_environment(directory: str | os.PathLike[str]) -> dict[str, str]:
    """Environment variables for offline, silent W&B runs under ``directory``."""
    return {"WANDB_MODE": "offline", "WANDB_DIR": str(directory), "WANDB_SILENT": "true",
            "WANDB_CONFIG_DIR": str(pathlib.Path(directory, "config")),
            "WANDB_CACHE_DIR": str(pathlib.Path(directory, "cache")),
            "WANDB_DATA_DIR": str(pathlib.Path(directory, "data")),
            "WANDB_DISABLE_CODE": "true", "WANDB_ERROR_REPORTING": "false"}


@dataclasses.dataclass
class OfflineRun:
    """Every record of every offline run file of one W&B run id under a W&B ``dir``."""

    run_id: str
    files: list[str]
    history: list[dict]   # the history items, in the order written (file by file)
    configs: list[dict]   # each config update (the run record's and the config records')
    finished: int         # how many files end with an exit record
    artifacts: list[dict] = dataclasses.field(default_factory=list)  # the artifact records

    def histories(self) -> History:
        """Each metric's points as (trainer/global_step, value), in W&B step order."""
        result: History = {}
        for item in sorted(self.history, key=lambda item: item["_step"]):
            for key, value in item.items():
                if not key.startswith("_") and key != STEP_METRIC:
                    result.setdefault(key, []).append((item[STEP_METRIC], value))
        return result

    def config(self) -> dict:
        merged: dict = {}
        for update in self.configs:
            merged.update(update)
        return merged


def read_offline_runs(wandb_dir: str | os.PathLike[str]) -> dict[str, OfflineRun]:
    """The offline W&B runs under ``wandb_dir`` (the ``dir`` given to W&B), by run id."""
    runs: dict[str, OfflineRun] = {}
    for path in sorted(pathlib.Path(wandb_dir, "wandb").glob("offline-run-*/run-*.wandb")):
        run_id = path.stem[len("run-"):]
        run = runs.setdefault(run_id, OfflineRun(run_id, [], [], [], 0))
        run.files.append(str(path))
        for record in read_run_file(path):
            kind = record.get("type")
            if kind == "history":
                run.history.append(record["history"]["item"])
            elif kind == "config" or (kind == "run" and "config" in record["run"]):
                update = (record["config"] if kind == "config" else record["run"]["config"]).get("update", {})
                update = {key: value for key, value in update.items() if not key.startswith("_")}
                if update:
                    run.configs.append(update)
            elif kind == "exit":
                run.finished += 1
            elif kind == "artifact":
                run.artifacts.append(record["artifact"])
    return runs


def read_run_file(path: str | os.PathLike[str]) -> list[dict]:
    """The records of one ``.wandb`` file, by ``wandb leet inspect --json``."""
    result = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def history_written(wandb_dir: str | os.PathLike[str]) -> int:
    """How many history records the offline run files under ``wandb_dir`` hold now: cheap enough
    to poll (the reader's own binary, wandb-core, without a Python start-up)."""
    from wandb.util import get_core_path

    count = 0
    for path in pathlib.Path(wandb_dir, "wandb").glob("offline-run-*/run-*.wandb"):
        result = subprocess.run([get_core_path(), "leet", "inspect", "--no-observability", "--json", "--run-file",
                                 str(path), str(path.parent.parent)], capture_output=True, text=True, timeout=60)
        count += sum('"type":"history"' in line for line in result.stdout.splitlines())
    return count


def the_one_run(wandb_dir: str | os.PathLike[str], run_dir: str) -> OfflineRun:
    """The only W&B run under ``wandb_dir``; its id is the one recorded in the run directory."""
    runs = read_offline_runs(wandb_dir)
    assert len(runs) == 1, sorted(runs)
    run = next(iter(runs.values()))
    assert json.loads(pathlib.Path(run_dir, "wandb-run.json").read_text())["id"] == run.run_id
    return run
