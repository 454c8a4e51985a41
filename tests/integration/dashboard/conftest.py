"""Fixtures of the dashboard's tests (``clean`` and ``engine`` come from tests/conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.applications import Starlette

from outbox.dashboard import create_app

from .support import SECRET, users_file


@pytest.fixture(scope="module")
def users_text() -> str:
    return users_file(olga="operate", otto="operate", rita="read", pam="read+payloads")


@pytest.fixture
def app(clean: Any, engine: Any, users_text: str) -> Starlette:
    return create_app(engine=engine, secret=SECRET, users=users_text)
