"""``python -m engine``: see engine/cli/main.py."""

from engine.cli.main import main

raise SystemExit(main(prog="python -m engine"))
