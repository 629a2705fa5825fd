"""Commands the documentation gives to copy: the quickstart's is the README's."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def pytest_commands(text):
    return [line for line in text.splitlines() if re.search(r"\bpython -m pytest\b", line)]


def test_the_quickstarts_test_command_is_the_readmes():
    (readme,) = pytest_commands((ROOT / "README.md").read_text())
    assert "-n 3" in readme  # three workers on two cores: tests wait on their subprocesses a quarter of the time
    assert pytest_commands((ROOT / "docs" / "quickstart.md").read_text()) == [readme]
