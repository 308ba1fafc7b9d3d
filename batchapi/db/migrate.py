"""Alembic, driven from code: ``upgrade``/``downgrade`` the database the settings name."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from batchapi.config import Settings

MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(settings: Settings, revision: str = "head") -> None:
    """``batchapi db upgrade``: bring the database to ``revision`` (creating a SQLite file)."""
    url = settings.sqlalchemy_url
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(url), revision)


def downgrade(settings: Settings, revision: str = "base") -> None:
    command.downgrade(alembic_config(settings.sqlalchemy_url), revision)


def current(settings: Settings) -> str | None:
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine

    engine = create_engine(settings.sqlalchemy_url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
