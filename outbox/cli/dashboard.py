"""``outbox dashboard``: serve the web dashboard (outbox.dashboard) with uvicorn, or print a
password hash for its users file."""

from __future__ import annotations

import argparse
import getpass
import logging
import os
import sys

from .. import settings
from ..exceptions import ConfigError
from .common import add_module, describe

SECRET_ENV = "OUTBOX_DASHBOARD_SECRET"
USERS_ENV = "OUTBOX_DASHBOARD_USERS"
INSECURE_ENV = "OUTBOX_DASHBOARD_INSECURE_COOKIES"
TRUSTED_PROXIES_ENV = "OUTBOX_DASHBOARD_TRUSTED_PROXIES"
DEFAULT_PORT = 8090

logger = logging.getLogger(__name__)


def arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        f"""
        Serve the web dashboard: the overview, search by key, prefix, row id, provider reference
        or Idempotency-Key, each row's attempts and history, batches, blocked ordering keys, and
        replay / resolve / cancel / pause / repair with a preview (docs/dashboard.md).

        Nothing is served without users: {USERS_ENV} (or --users) names a file of
        `NAME ROLE HASH` lines, ROLE read, read+payloads or operate, HASH from
        `outbox dashboard --hash-password`. {SECRET_ENV} (at least 32 characters, the same on
        every replica) signs the session cookies; never on the command line. Cookies are
        Secure: behind plain HTTP (development only) set {INSECURE_ENV}=1 or
        --insecure-cookies. Behind a reverse proxy, {TRUSTED_PROXIES_ENV} names the proxies
        (addresses or networks, comma-separated) whose X-Forwarded-For and X-Forwarded-Proto
        are believed; by default none is, and the login throttle counts the proxy's address.
        To mount it in your own Starlette/FastAPI app with your own authentication, use
        outbox.dashboard.create_app(authorize=...).
        """,
    )
    add_module(
        p,
        "the handler module (e.g. myapp.handlers): resolving a row sent writes its @then steps, and "
        "repair asks the provider through the lookups",
        required=False,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--users", metavar="FILE", help=f"the users file (default ${USERS_ENV})")
    p.add_argument(
        "--insecure-cookies",
        action="store_true",
        help="cookies without Secure, for plain HTTP in development only",
    )
    p.add_argument(
        "--hash-password",
        action="store_true",
        help="read a password (from the terminal, or one line of stdin) and print its hash for the "
        "users file; serves nothing",
    )


def run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from ..dashboard.security import hash_password

    if args.hash_password:
        if sys.stdin.isatty():
            password = getpass.getpass("password: ")
            if getpass.getpass("again: ") != password:
                raise ConfigError("the two passwords differ")
        else:
            password = sys.stdin.readline().rstrip("\n")
        print(hash_password(password))
        return 0
    import uvicorn

    from ..dashboard import create_app
    from ..dashboard.security import loopback, parse_users

    users_path = args.users or os.environ.get(USERS_ENV)
    if not users_path:
        raise ConfigError(
            f"the dashboard serves nothing without users: set {USERS_ENV} (or --users) to a file of "
            "`NAME ROLE HASH` lines (hashes from `outbox dashboard --hash-password`)"
        )
    try:
        with open(users_path, encoding="utf-8") as f:
            users = parse_users(f.read(), source=users_path)
    except OSError as exc:
        raise ConfigError(f"cannot read the users file {users_path}: {exc.strerror}") from exc
    handlers = None
    if args.module:
        from ..handlers import load_module

        handlers = load_module(args.module)
    insecure = args.insecure_cookies or os.environ.get(INSECURE_ENV, "") in ("1", "true", "yes")
    app = create_app(
        cfg.require_database_url(),
        secret=os.environ.get(SECRET_ENV, ""),
        users=users,
        secure_cookies=not insecure,
        handlers=handlers,
        module=args.module,
    )
    proxies = os.environ.get(TRUSTED_PROXIES_ENV, "").strip()
    if not insecure and not proxies and not loopback(args.host):
        logger.warning(
            "serving plain HTTP on %s with Secure cookies: browsers do not send Secure cookies back "
            'over http://, so signing in fails ("the sign-in cookie did not come back") unless '
            "HTTPS is served in front (then name that proxy in %s); for local use only, set %s=1",
            args.host,
            TRUSTED_PROXIES_ENV,
            INSECURE_ENV,
        )
    print(
        f"outbox dashboard on http://{args.host}:{args.port}/ ({len(users)} user(s)"
        f"{', insecure cookies' if insecure else ''}"
        f"{f', forwarded headers trusted from {proxies}' if proxies else ''})",
        flush=True,
    )
    # uvicorn would otherwise believe X-Forwarded-For from 127.0.0.1 (or $FORWARDED_ALLOW_IPS):
    # a client behind a port forward or tunnel would name a new address per guess. Only the
    # configured proxies are trusted, and the list is uvicorn's to parse.
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        proxy_headers=bool(proxies),
        forwarded_allow_ips=proxies or None,
    )
    return 0
