"""Fixtures of the reconciler's job tests (``db``, ``consumer``, ``clean`` and ``provider`` come
from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from outbox.handlers import registry
from outbox.reconciler import Reconciler

from .support import MODULE


@pytest.fixture
def reconcilers(clean: Any) -> Iterator[Callable[..., Reconciler]]:
    made: list[Reconciler] = []

    def make(**kw: Any) -> Reconciler:
        options: dict[str, Any] = {
            "database_url": clean.database_url,
            "redis_url": clean.redis_url,
            "namespace": clean.namespace,
            "handlers": registry(),
            "module": MODULE,
            **kw,
        }
        made.append(Reconciler(**options))
        return made[-1]

    yield make
    for r in made:
        r.close()
