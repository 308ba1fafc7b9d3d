"""The `batchapi` command: models, the server, workers, and client helpers for people."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

from batchapi.cli.client import api_url
from batchapi.cli.failures import USAGE, CommandError, explain, unexpected
from batchapi.config import Settings, SettingsError, load_settings

console = Console()


# models


def cmd_models_pull(args: argparse.Namespace) -> int:
    from batchapi.models.registry import model_info, pull

    settings = load_settings()
    for name in args.name:  # each model's directory is printed once it is ready, the last one last
        with console.status(f"pulling {name} (fetch, link or convert once)"):
            path = pull(name, settings.model_cache)
        info = model_info(path)
        console.print(f"{path.name}: {path} ({info.architecture}, {info.kind}, context {info.context_length}); "
                      f"serve it as BATCHAPI_MODEL={path.name}", highlight=False, soft_wrap=True)
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    from batchapi.models.registry import model_info
    from batchapi.models.store import list_models

    settings = load_settings()
    table = Table("model", "path", "architecture", "context", "size")
    for alias, path, size in list_models(settings.model_cache):
        info = model_info(path)
        where = f"{path} -> {path.resolve()}" if path.is_symlink() else str(path)
        table.add_row(alias, where, info.architecture or "", str(info.context_length or ""), f"{size / 1e6:.0f} MB")
    console.print(table)
    return 0


# engine without a server


def cmd_run_batch(args: argparse.Namespace) -> int:
    from batchapi.workers.engine_setup import engine_config_from
    from batchapi.workers.run_batch import run_batch

    settings = load_settings()
    config = engine_config_from(settings, args.model)
    counts = run_batch(Path(args.input), Path(args.output), config, progress=not args.quiet,
                       max_line_bytes=settings.max_line_bytes, engine_process=settings.engine_process)
    console.print(counts)
    return 0


# the service


def cmd_serve(args: argparse.Namespace) -> int:
    """The API; with no broker, the embedded worker runs in a child process that serve supervises."""
    from batchapi.api.main import serve

    overrides = {name: getattr(args, name) for name in ("host", "port") if getattr(args, name) is not None}
    if args.workers is not None:
        overrides["api_workers"] = args.workers
    settings = load_settings(**overrides)  # --workers is checked as BATCHAPI_API_WORKERS is: it needs a broker
    if settings.embedded:
        from batchapi.workers.embedded import WorkerProcess

        worker = WorkerProcess()
        serve(settings, dispatcher=worker, hook=worker.run, sweep_shards=True)  # no beat: it sweeps
    elif settings.api_workers > 1:
        serve(settings, factory="batchapi.cli.commands:api_app")
    else:
        serve(settings, dispatcher=_celery_dispatcher(settings))
    return 0


def _celery_dispatcher(settings: Settings):
    from batchapi.workers.celery_app import CeleryDispatcher, make_celery

    return CeleryDispatcher(make_celery(settings), settings.celery_queue, settings)


def api_app():
    """The app of one of `batchapi serve --workers N`'s processes: uvicorn imports and calls this
    in each, and each reads its settings from the environment again."""
    from batchapi.api.main import create_app

    _configure_logging(verbose=False)
    settings = load_settings()
    return create_app(settings, dispatcher=_celery_dispatcher(settings), freeze_start_up=True)


def cmd_worker(args: argparse.Namespace) -> int:
    from batchapi.workers.processes import run_embedded_worker, run_worker

    settings = load_settings()
    if args.embedded:  # started by `batchapi serve`, which talks to it on its stdin
        if not settings.embedded:
            raise CommandError("`batchapi worker --embedded` is the worker of `batchapi serve` without "
                               "BATCHAPI_BROKER_URL", usage=True)
        run_embedded_worker(settings)
        return 0
    if settings.embedded:
        raise CommandError("`batchapi worker` needs BATCHAPI_BROKER_URL (without one, `batchapi serve` runs "
                           "the worker itself)", usage=True)
    if args.slot is not None and (not args.slot or "/" in args.slot):
        raise CommandError(f"--slot {args.slot!r}: a non-empty name without '/', such as the GPU's index",
                           usage=True)
    run_worker(settings, args.name, args.slot)
    return 0


def cmd_beat(args: argparse.Namespace) -> int:
    from batchapi.workers.processes import run_beat

    settings = load_settings()
    if settings.embedded:
        raise CommandError("`batchapi beat` needs BATCHAPI_BROKER_URL (without one, `batchapi serve` sweeps "
                           "itself)", usage=True)
    run_beat(settings)
    return 0


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)  # a line per plugin, on import
    from batchapi.db.migrate import upgrade

    upgrade(load_settings(), args.revision)
    console.print(f"database at {args.revision}")
    return 0


def cmd_keys_create(args: argparse.Namespace) -> int:
    from batchapi.db.projects import create_key

    key = create_key(load_settings(), args.project, admin=args.admin)
    kind = "admin API key" if args.admin else "API key"
    console.print(f"{kind} for project {args.project!r} (shown once):")
    print(key)
    return 0


def _date(timestamp: int | None) -> str:
    return "" if timestamp is None else datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d")


def cmd_keys_list(args: argparse.Namespace) -> int:
    from batchapi.db.projects import list_keys

    keys = list_keys(load_settings(), args.project)
    if args.json:
        print(json.dumps([dataclasses.asdict(key) for key in keys], indent=2))
        return 0
    # fits 80 columns: ids are copied into `keys revoke` whole, so only the project name may wrap
    table = Table(box=None, pad_edge=False)
    table.add_column("id", no_wrap=True)
    table.add_column("project", overflow="fold")
    for name in ("key", "created", "revoked"):
        table.add_column(name, no_wrap=True)
    for key in keys:
        table.add_row(key.id, key.project, key.prefix + "…" + (" admin" if key.admin else ""), _date(key.created_at),
                      _date(key.revoked_at))
    console.print(table)
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from batchapi.db.projects import revoke_key

    revoked = revoke_key(load_settings(), args.key_id)
    console.print(f"{args.key_id} revoked" if revoked else f"{args.key_id} was already revoked")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from batchapi.cli.submit import submit

    return submit(Path(args.file), base_url=args.base_url, api_key=args.api_key, endpoint=args.endpoint,
                  wait=args.wait, show=args.show, console=console, priority=args.priority, max_cost=args.max_cost,
                  dry_run=args.dry_run)


def cmd_batches(args: argparse.Namespace) -> int:
    from batchapi.cli.batches import run

    return run(args.action, args, args.base_url, console)


BASE_URL_HELP = "the server, http://HOST:PORT with or without /v1 (default: http://BATCHAPI_HOST:BATCHAPI_PORT)"


def _add_batches_parser(sub) -> None:
    """``batchapi batches list | show | cancel | download | retry | diff`` (batchapi/cli/batches.py)."""
    client = argparse.ArgumentParser(add_help=False)
    client.add_argument("--base-url", default=None, help=BASE_URL_HELP)
    client.add_argument("--api-key", default=None, help="default: OPENAI_API_KEY")
    batches = sub.add_parser("batches", help="list, show, cancel, download, retry and diff batches on a running server")
    actions = batches.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", parents=[client], help="the newest batches, as a table")
    listing.add_argument("--limit", type=int, default=20, help="how many (1-100)")
    for name, what in (("show", "one batch's details"), ("cancel", "cancel a batch (finished results are kept)"),
                       ("download", "save a batch's output and error files"),
                       ("retry", "a new batch over a batch's failed, expired and cancelled requests")):
        action = actions.add_parser(name, parents=[client], help=what)
        action.add_argument("batch_id")
        if name == "download":
            action.add_argument("-o", "--output-dir", default=".", help="where to save them (default: here)")
        else:
            action.add_argument("--wait", action="store_true", help="follow it with a progress bar until it ends")
        if name == "retry":
            action.add_argument("--idempotency-key", default=None, help="the same key returns the same retry batch")
    compare = actions.add_parser("diff", parents=[client], help="what changed between two ended runs, by custom_id; "
                                 "exits 3 when an output changed under the same system_fingerprint, 4 when the "
                                 "diff cannot be made")
    compare.add_argument("batch_id", help="the first run")
    compare.add_argument("against", help="the run compared with it")
    compare.add_argument("--limit", type=int, default=100, help="changed requests to list (1-10000)")
    compare.add_argument("--json", action="store_true", help="the API's diff object as JSON")
    batches.set_defaults(func=cmd_batches)


def cmd_webhooks(args: argparse.Namespace) -> int:
    from batchapi.cli.webhooks import run

    return run(args, load_settings(), console)


def cmd_projects(args: argparse.Namespace) -> int:
    from batchapi.cli.projects import run

    return run(args, load_settings(), console)


def build_parser() -> argparse.ArgumentParser:
    from batchapi.cli.projects import add_parser as add_projects_parser
    from batchapi.cli.webhooks import add_parser as add_webhooks_parser

    parser = argparse.ArgumentParser(prog="batchapi", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--debug", action="store_true", help="a failure shows its traceback")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="pull and list models").add_subparsers(dest="action", required=True)
    pull = models.add_parser("pull", help="fetch and convert a model once into the cache")
    pull.add_argument("name", nargs="+", help="one or more models: catalog aliases (smollm2-135m-instruct "
                      "all-minilm-l6-v2), local Hugging Face directories, local .gguf files")
    pull.set_defaults(func=cmd_models_pull)
    models.add_parser("list", help="models in the cache").set_defaults(func=cmd_models_list)

    run = sub.add_parser("run-batch", help="run an OpenAI batch JSONL file through the engine, no server")
    run.add_argument("-i", "--input", required=True)
    run.add_argument("-o", "--output", required=True)
    run.add_argument("--model", default=None, help="model name or HF directory (default: BATCHAPI_MODEL)")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    run.set_defaults(func=cmd_run_batch)

    serve = sub.add_parser("serve", help="the API (with the embedded worker when no broker is set)")
    serve.add_argument("--host", default=None, help="default: BATCHAPI_HOST")
    serve.add_argument("--port", type=int, default=None, help="default: BATCHAPI_PORT")
    serve.add_argument("--workers", type=int, default=None,
                       help="API processes on the one port (needs BATCHAPI_BROKER_URL); default: BATCHAPI_API_WORKERS")
    serve.set_defaults(func=cmd_serve)
    worker = sub.add_parser("worker", help="a Celery GPU worker (one per GPU)")
    worker.add_argument("-n", "--name", default=None, help="Celery node name")
    worker.add_argument("--slot", default=None,
                        help="this worker's place on its host, e.g. its GPU's index: a worker restarted in the "
                        "same slot takes back at once the shards the one before it held")
    worker.add_argument("--embedded", action="store_true", help=argparse.SUPPRESS)  # batchapi serve's child
    worker.set_defaults(func=cmd_worker)
    sub.add_parser(
        "beat", help="the sweeper on Celery beat: re-queue lost shards, expire and cancel batches"
    ).set_defaults(func=cmd_beat)

    db = sub.add_parser("db", help="database migrations").add_subparsers(dest="action", required=True)
    up = db.add_parser("upgrade", help="migrate the database to the latest schema")
    up.add_argument("revision", nargs="?", default="head")
    up.set_defaults(func=cmd_db_upgrade)
    keys = sub.add_parser("keys", help="API keys").add_subparsers(dest="action", required=True)
    create = keys.add_parser("create", help="create an API key for a project")
    create.add_argument("--project", required=True)
    create.add_argument("--admin", action="store_true",
                        help="the key also reads every project's usage and costs (/v1/organization/...)")
    create.set_defaults(func=cmd_keys_create)
    listing = keys.add_parser("list", help="API keys (never the secrets), oldest first")
    listing.add_argument("--project", default=None, help="only this project's keys")
    listing.add_argument("--json", action="store_true", help="JSON instead of a table")
    listing.set_defaults(func=cmd_keys_list)
    revoke = keys.add_parser("revoke", help="refuse an API key from now on")
    revoke.add_argument("key_id", help="the key's id, from `batchapi keys list`")
    revoke.set_defaults(func=cmd_keys_revoke)

    submit = sub.add_parser("submit", help="upload a JSONL file to a running server and create a batch")
    submit.add_argument("file")
    submit.add_argument("--wait", action="store_true", help="follow it with a progress bar until it ends")
    submit.add_argument("--base-url", default=None, help=BASE_URL_HELP)
    submit.add_argument("--api-key", default=None, help="default: OPENAI_API_KEY")
    submit.add_argument("--endpoint", default=None, help="default: the url of the file's first line")
    submit.add_argument("--show", type=int, default=3, help="results to print at the end")
    submit.add_argument("--priority", type=int, default=0, help="its order among the project's batches, higher first")
    submit.add_argument("--max-cost", default=None, help="a spend cap: reaching it stops the batch as a cancel does")
    submit.add_argument("--dry-run", action="store_true", help="upload it and show its line errors, exact prompt "
                        "tokens, estimated cost and completion, and the quota check; run nothing")
    submit.set_defaults(func=cmd_submit)
    _add_batches_parser(sub)
    add_webhooks_parser(sub, cmd_webhooks)
    add_projects_parser(sub, cmd_projects)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. A failure prints one line to stderr, ``batchapi COMMAND: what failed; what
    to do`` (batchapi/cli/failures.py), and returns 1 (130 on Ctrl-C); a usage error (the command line or the
    settings) exits 2 through SystemExit, as argparse's own do. ``--debug`` shows the traceback."""
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    try:
        if hasattr(args, "base_url"):  # settled first, so that a failure names the URL the client used
            settings = load_settings()
            args.base_url = api_url(args.base_url, settings.host, settings.port)
        return args.func(args)
    except (Exception, KeyboardInterrupt) as exc:
        if args.debug:
            raise
        command = _command(args)
        failure = explain(exc, getattr(args, "base_url", None)) or unexpected(exc, command)
        print(f"{command}: {failure.line}", file=sys.stderr)
        if failure.status == USAGE:
            raise SystemExit(USAGE) from None
        return failure.status


def _command(args: argparse.Namespace) -> str:
    """``batchapi keys revoke``: the words a person typed to get here."""
    return " ".join(["batchapi", args.command, *([args.action] if getattr(args, "action", None) else [])])


def _configure_logging(verbose: bool) -> None:
    """batchapi/logs.py's one format (BATCHAPI_LOG_FORMAT); invalid settings are reported later."""
    from batchapi import logs

    try:
        log_format = load_settings().log_format
    except SettingsError:
        log_format = "text"
    logs.configure(log_format, logging.DEBUG if verbose else logging.INFO)


if __name__ == "__main__":
    sys.exit(main())
