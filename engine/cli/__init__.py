"""Command line: ``python -m engine {demo,inspect,faults,chaos} ...``."""

from engine.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
