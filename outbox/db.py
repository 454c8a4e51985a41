"""Engines and raw connections, with the psycopg 3 driver whatever URL form the user has."""

from __future__ import annotations

from typing import Any

import psycopg
from sqlalchemy import Engine, create_engine

from .settings import libpq_url, normalize_database_url


def make_engine(url: str, **options: Any) -> Engine:
    options.setdefault("pool_pre_ping", True)
    return create_engine(normalize_database_url(url), **options)


def connect_raw(url: str, *, autocommit: bool = False, **options: Any) -> psycopg.Connection[Any]:
    """A plain psycopg connection, for LISTEN and for hot paths that SQLAlchemy would slow."""
    return psycopg.connect(libpq_url(url), autocommit=autocommit, **options)
