"""write → relay → worker → sent, in-process, against real services."""

from __future__ import annotations

import importlib
import time

import psycopg
from helpers import worker_thread
from sqlalchemy.orm import Session

import outbox
from outbox.relay import Relay
from outbox.settings import libpq_url


def test_write_relay_worker_sent(clean, engine, provider, monkeypatch):
    monkeypatch.setenv("SHOP_PROVIDER_URL", provider.url)
    # examples.shop.handlers re-exports this module: reloading it declares the handler again.
    import outbox.demo.handlers as shop

    importlib.reload(shop)
    handlers = outbox.handlers.registry() if hasattr(outbox, "handlers") else None
    from outbox.handlers import registry

    handlers = registry()
    with Session(engine) as s, s.begin():
        for i in range(20):
            outbox.write(
                s,
                key=f"order:{i}",
                step="charge",
                destination="payments.charge",
                payload={"amount_cents": 100 + i, "currency": "EUR"},
            )
    relay = Relay(database_url=clean.database_url, redis_url=clean.redis_url, namespace=clean.namespace)
    assert relay.drain() == 20
    relay.close()
    with worker_thread(clean, threads=4, handlers=handlers):
        deadline = time.monotonic() + 20
        with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
            while time.monotonic() < deadline:
                n = conn.execute("select count(*) from outbox_message where state='sent'").fetchone()[0]
                if n == 20:
                    break
                time.sleep(0.1)
            rows = conn.execute("select state, count(*) from outbox_message group by 1").fetchall()
    assert rows == [("sent", 20)]
    stats = provider.stats()
    assert stats["charges"] == 20 and stats["double_charged"] == []
