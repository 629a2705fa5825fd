"""Commands the documentation gives to copy: the quickstart's is the README's; every
``python -m engine launch`` command of a page's shell blocks is one the launcher accepts; the
training script of docs/slurm.md trains and resumes."""

import json
import pathlib
import re
import runpy
import shlex

import pytest

from engine.cli.main import _requeue_policy, build_parser

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def pytest_commands(text):
    return [line for line in text.splitlines() if re.search(r"\bpython -m pytest\b", line)]


def test_the_quickstarts_test_command_is_the_readmes():
    (readme,) = pytest_commands((ROOT / "README.md").read_text())
    assert "-n 3" in readme  # three workers on two cores: tests wait on their subprocesses a quarter of the time
    assert pytest_commands((ROOT / "docs" / "quickstart.md").read_text()) == [readme]


def launch_commands(text):
    """The arguments after ``launch`` of each launch command in the page's bash blocks (its
    comment, a trailing ``&`` and what comes before the command dropped)."""
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            if "python -m engine launch" not in line:
                continue
            words = shlex.split(line, comments=True)
            for start in range(len(words) - 3):
                if words[start:start + 4] == ["python", "-m", "engine", "launch"]:
                    yield [word for word in words[start + 4:] if word != "&"]


def test_every_documented_launch_command_is_accepted():
    commands = {page.name: list(launch_commands(page.read_text())) for page in DOCS}
    assert len(commands["slurm.md"]) >= 4, commands["slurm.md"]  # the sbatch file's and the local tries
    for page, found in commands.items():
        for arguments in found:
            parsed = build_parser().parse_args(["launch", *arguments])  # a usage error exits 2
            _requeue_policy(parsed)  # --signal names a signal, with --requeue
            command = parsed.launched[1:] if parsed.launched[:1] == ["--"] else parsed.launched
            assert command[:1] in (["torchrun"], ["srun"]), f"docs/{page}: {shlex.join(arguments)}"


def slurm_page_script():
    (script,) = [block for block in re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "slurm.md").read_text(),
                                               re.DOTALL) if block.startswith("# train.py")]
    return script


@pytest.mark.slow
@pytest.mark.exhaustive  # two starts of the page's script: half a minute (the sbatch test runs its launch line)
def test_the_slurm_pages_lightning_script_trains_and_resumes(tmp_path, monkeypatch, capfd):
    pytest.importorskip("pytorch_lightning")
    script = tmp_path / "train.py"
    script.write_text(slurm_page_script())
    monkeypatch.setenv("RUN_DIR", str(tmp_path / "run"))
    rows = []
    for epochs in ("1", "2"):  # the second start resumes where the first ended
        monkeypatch.setenv("MAX_EPOCHS", epochs)
        runpy.run_path(str(script), run_name="__main__")
        metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        rows.append([json.loads(line) for line in metrics if '"stage": "train"' in line])
    assert "resuming from" in capfd.readouterr().err
    cursors = [(row["epoch"], row["batch"]) for row in rows[1]]
    assert len(rows[1]) == 2 * len(rows[0]) == len(set(cursors))  # each batch of both epochs once
    assert {epoch for epoch, _ in cursors} == {0, 1}
