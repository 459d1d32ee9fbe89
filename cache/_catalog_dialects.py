"""What differs between the catalog's databases, as data: dialect name -> hooks.

SQLite (one machine, several processes): WAL so readers never block the writer, a busy timeout
so writers queue instead of failing, and ``BEGIN IMMEDIATE`` for write transactions so two
writers never deadlock upgrading read locks. PostgreSQL (several machines): bounded connect
and lock waits, and advisory locks to serialize writers of the same document.
"""

from __future__ import annotations

import hashlib
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, event, text
from sqlalchemy.dialects import postgresql, sqlite

WRITE_OPTION = "ragkv_write"  # execution option: this transaction will write


@dataclass(frozen=True, slots=True)
class Dialect:
    """Hooks for one database dialect."""

    engine_kwargs: Callable[[float], dict[str, Any]]  # timeout (s) -> create_engine kwargs
    prepare: Callable[[Engine, float], None]  # install event hooks on a new engine
    insert: Callable[..., Any]  # the dialect's insert() with on_conflict_do_update
    lock: Callable[[Connection, str], None]  # serialize writers on a name, until the txn ends


def _sqlite_kwargs(timeout: float) -> dict[str, Any]:
    return {"connect_args": {"timeout": timeout, "check_same_thread": False}}


def _sqlite_prepare(engine: Engine, timeout: float) -> None:
    in_memory = engine.url.database in (None, "", ":memory:")

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        # SQLAlchemy then emits BEGIN itself (below) instead of pysqlite's implicit one.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
        if not in_memory:
            _enable_wal(cursor, timeout)
        cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        # A deferred transaction that later writes can fail with "database is locked" without
        # waiting; taking the write lock up front makes writers queue on the busy timeout.
        mode = "IMMEDIATE" if conn.get_execution_options().get(WRITE_OPTION) else "DEFERRED"
        conn.exec_driver_sql(f"BEGIN {mode}")


def _enable_wal(cursor: Any, timeout: float) -> None:
    """Switch the database to WAL (a persistent setting), waiting out other openers.

    SQLite does not call the busy handler while another connection creates the database or
    changes its journal mode, so two processes opening a new catalog at once can get "database
    is locked" at once (seen in CI); retry with backoff within the timeout instead of failing.
    """
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        try:
            if str(cursor.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
                cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            busy = "locked" in str(e) or "busy" in str(e)
            if not busy or time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.25)


def _no_lock(conn: Connection, name: str) -> None:
    """SQLite: BEGIN IMMEDIATE already admits one writer at a time."""


def _postgres_kwargs(timeout: float) -> dict[str, Any]:
    return {
        "pool_pre_ping": True,
        "connect_args": {
            "connect_timeout": max(1, int(timeout)),
            "options": f"-c lock_timeout={int(timeout * 1000)}",
        },
    }


def _postgres_prepare(engine: Engine, timeout: float) -> None:
    """Nothing to install: PostgreSQL's defaults (READ COMMITTED, MVCC) suit the catalog."""


def _postgres_lock(conn: Connection, name: str) -> None:
    key = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big", signed=True)
    conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})


DIALECTS: dict[str, Dialect] = {
    "sqlite": Dialect(_sqlite_kwargs, _sqlite_prepare, sqlite.insert, _no_lock),
    "postgresql": Dialect(_postgres_kwargs, _postgres_prepare, postgresql.insert, _postgres_lock),
}
