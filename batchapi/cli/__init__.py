"""The `batchapi` command: models, run-batch, serve, worker, beat, db, keys, submit, batches and
webhooks (``commands`` builds the parser and runs them; ``failures`` words what goes wrong)."""

from batchapi.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
