"""The dashboard's ASGI app: pages, forms and who may see and do what.

Every endpoint reads or acts through ``outbox.ops`` (the CLI's own functions, so a refusal here
is the CLI's refusal) in a worker thread; the app itself holds no state but the login throttle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

import jinja2
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import pauses, sanitize, states, store
from ..exceptions import ConfigError, NotFound, OutboxError
from ..handlers import Handler
from ..ops import actions
from ..ops import inspect as ops_inspect
from ..ops.batches import batch_report
from ..ops.ordering import blocked_keys
from . import bulk, chart, queries, security, shown
from .security import Access

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
COOKIE = "outbox_session"
#: The login form's CSRF token lives in a cookie of its own: showing the form (a navigation any
#: site can start) never touches the signed-in session.
LOGIN_COOKIE = "outbox_login"
LOGIN_SECONDS = 600
#: A browser that signed in as a user keeps a token of it: its tries for that name are not held
#: back by other addresses' guesses (security.Throttle). Not a session: it opens nothing.
DEVICE_COOKIE = "outbox_device"
DEVICE_SECONDS = 30 * 86400
#: A form body larger than this is refused before it is parsed (a bulk form of 1,000 ids is ~10 KB).
MAX_FORM_BYTES = 256 * 1024

Authorize = Callable[
    [Request], "Access | tuple[str, str] | Awaitable[Access | tuple[str, str] | None] | None"
]


class Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class SecurityHeaders:
    """Adds the security headers to every response, static files and errors included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {k.lower() for k, _ in headers}
                for name, value in security.SECURITY_HEADERS.items():
                    if name.encode() not in present:
                        headers.append((name.encode(), value.encode()))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, with_headers)


class _App(Starlette):
    """Starlette with the security headers outside its error handling: its own 404, 405 and
    500 responses carry them too (a middleware added the usual way sits inside the 500's)."""

    def build_middleware_stack(self) -> ASGIApp:
        return SecurityHeaders(super().build_middleware_stack())


@dataclass
class Config:
    engine: Engine
    signer: security.Signer
    authorize: Authorize | None
    users: dict[str, security.User] | None
    secure_cookies: bool
    session_seconds: float
    handlers: Mapping[str, Handler] | None
    module: str | None
    database_url: str | None
    title: str


class Dashboard:
    def __init__(self, config: Config) -> None:
        self.c = config
        self.throttle = security.Throttle()
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(HERE / "templates")),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        self.env.filters["age"] = queries.describe_age
        self.env.filters["when"] = lambda v: v.strftime("%Y-%m-%d %H:%M:%S") if v else "-"
        self.env.filters["num"] = lambda v: f"{v:,.0f}" if isinstance(v, int | float) else v
        self.env.filters["ms"] = lambda v: "-" if v is None else f"{v * 1000:,.0f} ms"
        self.env.filters["rate"] = _rate
        self.env.filters["pretty"] = _pretty

    # -- plumbing ---------------------------------------------------------------------------------

    def routes(self) -> list[Route | Mount]:
        r = Route
        return [
            r("/", self.overview),
            r("/login", self.login, methods=["GET", "POST"]),
            r("/logout", self.logout, methods=["POST"]),
            r("/search", self.search),
            r("/rows", self.rows),
            # Ids as text, checked by _path_id: an int converter raises on thousands of digits.
            r("/rows/{row_id}", self.row),
            r("/rows/{row_id}/resolve", self.resolve, methods=["POST"]),
            r("/rows/{row_id}/skip", self.skip, methods=["POST"]),
            r("/keys", self.key),
            r("/keys/repair", self.repair, methods=["POST"]),
            r("/preview", self.preview, methods=["POST"]),
            r("/apply", self.apply, methods=["POST"]),
            r("/batches", self.batches),
            r("/batches/{batch_id}", self.batch),
            r("/blocked", self.blocked),
            r("/destinations/pause", self.pause, methods=["POST"]),
            r("/destinations/resume", self.resume, methods=["POST"]),
            Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
        ]

    def _base(self, request: Request) -> str:
        return str(request.scope.get("root_path", "")).rstrip("/")

    def _session(self, request: Request) -> dict[str, Any] | None:
        return self.c.signer.unsign(request.cookies.get(COOKIE))

    def _login_state(self, request: Request) -> dict[str, Any] | None:
        state = self.c.signer.unsign(request.cookies.get(LOGIN_COOKIE))
        return state if state is not None and state.get("login") is True else None

    def _set_session(
        self,
        request: Request,
        response: Response,
        session: dict[str, Any],
        *,
        cookie: str = COOKIE,
        seconds: float | None = None,
    ) -> None:
        response.set_cookie(
            cookie,
            self.c.signer.sign(session),
            max_age=int(self.c.session_seconds if seconds is None else seconds),
            path=self._base(request) or "/",
            secure=self.c.secure_cookies,
            httponly=True,
            samesite="strict",
        )

    async def _access(self, request: Request) -> Access | None:
        if self.c.authorize is not None:
            got = self.c.authorize(request)
            if inspect.isawaitable(got):
                got = await got
            if got is None:
                return None
            return got if isinstance(got, Access) else Access(*got)
        session = self._session(request)
        if not session or "user" not in session:
            return None
        user = (self.c.users or {}).get(session["user"])
        if user is None:  # removed from the users file since the login
            return None
        if session.get("pw") != security.password_mark(user):  # its password changed since
            return None
        if await self._read(_session_ended, str(session.get("sid", ""))):  # signed out
            return None
        # The users file decides the role on every request: a demotion takes effect at once.
        return Access(user.name, user.role, user.payloads)

    async def _guard(self, request: Request, *, act: bool = False) -> tuple[Access, dict[str, Any]]:
        """The caller's access (401/403 otherwise) and session; for a POST, its CSRF token checked."""
        access = await self._access(request)
        if access is None:
            if self.c.authorize is None and request.method == "GET":
                target = quote(request.url.path + (f"?{request.url.query}" if request.url.query else ""))
                raise Refused(303, f"{self._base(request)}/login?next={target}")
            raise Refused(401, "sign in first")
        if not access.can_read:
            raise Refused(403, f"{access.user} has no access to the outbox dashboard")
        if act and not access.can_act:
            raise Refused(403, f"{access.user} may look but not act (role {access.role})")
        session = self._session(request)
        if session is None or (self.c.authorize is not None and session.get("for") != access.user):
            # With the host's authentication, the dashboard's session (its CSRF token) belongs to
            # the user the host names: a cookie planted by another user is replaced, not used.
            session = security.new_session(seconds=self.c.session_seconds, **{"for": access.user})
        return access, session

    async def _form(self, request: Request, session: dict[str, Any]) -> dict[str, list[str]]:
        body = await _body(request)
        form = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
        _no_nul(v for values in form.values() for v in values)
        token = (form.get("csrf_token") or [""])[0] or request.headers.get("x-csrf-token")
        if not security.csrf_ok(session, token):
            raise Refused(403, "the form's CSRF token is missing or stale: reload the page and try again")
        return form

    def _page(
        self,
        request: Request,
        template: str,
        access: Access | None,
        session: dict[str, Any] | None,
        status: int = 200,
        login: dict[str, Any] | None = None,
        **context: Any,
    ) -> HTMLResponse:
        body = self.env.get_template(template).render(
            base=self._base(request),
            title=self.c.title,
            access=access,
            csrf=(session or login or {}).get("csrf", ""),
            states=states,
            actions=bulk.ACTIONS,
            **context,
        )
        response = HTMLResponse(body, status_code=status, headers={"cache-control": "no-store"})
        if session is not None and self._session(request) != session:
            self._set_session(request, response, session)
        if login is not None and self._login_state(request) != login:
            self._set_session(request, response, login, cookie=LOGIN_COOKIE, seconds=LOGIN_SECONDS)
        return response

    def _refused(self, request: Request, refused: Refused) -> Response:
        if refused.status == 303:
            return RedirectResponse(refused.message, status_code=303)
        return self._page(
            request,
            "message.html",
            None,
            None,
            status=refused.status,
            heading="Refused",
            text=refused.message,
        )

    async def _run(self, request: Request, act: bool, body: Callable[..., Any]) -> Response:
        try:
            _no_nul(request.query_params.values())
            access, session = await self._guard(request, act=act)
            form = await self._form(request, session) if request.method == "POST" else {}
            return await body(access, session, form)
        except Refused as r:
            return self._refused(request, r)
        except DBAPIError as exc:
            # Nothing was changed (the transaction rolled back); say so rather than a bare 500.
            logger.warning(
                "dashboard: the database refused a request: %s", str(exc.orig).split("\n")[0][:200]
            )
            refused = Refused(
                409, "the database refused this (nothing was changed): " + str(exc.orig).split("\n")[0][:200]
            )
            return self._refused(request, refused)

    def _read(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Awaitable[Any]:
        def go() -> Any:
            with self.c.engine.connect() as conn:
                return fn(conn, *args, **kwargs)

        return run_in_threadpool(go)

    def _write(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Awaitable[Any]:
        def go() -> Any:
            with self.c.engine.begin() as conn:
                return fn(conn, *args, **kwargs)

        return run_in_threadpool(go)

    @staticmethod
    def _by(access: Access) -> str:
        return f"{access.user} (dashboard)"

    # -- login ------------------------------------------------------------------------------------

    async def login(self, request: Request) -> Response:
        if self.c.users is None:
            return self._page(
                request,
                "message.html",
                None,
                None,
                status=404,
                heading="No login here",
                text="this dashboard is signed in to through its host application",
            )
        pending = self._login_state(request)
        if pending is None:
            if (
                request.method == "POST"
                and self.c.secure_cookies
                and request.url.scheme == "http"
                and not security.loopback(request.url.hostname)
            ):
                # The form's cookie did not come back: over plain HTTP a browser keeps Secure
                # cookies to itself, and "reload the page" would never help. To a loopback host
                # it sends them: there the form is stale (its cookie lasts ten minutes).
                return self._refused(request, Refused(403, security.PLAIN_HTTP_REFUSAL))
            pending = security.new_session(seconds=LOGIN_SECONDS, login=True)
        nxt = request.query_params.get("next", "")
        if request.method == "GET":
            return self._page(request, "login.html", None, None, login=pending, next=nxt, error=None)
        try:
            form = await self._form(request, pending)
        except Refused as r:
            return self._refused(request, r)
        name = (form.get("user") or [""])[0]
        password = (form.get("password") or [""])[0]
        nxt = (form.get("next") or [""])[0]
        # The address the server names: behind a proxy, the client's only if the server trusts
        # that proxy's forwarded header (uvicorn's forwarded_allow_ips); never read here.
        client = request.client.host if request.client else "-"
        device = self._device(request, name)
        # Counted as a failure from now until it succeeds: concurrent guesses are refused, not
        # checked together.
        admission = self.throttle.begin(name, client, device)
        if admission.refused_for > 0:
            wait = int(admission.refused_for) + 1
            if admission.why == "name":
                error = (
                    "this user name has had many failed logins: its sign-ins are checked one at a "
                    f"time; try again in {wait} s"
                )
            else:
                error = f"too many failed logins from this address: try again in {wait} s"
            page = self._page(
                request, "login.html", None, None, status=429, login=pending, next=nxt, error=error
            )
            page.headers["retry-after"] = str(wait)
            return page
        user = await run_in_threadpool(security.check_login, self.c.users, name, password)
        if user is None:
            logger.warning("dashboard login failed", extra={"user": name[:64], "client": client[:64]})
            return self._page(
                request,
                "login.html",
                None,
                None,
                status=401,
                login=pending,
                next=nxt,
                error="wrong user name or password",
            )
        self.throttle.succeeded(name, client, admission, device)
        logger.info("dashboard login", extra={"user": user.name, "role": user.role})
        replaced = self._session(request)
        if replaced and replaced.get("sid") and replaced.get("user"):
            # Signed in over another session: that one ends here, not whenever its copies expire.
            await self._write(_end_session, str(replaced["sid"]), float(replaced.get("exp", 0)))
        fresh = security.new_session(
            seconds=self.c.session_seconds, user=user.name, pw=security.password_mark(user)
        )
        # Only a path of this app: never an open redirect to another site.
        target = nxt if nxt.startswith("/") and not nxt.startswith("//") else f"{self._base(request)}/"
        response = RedirectResponse(target, status_code=303)
        self._set_session(request, response, fresh)
        response.delete_cookie(LOGIN_COOKIE, path=self._base(request) or "/")
        # A new token at each sign-in: one that failed too often (a guesser at this browser) is
        # left behind.
        known = {
            "device": user.name,
            "id": secrets.token_urlsafe(16),
            "exp": int(time.time() + DEVICE_SECONDS),
        }
        self._set_session(request, response, known, cookie=DEVICE_COOKIE, seconds=DEVICE_SECONDS)
        return response

    def _device(self, request: Request, name: str) -> str | None:
        """The token of this browser's earlier sign-in as ``name``, if it holds one."""
        known = self.c.signer.unsign(request.cookies.get(DEVICE_COOKIE))
        if known is None or known.get("device") != name or not isinstance(known.get("id"), str):
            return None
        return str(known["id"])

    async def logout(self, request: Request) -> Response:
        session = self._session(request) or {}
        try:
            await self._form(request, session)
        except Refused as r:
            return self._refused(request, r)
        if session.get("sid") and session.get("user"):
            # The cookie is signed, not stored: a copy of it would outlive the sign-out unless
            # the sign-out is recorded where every request looks.
            await self._write(_end_session, str(session["sid"]), float(session.get("exp", 0)))
        response = RedirectResponse(f"{self._base(request)}/login", status_code=303)
        response.delete_cookie(COOKIE, path=self._base(request) or "/")
        return response

    # -- pages ------------------------------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        async def body(access: Access, session: dict[str, Any], _form: Any) -> Response:
            def read(conn: Any) -> dict[str, Any]:
                from sqlalchemy import text

                from ..breaker import open_breakers
                from ..heartbeat import NO_CONSUMER_SQL, no_consumer
                from ..limits import limits as in_flight_limits
                from ..ops.ordering import blocked_summary

                counts = queries.counts(conn)
                hour = queries.last_hour(conn)
                return {
                    "counts": counts,
                    "totals": counts.totals(),
                    "estimates": queries.ESTIMATES,
                    "recent": queries.recent(conn),
                    "hour": hour,
                    "chart": chart.last_hour(hour),
                    "alerts": queries.alerts(conn),
                    "no_consumer": no_consumer(conn.execute(text(NO_CONSUMER_SQL))),
                    "paused": pauses.paused(conn),
                    "breakers": open_breakers(conn),
                    "limits": in_flight_limits(conn),
                    "blocked": blocked_summary(conn),
                }

            data = await self._read(read)
            template = "overview_body.html" if request.headers.get("hx-request") else "overview.html"
            return self._page(request, template, access, session, **data)

        return await self._run(request, False, body)

    async def search(self, request: Request) -> Response:
        async def body(access: Access, session: dict[str, Any], _form: Any) -> Response:
            q = request.query_params.get("q", "").strip()
            hits = await self._read(queries.search, q) if q else []
            exact = [h for h in hits if h.kind != "list"]
            if len(exact) == 1:
                h = exact[0]
                target = f"/rows/{h.row_id}" if h.kind == "row" else f"/keys?{urlencode({'key': h.key})}"
                return RedirectResponse(self._base(request) + target, status_code=303)
            if not exact and q:
                return RedirectResponse(
                    f"{self._base(request)}/rows?{urlencode({'key_prefix': q})}", status_code=303
                )
            return self._page(request, "search.html", access, session, q=q, hits=hits)

        return await self._run(request, False, body)

    def _filter(self, request: Request) -> queries.Filter:
        p = request.query_params
        state = p.get("state") or None
        if state is not None and state not in states.ALL:
            raise Refused(400, f"unknown state {state!r}; states are {', '.join(states.ALL)}")
        try:
            older = queries.parse_duration(p.get("older_than"))
        except ValueError as exc:
            raise Refused(400, str(exc)) from exc
        return queries.Filter(
            state=state,
            destination=p.get("destination") or None,
            older_than_seconds=older,
            error=p.get("error") or None,
            key_prefix=p.get("key_prefix") or None,
        )

    async def rows(self, request: Request) -> Response:
        async def body(access: Access, session: dict[str, Any], _form: Any) -> Response:
            f = self._filter(request)
            if f.error and not access.sees_payloads:
                # Which rows an error text matches would tell a fragment of their payloads.
                raise Refused(
                    403,
                    f"{access.user} may not filter on error texts: they may echo the payload "
                    "(role read+payloads or operate)",
                )
            after = request.query_params.get("after") or None
            try:
                page = await self._read(queries.list_page, f, after=after)
            except (ValueError, OutboxError) as exc:
                raise Refused(400, f"bad page cursor: {exc}") from exc
            if not access.sees_payloads:
                page = queries.Page([shown.withhold_row(r) for r in page.rows], page.after)
            bulk_actions = {
                states.FAILED: ["replay"],
                states.PENDING: ["cancel"],
                states.DISPATCHED: ["cancel"],
                states.UNKNOWN: ["resolve-failed"],
            }.get(f.state or "", [])
            return self._page(
                request,
                "rows.html",
                access,
                session,
                f=f,
                page=page,
                filter_query=urlencode(f.params()),
                bulk_actions=bulk_actions,
                after=after,
            )

        return await self._run(request, False, body)

    async def row(self, request: Request) -> Response:
        async def body(access: Access, session: dict[str, Any], _form: Any) -> Response:
            row_id = _path_id(request, "row_id")

            def read(conn: Any) -> dict[str, Any]:
                detail = ops_inspect.show(conn, row_id, payload=access.sees_payloads)
                assert isinstance(detail, ops_inspect.RowDetail)
                key = ops_inspect.key_steps(conn, detail.row["key"])
                extras = queries.row_extras(conn, row_id)
                batch = batch_report(conn, batch_id=extras["batch_id"]) if extras.get("batch_id") else None
                return {"detail": detail, "key": key, "extras": extras, "batch": batch}

            try:
                data = await self._read(read)
            except NotFound as exc:
                raise Refused(404, str(exc)) from exc
            d = data["detail"]
            errors = access.sees_payloads
            if not errors:
                d.row = shown.withhold_row(d.row)
                d.attempts = [shown.withhold_attempt(a) for a in d.attempts]
                data["key"] = _withhold_steps(data["key"])
            payload = sanitize.clean_json(d.payload) if d.payload is not None else None
            response = (
                sanitize.clean_json(d.row.get("response")) if d.row.get("response") is not None else None
            )
            # A field name can be a card number too ({"4111…": …}): masked like the values.
            keys = [sanitize.redact_text(str(k)) for k in d.row.get("payload_keys") or []]
            return self._page(
                request,
                "row.html",
                access,
                session,
                payload=payload,
                response=response,
                payload_keys=keys,
                history=shown.history_lines(d.history, errors=errors),
                **data,
            )

        return await self._run(request, False, body)

    async def key(self, request: Request) -> Response:
        key = request.query_params.get("key", "")

        async def body(access: Access, session: dict[str, Any], _form: Any) -> Response:
            try:
                steps = await self._read(ops_inspect.key_steps, key)
            except NotFound as exc:
                raise Refused(404, str(exc)) from exc
            if not access.sees_payloads:
                steps = _withhold_steps(steps)
            return self._page(
                request, "key.html", access, session, steps=steps, can_repair=self.c.handlers is not None
            )

        return await self._run(request, False, body)

    async def batches(self, request: Request) -> Response:
        async def body(access: Access, session: dict[str, Any], _form: Any) -> Response:
            before = request.query_params.get("before")
            listed = await self._read(queries.batches, before=parse_id(before) if before else None)
            return self._page(request, "batches.html", access, session, batches=listed)

        return await self._run(request, False, body)

    async def batch(self, request: Request) -> Response:
        async def body(access: Access, session: dict[str, Any], _form: Any) -> Response:
            batch_id = _path_id(request, "batch_id")
            try:
                report = await self._read(batch_report, batch_id=batch_id)
            except NotFound as exc:
                raise Refused(404, str(exc)) from exc
            if request.headers.get("hx-request"):
                # 286: htmx stops polling once the batch has ended.
                status = 286 if report.finished else 200
                return self._page(request, "batch_body.html", access, session, status=status, batch=report)
            return self._page(request, "batch.html", access, session, batch=report)

        return await self._run(request, False, body)

    async def blocked(self, request: Request) -> Response:
        async def body(access: Access, session: dict[str, Any], _form: Any) -> Response:
            report = await self._read(blocked_keys, limit=200)
            if not access.sees_payloads:
                report = dataclasses.replace(report, keys=[shown.withhold_blocked(k) for k in report.keys])
            return self._page(request, "blocked.html", access, session, report=report)

        return await self._run(request, False, body)

    # -- actions ----------------------------------------------------------------------------------

    async def preview(self, request: Request) -> Response:
        async def body(access: Access, session: dict[str, Any], form: dict[str, list[str]]) -> Response:
            action = (form.get("action") or [""])[0]
            if action not in bulk.ACTIONS:
                raise Refused(400, f"unknown action {action!r}")
            if form.get("id"):
                ids = _ids(form["id"])
                more = False
            else:
                f = self._filter_from_form(form)
                if f.state is None:
                    raise Refused(400, "a bulk action needs a state in its filter")
                ids, more = await self._read(queries.matching_ids, f)
                if not ids:
                    raise Refused(400, "the filter selects no row")
            try:
                plan = await self._read(bulk.preview, action, ids, more=more)
            except OutboxError as exc:
                raise Refused(400, str(exc)) from exc
            return self._page(request, "preview.html", access, session, plan=plan)

        return await self._run(request, True, body)

    def _filter_from_form(self, form: dict[str, list[str]]) -> queries.Filter:
        def one(name: str) -> str | None:
            return (form.get(name) or [""])[0] or None

        state = one("state")
        if state is not None and state not in states.ALL:
            raise Refused(400, f"unknown state {state!r}")
        try:
            older = queries.parse_duration(one("older_than"))
        except ValueError as exc:
            raise Refused(400, str(exc)) from exc
        return queries.Filter(state, one("destination"), older, one("error"), one("key_prefix"))

    async def apply(self, request: Request) -> Response:
        async def body(access: Access, session: dict[str, Any], form: dict[str, list[str]]) -> Response:
            action = (form.get("action") or [""])[0]
            ids = _ids(form.get("id", []))
            fingerprint = (form.get("fingerprint") or [""])[0]
            reason = (form.get("reason") or [""])[0]
            try:
                outcome = await self._write(
                    bulk.apply, action, ids, fingerprint=fingerprint, by=self._by(access), reason=reason
                )
            except OutboxError as exc:
                raise Refused(400, str(exc)) from exc
            logger.info(
                "dashboard %s: %s done, %s refused",
                action,
                len(outcome.done),
                len(outcome.refused),
                extra={"user": access.user, "action": action, "rows": len(ids)},
            )
            return self._page(request, "applied.html", access, session, outcome=outcome)

        return await self._run(request, True, body)

    async def resolve(self, request: Request) -> Response:
        async def body(access: Access, session: dict[str, Any], form: dict[str, list[str]]) -> Response:
            row_id = _path_id(request, "row_id")
            how = (form.get("how") or [""])[0]
            ref = (form.get("ref") or [""])[0].strip()
            reason = (form.get("reason") or [""])[0].strip()
            if not reason:
                raise Refused(400, "a reason is required: it is kept in the row's history")
            kwargs: dict[str, Any] = {}
            if how == "sent":
                kwargs["sent_ref"] = ref
            elif how == "not-sent":
                kwargs["not_sent"] = True
            elif how == "failed":
                kwargs["failed_reason"] = reason
            else:
                raise Refused(400, "choose sent (with the provider's reference), not sent, or failed")
            seen = (form.get("version") or [""])[0]

            def act(conn: Any) -> actions.ActionResult:
                # The page the operator read: the same ambiguous call, not a later one (a
                # "not sent" meant for one call must not settle another).
                now = conn.execute(_RESOLVE_VERSION, {"id": row_id}).first()
                if now is None:
                    raise NotFound(f"no outbox row with id {row_id}")
                if not seen or _version(now.unknown_since) != seen:
                    raise Stale(
                        f"row {row_id} changed since the page was loaded (it is {now.state} now, "
                        "or unknown since another time): nothing was done; reload it"
                    )
                return actions.resolve(
                    conn, row_id, by=self._by(access), reason=reason, handlers=self.c.handlers, **kwargs
                )

            try:
                result = await self._write(act)
            except OutboxError as exc:
                raise Refused(409, str(exc)) from exc
            outcome = bulk.BulkResult("resolve", done=[(row_id, result.message)])
            return self._page(request, "applied.html", access, session, outcome=outcome)

        return await self._run(request, True, body)

    async def skip(self, request: Request) -> Response:
        """Let the rows of a failed head's ordering key behind it go (``outbox skip``)."""

        async def body(access: Access, session: dict[str, Any], form: dict[str, list[str]]) -> Response:
            row_id = _path_id(request, "row_id")
            reason = (form.get("reason") or [""])[0].strip()
            try:
                result = await self._write(actions.skip, row_id, by=self._by(access), reason=reason)
            except OutboxError as exc:
                raise Refused(409, str(exc)) from exc
            outcome = bulk.BulkResult("skip", done=[(row_id, result.message)])
            return self._page(request, "applied.html", access, session, outcome=outcome)

        return await self._run(request, True, body)

    async def pause(self, request: Request) -> Response:
        async def body(access: Access, session: dict[str, Any], form: dict[str, list[str]]) -> Response:
            destination = (form.get("destination") or [""])[0]
            reason = (form.get("reason") or [""])[0].strip()
            if not destination or not reason:
                raise Refused(400, "pausing needs a destination and a reason")
            try:
                seconds = queries.parse_duration((form.get("for") or [""])[0])
            except ValueError as exc:
                raise Refused(400, str(exc)) from exc
            if seconds is not None and seconds <= 0:
                # As the CLI: a pause "for 0" would end another operator's pause, not make one.
                raise Refused(
                    400, "a pause lasts a positive duration (e.g. 15m), or leave it empty: until resumed"
                )
            known = await self._read(pauses.known_destinations)
            if destination not in known:
                raise Refused(404, f"unknown destination {destination!r}")
            p = await self._write(
                pauses.pause, destination, by=self._by(access), reason=reason, for_seconds=seconds
            )
            outcome = bulk.BulkResult("pause", done=[(0, p.describe())])
            return self._page(request, "applied.html", access, session, outcome=outcome)

        return await self._run(request, True, body)

    async def resume(self, request: Request) -> Response:
        async def body(access: Access, session: dict[str, Any], form: dict[str, list[str]]) -> Response:
            destination = (form.get("destination") or [""])[0]
            r = await self._write(pauses.resume, destination, by=self._by(access))
            said = (
                f"{destination} resumed" if r.pause or r.breaker_closed else f"{destination} was not paused"
            )
            outcome = bulk.BulkResult("resume", done=[(0, said)])
            return self._page(request, "applied.html", access, session, outcome=outcome)

        return await self._run(request, True, body)

    async def repair(self, request: Request) -> Response:
        async def body(access: Access, session: dict[str, Any], form: dict[str, list[str]]) -> Response:
            from ..ops import repair as ops_repair

            if self.c.handlers is None or self.c.database_url is None:
                raise Refused(
                    409,
                    "repair asks the provider through the handlers' lookups: "
                    "start the dashboard with MODULE (outbox dashboard myapp.handlers)",
                )
            key = (form.get("key") or [""])[0]
            confirm = (form.get("confirm") or [""])[0] == "yes"
            reason = (form.get("reason") or [""])[0].strip()

            def plan_of(conn: Any) -> tuple[Any, str]:
                plan = ops_repair.plan_repair(
                    conn, [key], handlers=self.c.handlers or {}, module=self.c.module or "module"
                )
                return plan, _repair_fingerprint(conn, plan)

            try:
                plan, fingerprint = await self._read(plan_of)
            except OutboxError as exc:
                raise Refused(400, str(exc)) from exc
            if not confirm:
                return self._page(
                    request, "repair.html", access, session, key=key, plan=plan, fingerprint=fingerprint
                )
            if not reason:
                raise Refused(400, "a reason is required: it is kept in the rows' history")
            if (form.get("fingerprint") or [""])[0] != fingerprint:
                raise Refused(
                    409,
                    f"the rows of {key} changed since the repair plan was shown: nothing was done; "
                    "preview the repair again",
                )
            results = await run_in_threadpool(
                ops_repair.execute_repair,
                self.c.database_url,
                plan,
                handlers=self.c.handlers,
                module=self.c.module or "module",
                by=self._by(access),
                reason=reason,
            )
            outcome = bulk.BulkResult(
                "repair",
                done=[(r.row_id or 0, f"{r.key}: {r.message}") for r in results if r.done],
                refused=[(r.row_id or 0, f"{r.key}: {r.message}") for r in results if not r.done],
            )
            return self._page(request, "applied.html", access, session, outcome=outcome)

        return await self._run(request, True, body)


MAX_ID = 2**63 - 1
_ID = re.compile(r"[0-9]{1,19}")


def parse_id(text: str | None) -> int | None:
    """A row or batch id as typed: ASCII digits within bigint, else None."""
    if text is None or not _ID.fullmatch(text):
        return None
    value = int(text)
    return value if 0 < value <= MAX_ID else None


def _ids(values: list[str]) -> list[int]:
    ids = [parse_id(v) for v in values]
    if any(i is None for i in ids):
        raise Refused(400, "a row id is a positive whole number (at most 2^63 - 1)")
    return [i for i in ids if i is not None]


def _path_id(request: Request, name: str) -> int:
    value = parse_id(str(request.path_params[name]))
    if value is None:
        raise Refused(404, f"no such {name.split('_')[0]}: {str(request.path_params[name])[:40]}")
    return value


def _withhold_steps(steps: ops_inspect.KeySteps) -> ops_inspect.KeySteps:
    return ops_inspect.KeySteps(steps.key, [shown.withhold_row(s) for s in steps.steps])


async def _body(request: Request) -> bytes:
    """The request's body, refused as soon as it is larger than a form may be: a body is never
    held whole in memory before its size is known."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > MAX_FORM_BYTES:
        raise Refused(413, "form too large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_FORM_BYTES:
            raise Refused(413, "form too large")
        chunks.append(chunk)
    return b"".join(chunks)


def _no_nul(values: Any) -> None:
    # PostgreSQL's text cannot hold a NUL byte: refused here rather than failing in a query.
    if any("\x00" in v for v in values):
        raise Refused(400, "a field holds a NUL character")


_SESSION_ENDED = text("SELECT EXISTS (SELECT 1 FROM outbox_dashboard_session_end WHERE sid = :sid)")


def _session_ended(conn: Any, sid: str) -> bool:
    return bool(conn.execute(_SESSION_ENDED, {"sid": sid}).scalar_one())


def _end_session(conn: Any, sid: str, exp: float) -> None:
    store.operator.end_dashboard_session(conn, sid=sid, expires_at_epoch=exp)


class Stale(OutboxError):
    """The row moved since the page that acts on it was loaded."""


_RESOLVE_VERSION = text("SELECT state, unknown_since FROM outbox_message WHERE id = :id FOR UPDATE")


def _version(at: Any) -> str:
    return at.isoformat() if at is not None else ""


_REPAIR_ROWS = text(
    """
SELECT id, state, attempts, completed_at, unknown_since, claim_token
FROM outbox_message WHERE key = :key ORDER BY id
"""
)


def _repair_fingerprint(conn: Any, plan: Any) -> str:
    """The plan as shown and every row of its keys as they were: a confirmation acts only if
    neither changed (a row failed on purpose meanwhile must not be re-run by a stale plan)."""
    import hashlib

    parts = []
    for item in plan.items:
        parts.append(f"{item.key}|{item.action}|{item.row_id}|{item.state}|{item.detail}")
        for r in conn.execute(_REPAIR_ROWS, {"key": item.key}):
            parts.append("|".join(str(v) for v in r))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _session_settings(engine: Engine) -> None:
    """Each dashboard connection: a query that runs away is cut off rather than left holding a
    connection, and no JIT (compiling the replay preview's plan is most of its time on a large
    table: docs/decisions/hot-path-costs.md). SET, not the URL's ``options``, which it would
    replace."""
    from sqlalchemy import event

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        with dbapi_connection.cursor() as cursor:
            cursor.execute("SET statement_timeout = '15s'")
            cursor.execute("SET jit = off")
        dbapi_connection.commit()


def _disposing(engine: Engine) -> Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]]:
    """The app's lifespan when it opened its engine itself: the pool is closed with the app."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await run_in_threadpool(engine.dispose)

    return lifespan


def _rate(per_second: float) -> str:
    """A rate a second: one decimal from 1/s, two significant digits below (a row a minute is
    0.017/s, a row an hour 0.00028/s: never 0.0/s when something was confirmed)."""
    return f"{per_second:,.1f}" if per_second >= 1 or per_second == 0 else f"{per_second:.2g}"


def _pretty(value: Any) -> str:
    import json

    return json.dumps(value, indent=2, sort_keys=True, default=str, ensure_ascii=False)


def create_app(
    database_url: str | None = None,
    *,
    engine: Engine | AsyncEngine | None = None,
    secret: str,
    authorize: Authorize | None = None,
    users: Mapping[str, security.User] | str | None = None,
    secure_cookies: bool = True,
    session_seconds: float = security.DEFAULT_SESSION_SECONDS,
    handlers: Mapping[str, Handler] | None = None,
    module: str | None = None,
    title: str = "outbox",
) -> Starlette:
    """The dashboard as an ASGI app, to mount (``app.mount("/outbox", create_app(...))``) or
    serve (``outbox dashboard``).

    Authentication is required: ``authorize(request) -> Access | (user, role) | None`` (the host
    app's; role ``none``, ``read`` or ``operate``; None: not signed in, 401), or ``users`` (a
    users file's text, or parsed users) for the dashboard's own login. ``secret`` signs the
    session and CSRF cookies: the same on every replica. ``secure_cookies=False`` only for plain
    HTTP in development. The login throttle counts per ``request.client``: behind a proxy, the
    hosting server decides whether a forwarded header names it (uvicorn's
    ``forwarded_allow_ips``); the app never reads one itself. ``handlers`` (the handler
    module's) let an operator's ``resolve --sent`` write the next steps of a chain and
    ``repair`` ask the provider.
    """
    from ..db import make_engine

    if (authorize is None) == (users is None):
        raise ConfigError(
            "the dashboard serves nothing without authentication: pass authorize= (the host app's) "
            "or users= (OUTBOX_DASHBOARD_USERS, a file written with `outbox dashboard hash-password`), "
            "one of the two"
        )
    if isinstance(users, str):
        users = security.parse_users(users)
    if isinstance(engine, AsyncEngine):
        # The pages read in worker threads, which an async engine cannot serve: a sync engine of
        # its own on the same database (psycopg 3 is both drivers).
        database_url = database_url or engine.url.set(drivername="postgresql+psycopg").render_as_string(
            hide_password=False
        )
        engine = None
    owned = engine is None
    if engine is None:
        if not database_url:
            raise ConfigError("no database configured: set OUTBOX_DATABASE_URL (or pass --database-url)")
        engine = make_engine(database_url, connect_args={"application_name": "outbox dashboard"})
        _session_settings(engine)
    if database_url is None:
        database_url = engine.url.render_as_string(hide_password=False)
    config = Config(
        engine=engine,
        signer=security.Signer(secret),
        authorize=authorize,
        users=dict(users) if users is not None else None,
        secure_cookies=secure_cookies,
        session_seconds=session_seconds,
        handlers=handlers,
        module=module,
        database_url=database_url,
        title=title,
    )
    dashboard = Dashboard(config)
    app = _App(routes=dashboard.routes(), lifespan=_disposing(engine) if owned else None)
    app.state.dashboard = dashboard
    return app
