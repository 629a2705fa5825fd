"""``engine.loggers.WandB``: the rows of metrics.jsonl in a Weights & Biases run, each committed
row once, one W&B run per engine run across every resume.

Each row is one W&B history step: its W&B ``_step`` is the row's number in metrics.jsonl (W&B
drops a step that is not larger than its last, and several rows share an optimizer step: a
split's and the validation after it), its values are keyed ``<stage>/<name>`` as the
TensorBoard tags, and the optimizer step is the metric ``trainer/global_step``, which every
metric is plotted against (``define_metric``). A row is sent once a checkpoint committed it, by a
sender thread (engine.loggers._tracker).

The W&B run's id is chosen by the logger and recorded in the run directory (``wandb-run.json``)
before the run is created; every later process of the run attaches to it (``resume="allow"``)
and sends the committed rows from the first the W&B run lacks: online, from the run's
``starting_step``; offline, after the steps the earlier processes' run files hold (read with
wandb's own reader, ``wandb leet inspect --json``). Each process writes its own offline run
directory (``offline-run-<time>-<id>-<suffix>``); ``wandb sync`` of all of them makes the one
run. The run's hyperparameters are its config, set once (a resumed process sets only the keys
the run lacks).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import uuid
from types import ModuleType
from typing import Any, Sequence

from engine.errors import ConfigError
from engine.loggers._tracker import Point, Tracker, read_record, require_package, write_record
from engine.loggers.base import Row, local_path, row_scalars, row_step

_MISSING = ("engine.loggers.WandB needs the wandb package, which is not installed: "
            "pip install 'splitloop[wandb]' (or pip install wandb)")
RUN_FILE = "wandb-run.json"
STEP_METRIC = "trainer/global_step"  # Lightning's WandbLogger's name for the optimizer step
MODES = ("online", "offline", "disabled")
_ID_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_")
_READ_TIMEOUT = 300.0
_FLUSH_SECONDS = 1.0


class WandB(Tracker):
    """Send the run's metrics to a Weights & Biases run (needs ``pip install 'splitloop[wandb]'``)::

        config = engine.TrainerConfig(run_dir="runs/a", loggers=[
            engine.loggers.WandB(project="lm", name="lm-a", mode="offline", dir="runs/a")])

    Args:
        project: the W&B project.
        name: the W&B run's display name (W&B picks one if None).
        mode: ``"online"``, ``"offline"`` (run files only, ``wandb sync`` later) or ``"disabled"``;
            None: W&B's default (``WANDB_MODE``, else online).
        dir: the directory W&B writes its ``wandb/`` folder in (None: ``WANDB_DIR``, else the
            working directory). Offline, it must stay the same across resumes: the earlier
            processes' run files there say what the run holds.
        id: the W&B run id for a new run (None: a random one); resumes use the recorded one.
        entity: the W&B entity (user or team); None: W&B's default.
        tags: tags of the W&B run.
        group: the W&B group of the run.
        log_model: at the end of ``fit``, log the weights of the run's last checkpoint as the
            artifact ``model-<run id>`` (type ``model``), a file ``model.safetensors``
            (``model.pt`` without safetensors).
        close_timeout: seconds ``fit``'s end waits for the last rows to reach W&B.
        retry_seconds: how often a failing W&B is tried again.
    """

    def __init__(self, project: str = "splitloop", name: str | None = None, mode: str | None = None,
                 dir: str | os.PathLike[str] | None = None, id: str | None = None, entity: str | None = None,
                 tags: Sequence[str] | None = None, group: str | None = None, log_model: bool = False,
                 close_timeout: float = 30.0, retry_seconds: float = 5.0) -> None:
        super().__init__(close_timeout, retry_seconds, log_model)
        for field, value in (("project", project), ("name", name), ("entity", entity), ("group", group)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"WandB.{field}: expected a non-empty string{'' if field == 'project' else ' or None'}, "
                                  f"got {value!r}")
        if mode is not None and mode not in MODES:
            raise ConfigError(f"WandB.mode: expected one of {list(MODES)} or None, got {mode!r}")
        if id is not None and (not isinstance(id, str) or not id or not set(id) <= _ID_CHARACTERS or len(id) > 64):
            raise ConfigError(f"WandB.id: expected up to 64 lowercase letters, digits, '-' or '_', got {id!r}")
        if tags is not None and (isinstance(tags, str) or not all(isinstance(tag, str) for tag in tags)):
            raise ConfigError(f"WandB.tags: expected a list of strings, got {tags!r}")
        require_package("wandb", _MISSING)
        self.project, self.name, self.mode, self.id, self.entity, self.group = project, name, mode, id, entity, group
        self.dir = None if dir is None else local_path("WandB", "dir", dir)
        self.tags = None if tags is None else list(tags)
        self.run_id: str | None = None
        self._wandb_run: Any = None  # a wandb Run once connected
        self._held_rows: int | None = None
        self._chosen_id: str | None = None

    def __repr__(self) -> str:
        return f"engine.loggers.WandB(project={self.project!r}, mode={self.mode!r})"

    # ---- the sender thread's calls ----------------------------------------------------------
    def _connect(self, fresh: bool) -> None:
        if self._chosen_id is None:  # once per start: a connection tried again keeps its id
            self._chosen_id = self._run_id(fresh)
        if self._wandb_run is None:
            self._wandb_run = self._init(_import_wandb(), self._chosen_id)
            self.run_id = self._wandb_run.id
        run = self._wandb_run
        if self._held_rows is None:
            self._held_rows, held_config = self._held(run)
            missing = {key: value for key, value in self.run.hyperparameters.items() if key not in held_config}
            if missing:
                run.config.update(missing, allow_val_change=True)

    def _run_id(self, fresh: bool) -> str:
        """The recorded W&B run id (a new one, recorded, for a fresh start)."""
        record = read_record(self.run, RUN_FILE) or {}
        if not fresh and isinstance(record.get("id"), str):
            return record["id"]
        # A fresh start replaces the earlier run: never attach to the W&B run it wrote to.
        run_id = self.id if self.id is not None and record.get("id") != self.id else uuid.uuid4().hex[:16]
        write_record(self.run, RUN_FILE, {"id": run_id})
        return run_id

    def _init(self, wandb: ModuleType, run_id: str) -> Any:
        self._check_dir()
        settings = wandb.Settings(
            console="off", silent=True, disable_git=True, save_code=False, x_disable_stats=True,
            x_save_requirements=False,
            # The run file holds what a kill cannot take from W&B; written every 15 s by default.
            x_transaction_log_flush_interval=_FLUSH_SECONDS,
            # Each process its own offline directory: a restart in the same second as the last one
            # would otherwise write into the same run file.
            x_sync_dir_suffix=uuid.uuid4().hex[:8])
        run = wandb.init(project=self.project, name=self.name, id=run_id, resume="allow", mode=self.mode,
                         dir=self.dir, entity=self.entity, tags=self.tags, group=self.group, settings=settings,
                         reinit="create_new")
        run.define_metric(STEP_METRIC)
        run.define_metric("*", step_metric=STEP_METRIC)
        return run

    def _check_dir(self) -> None:
        """OSError when W&B's directory cannot be written: W&B would quietly write to a temporary
        directory instead, where no resume finds its run files."""
        directory = self.dir if self.dir is not None else os.environ.get("WANDB_DIR")
        if directory:
            os.makedirs(os.path.join(directory, "wandb"), exist_ok=True)
            with tempfile.TemporaryFile(dir=os.path.join(directory, "wandb")):
                pass

    def _held(self, run: Any) -> tuple[int, dict[str, object]]:
        """How many rows the W&B run holds (its next step) and its config."""
        if not run.offline:
            return (run.starting_step if run.resumed else 0), dict(run.config)
        rows, config = 0, dict[str, object]()
        current = os.path.abspath(run.settings.sync_file)
        wandb_dir = run.settings.wandb_dir
        for entry in sorted(os.listdir(wandb_dir)) if os.path.isdir(wandb_dir) else []:
            path = os.path.join(wandb_dir, entry, f"run-{run.id}.wandb")
            # (latest-run is a link to one of them)
            if os.path.abspath(path) != current and os.path.isfile(path) and not os.path.islink(os.path.dirname(path)):
                steps, segment_config = read_run_file(path)
                rows, config = max(rows, steps), {**config, **segment_config}
        return rows, config

    def _missing(self, committed_rows: list[Row]) -> tuple[list[Point], dict[str, int]]:
        held = self._held_rows or 0
        missing = [Point(row_step(row), dict(row_scalars(row)), 0, number)
                   for number, row in enumerate(committed_rows) if number >= held]
        return missing, ({"rows": held - len(committed_rows)} if held > len(committed_rows) else {})

    def _send(self, points: list[Point]) -> None:
        run = self._wandb_run
        assert run is not None, "called before _connect"
        for point in points:
            run.log({**point.values, STEP_METRIC: point.step}, step=point.row)

    def _send_model(self, path: str) -> None:
        run = self._wandb_run
        assert run is not None, "called before _connect"
        artifact = _import_wandb().Artifact(f"model-{run.id}", type="model")
        artifact.add_file(path)
        run.log_artifact(artifact)

    def _finish(self) -> None:
        run, self._wandb_run = self._wandb_run, None
        if run is not None:
            run.finish()

    def _reset(self) -> None:
        run, self._wandb_run, self._held_rows, self.run_id = self._wandb_run, None, None, None
        self._chosen_id = None
        if run is not None:  # a rollback restarts the logger in this process: end the previous attachment
            try:
                run.finish()
            except Exception:  # noqa: BLE001 - the new start tries (and warns) on its own
                pass


def read_run_file(path: str) -> tuple[int, dict[str, object]]:
    """What a W&B run file (``run-<id>.wandb``) holds: its next step (the largest ``_step`` + 1)
    and its config; read with wandb's own reader, which stops at a torn end (a killed process's)."""
    # What `wandb leet inspect --json --run-file PATH` runs, without a Python start-up.
    command = [_import_wandb().util.get_core_path(), "leet", "inspect", "--no-observability", "--json", "--run-file", path,
               os.path.dirname(os.path.dirname(path))]
    result = subprocess.run(command, capture_output=True, text=True, timeout=_READ_TIMEOUT)
    if result.returncode != 0:
        raise OSError(f"wandb leet inspect {path} failed ({result.returncode}): {result.stderr[-500:]}")
    steps, config = 0, dict[str, object]()
    for line in result.stdout.splitlines():
        record = json.loads(line)
        if record.get("type") == "history":
            steps = max(steps, int(record["history"]["item"]["_step"]) + 1)
        elif record.get("type") in ("config", "run"):
            updates = record.get(record["type"], {}).get("config", {}) if record["type"] == "run" \
                else record["config"]
            config.update({key: value for key, value in updates.get("update", {}).items() if not key.startswith("_")})
    return steps, config


def _import_wandb() -> ModuleType:
    """wandb, with its utilities (imported by the sender thread, not by ``import engine``)."""
    try:
        import wandb
        import wandb.util
    except ImportError as error:
        raise ConfigError(_MISSING) from error
    return wandb
