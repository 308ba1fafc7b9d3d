"""The `batchapi` command: models, the server, workers, and client helpers for people."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from batchapi.config import Settings, SettingsError, load_settings

console = Console()


def _settings() -> Settings:
    try:
        return load_settings()
    except SettingsError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise SystemExit(2) from None


# models


def cmd_models_pull(args: argparse.Namespace) -> int:
    from batchapi.model_store import ModelNotFound, pull_model

    settings = _settings()
    try:
        with console.status(f"pulling {args.name} (fetch and convert once)"):
            path = pull_model(args.name, settings.model_cache)
    except ModelNotFound as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 1
    console.print(f"{args.name}: {path}")
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    from batchapi.model_store import list_models

    settings = _settings()
    table = Table("model", "path", "size")
    for alias, path, size in list_models(settings.model_cache):
        table.add_row(alias, str(path), f"{size / 1e6:.0f} MB")
    console.print(table)
    return 0


# engine without a server


def engine_config_from(settings: Settings, model: str | None = None):
    """EngineConfig from settings: the one place a worker or the CLI builds it."""
    from batchapi.engine import EngineConfig
    from batchapi.model_store import resolve_model

    path = resolve_model(model or settings.model, settings.model_cache)
    return EngineConfig(
        model_path=str(path),
        device=settings.resolved_device,
        dtype=settings.dtype,
        kernels=settings.kernels,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        kv_cache_bytes=int(settings.kv_cache_gb * 2**30),
        gpu_memory_utilization=settings.gpu_memory_utilization,
        enable_prefix_caching=settings.enable_prefix_caching,
    )


def cmd_run_batch(args: argparse.Namespace) -> int:
    from batchapi.model_store import ModelNotFound
    from batchapi.workers.run_batch import run_batch

    settings = _settings()
    try:
        config = engine_config_from(settings, args.model)
    except ModelNotFound as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 1
    counts = run_batch(Path(args.input), Path(args.output), config, progress=not args.quiet)
    console.print(counts)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchapi", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="pull and list models").add_subparsers(dest="action", required=True)
    pull = models.add_parser("pull", help="fetch and convert a model once into the cache")
    pull.add_argument("name")
    pull.set_defaults(func=cmd_models_pull)
    models.add_parser("list", help="models in the cache").set_defaults(func=cmd_models_list)

    run = sub.add_parser("run-batch", help="run an OpenAI batch JSONL file through the engine, no server")
    run.add_argument("-i", "--input", required=True)
    run.add_argument("-o", "--output", required=True)
    run.add_argument("--model", default=None, help="model name or HF directory (default: BATCHAPI_MODEL)")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    run.set_defaults(func=cmd_run_batch)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
