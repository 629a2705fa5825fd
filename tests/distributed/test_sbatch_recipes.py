"""The sbatch scripts of docs/preemption.md, docs/slurm.md and docs/distributed.md, taken from the pages (so the
docs and the test cannot drift), run with bash under a simulated SLURM: a fake ``scontrol`` that
records the requeue (and names the nodes), a fake ``srun`` (one node, one task), and the
documented ``train.py`` replaced by tests/distributed/dist_train.py. The signal SLURM would send
goes to the batch shell only (``--signal=B:USR1``), to its process group, or to every process
of the job (no ``B:``, scancel, the time limit), during training or during validation; each
case ends with exit status 75, one committed checkpoint, one ``scontrol requeue`` and no
process left. The default run covers one case per script; the matrix is marked ``exhaustive``."""

from __future__ import annotations

import itertools
import pathlib
import re
import signal
import socket
import stat
import subprocess
import sys

import pytest

import launch_helpers
import torchrun_helpers as helpers

pytestmark = pytest.mark.slow

DOCS = pathlib.Path(helpers.REPOSITORY) / "docs"
JOB_ID = "4242"
# recipe -> (page, processes, what to change to run it here: each must occur exactly once)
RECIPES = {
    "single-process": ("preemption.md", 1, {"/scratch/$USER": "{tmp}"}),
    "torchrun": ("preemption.md", 2, {"/scratch/$USER": "{tmp}", "--nproc-per-node=4": "--nproc-per-node=2"}),
    "several-nodes": ("distributed.md", 2, {"/shared/$USER": "{tmp}", "--nnodes=2": "--nnodes=1",
                                            "--nproc-per-node=4": "--nproc-per-node=2", ":29500": ":{port}"}),
    "lightning-torchrun": ("slurm.md", 2, {"/scratch/$USER": "{tmp}", "--nproc-per-node=4": "--nproc-per-node=2"}),
}
FAKE_SCONTROL = """#!/bin/bash
if [ "$1" = show ] && [ "$2" = hostnames ]; then echo localhost; exit 0; fi
echo "$*" >> "$SCONTROL_LOG"
"""
FAKE_SRUN = """#!/bin/bash
exec "$@"    # one node, one task per node: the task is the command itself
"""
TRAIN_SHIM = f"""import os, runpy, sys
sys.argv = [{helpers.SCRIPT!r}, os.environ["RUN_DIR"], os.environ["OUT_DIR"], *os.environ["TRAIN_OPTIONS"].split()]
runpy.run_path({helpers.SCRIPT!r}, run_name="__main__")
"""


def recipe_text(name: str) -> str:
    page, _, _ = RECIPES[name]
    found = re.findall(rf"<!-- sbatch recipe: {name} -->\n```bash\n(.*?)```", (DOCS / page).read_text(), re.DOTALL)
    assert len(found) == 1, f"docs/{page} must hold the sbatch recipe {name!r} once"
    return found[0]


def prepare(tmp: pathlib.Path, name: str) -> pathlib.Path:
    """A job directory with the script, the fakes on PATH and a train.py; the script's path."""
    script = recipe_text(name)
    port = _free_port()
    for old, new in RECIPES[name][2].items():
        assert script.count(old) == 1, f"{name}: expected {old!r} once in the recipe"
        script = script.replace(old, new.format(tmp=tmp / "storage", port=port))
    (tmp / "bin").mkdir()
    for command, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (tmp / "bin" / command).write_text(text)
        (tmp / "bin" / command).chmod(stat.S_IRWXU)
    (tmp / ".venv" / "bin").mkdir(parents=True)
    (tmp / ".venv" / "bin" / "activate").write_text("")  # the test's python is on PATH already
    (tmp / "train.py").write_text(TRAIN_SHIM)
    for folder in ("storage/runs", "out", "tmp", "logs"):
        (tmp / folder).mkdir(parents=True, exist_ok=True)
    (tmp / "job.sbatch").write_text(script)
    return tmp / "job.sbatch"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def check_recipe(tmp: pathlib.Path, name: str, target: str, phase: str, number: int = signal.SIGUSR1) -> None:
    script = prepare(tmp, name)
    processes = RECIPES[name][1]
    out_dir = tmp / "out"
    path = f"{tmp / 'bin'}:{pathlib.Path(sys.executable).parent}:{helpers.os.environ.get('PATH', '')}"
    env = helpers.environment(PATH=path, SLURM_JOB_ID=JOB_ID, SLURM_JOB_NODELIST="node[1-2]", USER="tester",
                              SCONTROL_LOG=str(tmp / "scontrol.log"), OUT_DIR=str(out_dir), TMPDIR=str(tmp / "tmp"),
                              TRAIN_OPTIONS=" ".join(launch_helpers.phase_options(phase)))
    # slurmstepd runs the batch script in a session of its own: its process group is the job's.
    with subprocess.Popen(["bash", str(script)], cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as job:
        launch_helpers.wait_for_phase(out_dir, phase, job, processes)
        job_processes = launch_helpers.send(job, target, number, times=1)
        _, stderr = job.communicate(timeout=helpers.TIMEOUT)
    case = f"{name}: {signal.Signals(number).name} to {target} during {phase}"
    assert job.returncode == 75, f"{case}: " + stderr[-4000:]
    assert not launch_helpers.alive(job_processes), f"{case}: processes of the job left running"
    assert f"preempted by {signal.Signals(number).name};" in stderr, f"{case}: " + stderr[-4000:]  # the signal sent
    run_dir = tmp / "storage" / "runs" / f"lm-{JOB_ID}"
    assert len(launch_helpers.committed(run_dir)) == 1, f"{case}: " + stderr[-4000:]
    # `launch --requeue --signal USR1` requeues the time-limit warning only, not a scancel's SIGTERM.
    requeued = number == signal.SIGUSR1 or "--signal " not in recipe_text(name)
    scontrol_log = tmp / "scontrol.log"
    requeues = scontrol_log.read_text().splitlines() if scontrol_log.exists() else []
    assert requeues == ([f"requeue {JOB_ID}"] if requeued else []), f"{case}: " + stderr[-4000:]
    assert not launch_helpers.launch_directories(tmp / "tmp"), f"{case}: a launch left its marker directory"
    assert [path.name for path in (tmp / "storage" / "runs").iterdir()] == [f"lm-{JOB_ID}"], f"{case}: a marker was left"


# "launcher" in launch_helpers.send signals the process started: here the batch shell.
# The single process's group signal during validation is also run/test_preemption_validation's.
# preemption.md's torchrun script is slurm.md's without --signal USR1: that one runs by default.
@pytest.mark.parametrize("name, target, phase", [pytest.param("single-process", "group", "validation",
                                                              marks=pytest.mark.exhaustive),
                                                 pytest.param("torchrun", "launcher", "training",
                                                              marks=pytest.mark.exhaustive),
                                                 ("lightning-torchrun", "launcher", "training"),
                                                 # CI time (about 25 s): two nodes' recipe in the exhaustive run
                                                 pytest.param("several-nodes", "every", "validation",
                                                              marks=pytest.mark.exhaustive)])
def test_the_documented_sbatch_script_requeues_after_one_commit(tmp_path: pathlib.Path, name: str, target: str,
                                                                 phase: str) -> None:
    check_recipe(tmp_path, name, target, phase)


MATRIX = [(name, target, phase, signal.SIGUSR1) for name, target, phase
          in itertools.product(RECIPES, launch_helpers.TARGETS, launch_helpers.PHASES)]
MATRIX += [(name, "every", "training", signal.SIGTERM) for name in RECIPES]  # the time limit: SIGTERM to all


@pytest.mark.exhaustive
@pytest.mark.parametrize("name, target, phase, number", MATRIX,
                         ids=[f"{n}-{t}-{p}-{s.name}" for n, t, p, s in MATRIX])
def test_every_sbatch_script_signal_target_and_phase(tmp_path: pathlib.Path, name: str, target: str, phase: str,
                                                     number: int) -> None:
    check_recipe(tmp_path, name, target, phase, number)
