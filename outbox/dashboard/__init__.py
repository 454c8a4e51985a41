"""The web dashboard: an ASGI app (Starlette, Jinja2 templates, htmx shipped in the package) to
look at the outbox and act on it, mountable in a host app or served by ``outbox dashboard``.

    app.mount("/outbox", outbox.dashboard.create_app(DATABASE_URL, secret=..., authorize=...))

See docs/dashboard.md. Importing this needs the ``dashboard`` extra (starlette, jinja2; uvicorn
to serve it standalone).
"""

from __future__ import annotations

from .app import create_app
from .security import Access, hash_password

__all__ = ["Access", "create_app", "hash_password"]
