"""The PostgreSQL pool pings only connections that sat idle, and replaces the dead ones."""

from __future__ import annotations

import time

import psycopg
from sqlalchemy import event, text

from batchapi.config import load_settings
from batchapi.db.session import PING_AFTER_IDLE_SECONDS, make_engine
from tests.utils.services import PG_ADMIN_URL, fresh_database


def test_a_connection_dropped_while_idle_is_replaced_before_use(tmp_path):
    with fresh_database() as url:
        engine = make_engine(load_settings(database_url=url, data_dir=tmp_path))
        connects = []
        event.listen(engine, "connect", lambda *_: connects.append(1))
        try:
            with engine.connect() as conn:
                backend = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
            with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
                assert admin.execute("SELECT pg_terminate_backend(%s)", (backend,)).fetchone()[0]
            time.sleep(PING_AFTER_IDLE_SECONDS + 0.1)
            with engine.connect() as conn:
                assert conn.execute(text("SELECT pg_backend_pid()")).scalar_one() != backend
            assert len(connects) == 2
        finally:
            engine.dispose()


def test_only_a_connection_that_sat_idle_is_pinged(tmp_path):
    with fresh_database() as url:
        engine = make_engine(load_settings(database_url=url, data_dir=tmp_path))
        pings = []
        ping = engine.dialect.do_ping
        engine.dialect.do_ping = lambda dbapi_conn: pings.append(1) or ping(dbapi_conn)  # counted, in the test only
        try:
            for _ in range(3):
                with engine.connect() as conn:
                    conn.execute(text("SELECT 1"))
            assert pings == []
            time.sleep(PING_AFTER_IDLE_SECONDS + 0.1)
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            assert pings == [1]
            assert engine.pool.checkedin() == 1
        finally:
            engine.dispose()
