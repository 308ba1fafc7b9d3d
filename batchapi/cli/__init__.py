"""The `batchapi` command: serve, worker, beat, migrate, keys, projects, models, run-batch, submit,
batches and webhooks (``commands`` builds the parser and runs them)."""

from batchapi.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
