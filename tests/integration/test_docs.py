"""Every fenced code block of README.md and docs/*.md is exercised against the real code.

* ``python`` blocks run in order, one namespace per page, against the test database: ``engine``
  (and ``async_engine``) stand for the application's own engines, which the pages tell the reader
  to bring. A block that imports an optional library that is not installed (FastAPI) is compiled
  instead. Every python block, run or compiled, is also checked against the API: each name
  imported from ``outbox``/``reconciler``/``relay`` exists, each ``outbox.X`` attribute exists,
  calls of our functions bind to their signatures, and attributes read from a parameter
  annotated with one of our classes (``d: Delivery``, ``row: AlertRow``) exist on that class.
  After a page ran, a check per page drives what it defined: handlers against the provider
  simulator through the real consumer, lookups, the async write, the alert hook.
  A ``python`` block whose first line is ``# file: NAME`` is a file of a small project instead
  (docs/testing.md): the page's files are written to a directory and the project's own tests
  run there with pytest, in a subprocess, against a database the plugin makes on the test server.
* ``pycon`` blocks are doctests (their output and tracebacks are compared).
* ``sh`` / ``console`` blocks: each ``outbox …`` command line is parsed by the real argument
  parser, including the subcommands other modules plug in (``kubectl exec … -- outbox …`` too);
  ``OUTBOX_*`` assignments must name a real variable with a valid value; ``make`` targets and the
  files of ``kubectl -f`` must exist.
* ``sql`` blocks run in a transaction that is rolled back; state literals must be real states.
* ``yaml`` blocks are compose services: their ``outbox`` commands are parsed as above, their
  ``OUTBOX_*`` variables checked.
* ``conf`` blocks are redis.conf lines; each directive must be known to the test Redis.
* ``mermaid`` blocks are not run; a state diagram must name exactly the real states.
  ``text`` blocks are skipped.

Any other info string, or none, fails the suite.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import dataclasses
import doctest
import importlib
import importlib.util
import inspect
import io
import itertools
import json
import re
import shlex
import threading
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import redis
from helpers import free_port, run_user_project
from sqlalchemy import Engine, String, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import outbox
from outbox import aio, cli, policy, settings, states
from outbox.consumer import Deliverer, DeliveryResult
from outbox.handlers import Deliveries, Delivery, Handler, close_http_clients
from outbox.settings import async_database_url, libpq_url

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
#: The pages README.md links to; each must exist.
PAGES = (
    "quickstart.md",
    "guarantee.md",
    "handlers.md",
    "chains.md",
    "payloads.md",
    "ordering.md",
    "timings.md",
    "configuration.md",
    "production.md",
    "runbook.md",
    "not-a-queue.md",
    "testing.md",
    "dashboard.md",
)
OWN_PACKAGES = ("outbox",)
#: Blocks importing one of these (or a module inside it) are compiled and API-checked when it is
#: not installed. The OTLP exporter is what production.md's tracing set-up names; the suite
#: installs only the SDK (and must not set a tracer provider in its own process anyway).
OPTIONAL_MODULES = frozenset({"fastapi", "opentelemetry.exporter.otlp"})
#: Variables a page may name that the processes do not read (the test suite's own).
TEST_VARIABLES = frozenset({"OUTBOX_TEST", "OUTBOX_TEST_DATABASE_URL", "OUTBOX_TEST_REDIS_URL"})
#: Shell commands a block may use besides `outbox`; their arguments are not checked.
OTHER_COMMANDS = frozenset({"pip", "jq", "redis-cli", "psql", "docker", "curl", "export", "make", "python"})

RUN_LANGUAGES = frozenset({"python", "pycon", "sh", "console", "sql", "conf", "yaml", "mermaid"})
SKIPPED_LANGUAGES = frozenset({"text"})


# -- collecting the blocks ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})(.*)$")


def blocks_of(path: Path) -> list[Block]:
    page = str(path.relative_to(ROOT))
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, info = len(match.group(1)), match.group(2), match.group(3).strip()
        start, body = i, []
        i += 1
        while i < len(lines):
            stripped = lines[i].strip()
            if stripped.startswith(fence) and stripped.strip(fence[0]) == "":
                break
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        else:
            raise AssertionError(f"{page}:{start + 1}: code fence never closed")
        lang = info.split()[0].lower() if info else ""
        found.append(Block(page, start + 1, lang, "\n".join(body) + "\n"))
        i += 1
    return found


def page_paths() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def all_blocks() -> list[Block]:
    return [b for p in page_paths() for b in blocks_of(p)]


def blocks(*langs: str) -> list[Block]:
    return [b for b in all_blocks() if b.lang in langs]


def _ids(items: list[Block]) -> list[str]:
    return [b.where for b in items]


# -- the API check -----------------------------------------------------------------------------------


def _own(obj: object) -> bool:
    module = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    return isinstance(module, str) and module.split(".")[0] in OWN_PACKAGES


def _attributes_of(cls: type) -> set[str]:
    names = set(dir(cls))
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    for klass in cls.__mro__:
        names |= set(getattr(klass, "__annotations__", {}))
    return names


class ApiChecker(ast.NodeVisitor):
    """Checks the names a block takes from our packages; seeded with what earlier blocks of the
    page defined, so that ``charge.lookup`` or ``outbox.write`` in a later block are checked too."""

    def __init__(self, where: str, namespace: dict[str, Any]) -> None:
        self.where = where
        self.problems: list[str] = []
        #: local name -> module, class or function of ours
        self.aliases: dict[str, Any] = {}
        #: local name -> our class its value is an instance of
        self.typed: list[dict[str, type]] = [{}]
        #: functions earlier blocks defined, whose return annotations name our classes
        self.functions = {n: v for n, v in namespace.items() if isinstance(v, types.FunctionType)}
        for name, value in namespace.items():
            if isinstance(value, type | types.ModuleType | types.FunctionType) and _own(value):
                self.aliases[name] = value
            elif _own(type(value)) and not isinstance(value, types.ModuleType):
                self.typed[0][name] = type(value)

    def problem(self, node: ast.AST, message: str) -> None:
        self.problems.append(f"{self.where} (block line {getattr(node, 'lineno', '?')}): {message}")

    # imports

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] not in OWN_PACKAGES:
                continue
            try:
                module = importlib.import_module(alias.name)
            except ImportError as exc:
                self.problem(node, f"import {alias.name}: {exc}")
                continue
            if alias.asname:
                self.aliases[alias.asname] = module
            else:
                top = alias.name.split(".")[0]
                self.aliases[top] = importlib.import_module(top)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module or node.module.split(".")[0] not in OWN_PACKAGES:
            return
        try:
            module = importlib.import_module(node.module)
        except ImportError as exc:
            self.problem(node, f"from {node.module} import …: {exc}")
            return
        for alias in node.names:
            if hasattr(module, alias.name):
                self.aliases[alias.asname or alias.name] = getattr(module, alias.name)
                continue
            try:
                self.aliases[alias.asname or alias.name] = importlib.import_module(
                    f"{node.module}.{alias.name}"
                )
            except ImportError:
                self.problem(node, f"{node.module} has no name {alias.name!r}")

    # attribute chains

    def _chain(self, node: ast.expr) -> list[str] | None:
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name):
            parts.append(node.id)
            return parts[::-1]
        return None

    def _typed(self, name: str) -> type | None:
        for scope in reversed(self.typed):
            if name in scope:
                return scope[name]
        return None

    def resolve(self, node: ast.expr, *, report: bool = True) -> Any:
        """The object of ours an expression names, or None when it is not ours or not static."""
        chain = self._chain(node)
        if not chain:
            return None
        root, rest = chain[0], chain[1:]
        cls = self._typed(root)
        if cls is not None:
            if rest and rest[0] not in _attributes_of(cls):
                if report:
                    self.problem(node, f"{root}.{rest[0]}: {cls.__name__} has no attribute {rest[0]!r}")
                return None
            return None  # an instance attribute: nothing static to follow
        obj = self.aliases.get(root)
        if obj is None:
            return None
        path = root
        for part in rest:
            if not isinstance(obj, type | types.ModuleType):
                return None
            if not hasattr(obj, part):
                if isinstance(obj, types.ModuleType):
                    with contextlib.suppress(ImportError):
                        obj = importlib.import_module(f"{obj.__name__}.{part}")
                        path = f"{path}.{part}"
                        continue
                if report:
                    self.problem(node, f"{path}.{part} does not exist")
                return None
            obj = getattr(obj, part)
            path = f"{path}.{part}"
        return obj

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if self._chain(node) is not None:
            self.resolve(node)
        else:
            self.generic_visit(node)

    # calls

    def visit_Call(self, node: ast.Call) -> None:
        target = self.resolve(node.func)
        if (
            target is not None
            and callable(target)
            and _own(target)
            and not any(isinstance(a, ast.Starred) for a in node.args)
            and all(k.arg is not None for k in node.keywords)
        ):
            try:
                signature = inspect.signature(target)
            except (TypeError, ValueError):
                signature = None
            if signature is not None:
                try:
                    signature.bind(*[None] * len(node.args), **{k.arg: None for k in node.keywords if k.arg})
                except TypeError as exc:
                    self.problem(node, f"{ast.unparse(node.func)}(…) does not match its signature: {exc}")
        for child in [*node.args, *(k.value for k in node.keywords)]:
            self.visit(child)
        if not isinstance(node.func, ast.Name | ast.Attribute) or self._chain(node.func) is None:
            self.visit(node.func)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        value = node.value.value if isinstance(node.value, ast.Await) else node.value
        if isinstance(value, ast.Call) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            self._type_from_call(node.targets[0].id, value)

    def _type_from_call(self, name: str, call: ast.Call) -> None:
        target = self.resolve(call.func, report=False)
        if target is None and isinstance(call.func, ast.Name):
            # A function an earlier block of the page defined, e.g. `mark_paid` -> outbox.Written.
            target = self.functions.get(call.func.id)
        if isinstance(target, type) and _own(target):
            self.typed[-1][name] = target
        elif callable(target):
            with contextlib.suppress(Exception):
                returned = typing.get_type_hints(target).get("return")
                if isinstance(returned, type) and _own(returned):
                    self.typed[-1][name] = returned

    # functions: parameters annotated with our classes, handlers

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for decorator in node.decorator_list:
            self.visit(decorator)
        scope: dict[str, type] = {}
        for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
            if arg.annotation is not None:
                self.visit(arg.annotation)
                cls = self.resolve(arg.annotation, report=False)
                if isinstance(cls, type) and _own(cls):
                    scope[arg.arg] = cls
        if node.returns is not None:
            self.visit(node.returns)
        self.typed.append(scope)
        for statement in node.body:
            self.visit(statement)
        self.typed.pop()
        for decorator in node.decorator_list:
            factory = decorator.func if isinstance(decorator, ast.Call) else decorator
            if self.resolve(factory, report=False) is outbox.handler:
                self.typed[-1][node.name] = Handler
                self.aliases.pop(node.name, None)

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function


def check_api(source: str, where: str, namespace: dict[str, Any]) -> None:
    checker = ApiChecker(where, namespace)
    checker.visit(ast.parse(source))
    assert not checker.problems, "the block does not match the API:\n" + "\n".join(checker.problems)


# -- running a page's python ---------------------------------------------------------------------------


def _imported_modules(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _optional(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in OPTIONAL_MODULES)


@dataclass
class PageRun:
    namespace: dict[str, Any]
    executed: list[str] = field(default_factory=list)
    compiled_only: list[str] = field(default_factory=list)
    #: every Handler object the page's blocks bound, in order (a later block may redefine one)
    handlers: list[Handler] = field(default_factory=list)

    def handler(self, destination: str, index: int = 0) -> Handler:
        matching = [h for h in self.handlers if h.destination == destination]
        assert len(matching) > index, f"the page declares no handler #{index + 1} for {destination}"
        return matching[index]


def run_python_block(block: Block, run: PageRun) -> None:
    tree = ast.parse(block.code, filename=block.where)
    check_api(block.code, block.where, run.namespace)
    missing = {m for m in _imported_modules(tree) if not _installed(m)}
    unknown = sorted(m for m in missing if not _optional(m))
    assert not unknown, f"{block.where}: imports modules that do not exist: {unknown}"
    ast.increment_lineno(tree, block.line)
    code = compile(tree, str(ROOT / block.page), "exec", dont_inherit=True)
    if missing:
        run.compiled_only.append(block.where)
        return
    exec(code, run.namespace)
    run.executed.append(block.where)


def run_pycon_block(block: Block, run: PageRun) -> None:
    parser = doctest.DocTestParser()
    test = parser.get_doctest(block.code, run.namespace, block.where, str(ROOT / block.page), block.line)
    assert test.examples, f"{block.where}: a pycon block without >>> lines"
    check_api("\n".join(e.source for e in test.examples), block.where, run.namespace)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report = io.StringIO()
    runner.run(test, out=report.write, clear_globs=False)
    run.namespace.update(test.globs)
    assert runner.failures == 0, f"{block.where}: the doctest fails:\n{report.getvalue()}"
    run.executed.append(block.where)


_PROJECT_FILE = re.compile(r"# file: ([\w.]+\.py)\n")


def project_file(block: Block) -> str | None:
    """The file a python block is, when its first line names one (``# file: conftest.py``)."""
    match = _PROJECT_FILE.match(block.code)
    return match.group(1) if match and block.lang == "python" else None


def run_page(page: str, seeds: dict[str, Any]) -> PageRun:
    path = ROOT / page
    run = PageRun({"__name__": "docs_" + re.sub(r"\W", "_", path.stem), **seeds})
    for block in blocks_of(path):
        if project_file(block):
            continue
        if block.lang == "python":
            run_python_block(block, run)
        elif block.lang == "pycon":
            run_pycon_block(block, run)
        else:
            continue
        for value in run.namespace.values():
            if isinstance(value, Handler) and all(value is not h for h in run.handlers):
                run.handlers.append(value)
    return run


# -- helpers the page checks use ---------------------------------------------------------------------


class Shop:
    """What the page checks need: the test services, the provider simulator, one consumer."""

    def __init__(self, services: Any, engine: Engine, provider: Any) -> None:
        self.services = services
        self.engine = engine
        self.provider = provider
        self._consumers: list[Deliverer] = []
        #: The deliveries lookups get, as the reconciler builds them.
        self._lookups = Deliveries(send_bound=False)

    def write(self, key: str, step: str, destination: str, payload: dict[str, Any]) -> int:
        with Session(self.engine) as s, s.begin():
            return outbox.write(s, key=key, step=step, destination=destination, payload=payload).id

    def write_validated(self, key: str, step: str, destination: str, payload: dict[str, Any]) -> int:
        with Session(self.engine) as s, s.begin():
            return outbox.write(
                s, key=key, step=step, destination=destination, payload=payload, validate=True
            ).id

    def deliver(self, handler: Handler, row_id: int) -> DeliveryResult:
        consumer = Deliverer(self.services.database_url, {handler.destination: handler})
        self._consumers.append(consumer)
        return consumer.deliver(row_id, handler.destination)

    def row(self, row_id: int) -> dict[str, Any]:
        with psycopg.connect(libpq_url(self.services.database_url)) as conn:
            cur = conn.execute("SELECT * FROM outbox_message WHERE id = %s", (row_id,))
            names = [c.name for c in cur.description or []]
            found = cur.fetchone()
            assert found is not None, f"no outbox row {row_id}"
            return dict(zip(names, found, strict=True))

    def rows(self, where: str = "true", params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with psycopg.connect(libpq_url(self.services.database_url)) as conn:
            return conn.execute(
                f"SELECT key, step, destination, state FROM outbox_message WHERE {where} ORDER BY id", params
            ).fetchall()

    def rows_id(self, key: str, step: str) -> int:
        with psycopg.connect(libpq_url(self.services.database_url)) as conn:
            found = conn.execute(
                "SELECT id FROM outbox_message WHERE key = %s AND step = %s", (key, step)
            ).fetchone()
            assert found is not None, f"no outbox row {key}:{step}"
            return int(found[0])

    def delivery(self, handler: Handler, row_id: int) -> Delivery:
        row = self.row(row_id)
        assert row["destination"] == handler.destination
        return self._lookups.delivery(
            handler,
            id=row_id,
            key=row["key"],
            step=row["step"],
            payload=row["payload"],
            attempt=max(row["attempts"], 1),
            deadline=row["deadline"],
            payload_version=row["payload_version"],
            asynchronous=aio.is_async(handler.lookup_fn),
        )

    def close(self) -> None:
        for consumer in self._consumers:
            consumer.close()
        self._lookups.close()
        close_http_clients()


def charge_scenario(shop: Shop, charge: Handler, key: str) -> str:
    """A documented charging handler (sync or async) charges once, records the reference, and its
    lookup finds the charge it made (and nothing for a key never charged)."""
    destination = charge.destination
    row_id = shop.write(
        key,
        "charge",
        destination,
        {"amount_cents": 1250, "currency": "EUR", "email": "ada@example.com"},
    )
    assert shop.deliver(charge, row_id) is DeliveryResult.SENT
    ref = shop.row(row_id)["provider_ref"]
    assert ref and ref.startswith("ch_")
    assert shop.deliver(charge, row_id) is DeliveryResult.EMPTY, "a second delivery must be an empty run"
    if charge.lookup_fn is not None:
        found = aio.call(charge.lookup_fn, shop.delivery(charge, row_id), timeout_seconds=30)
        assert isinstance(found, outbox.Confirmed) and found.ref == ref
        other = shop.write(f"{key}-never", "charge", destination, {"amount_cents": 1, "currency": "EUR"})
        assert aio.call(charge.lookup_fn, shop.delivery(charge, other), timeout_seconds=30) is None
    assert shop.provider.stats()["effects"].get(f"{key}:charge") == 1
    return ref


@contextlib.contextmanager
def webhook_receiver() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    received: list[dict[str, Any]] = []

    class Receive(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            received.append(json.loads(self.rfile.read(length)))
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receive)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


# -- the pages' python, run and then driven ------------------------------------------------------------


class _ReadmeBase(DeclarativeBase):
    pass


class _ReadmeOrder(_ReadmeBase):
    """The `order` README's first block adds: any mapped object of the application."""

    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(16), default="paid")


def check_readme(run: PageRun, shop: Shop) -> None:
    assert shop.rows() == [("order:1", "charge", "payments.charge", "pending")]
    charge = run.handler("payments.charge")
    assert shop.deliver(charge, 1) is DeliveryResult.SENT
    assert shop.row(1)["provider_ref"].startswith("ch_")


def check_quickstart(run: PageRun, shop: Shop) -> None:
    from outbox.relay import Relay

    ns = run.namespace
    assert ns["written"] == outbox.Written(1, True)
    assert shop.rows() == [("order:1", "charge", "payments.charge", "pending")]
    services = shop.services
    relay = Relay(
        database_url=services.database_url, redis_url=services.redis_url, namespace=services.namespace
    )
    try:
        assert relay.drain() == 1
    finally:
        relay.close()
    assert shop.rows() == [("order:1", "charge", "payments.charge", "dispatched")]
    charge = run.handler("payments.charge")
    assert shop.deliver(charge, 1) is DeliveryResult.SENT
    ref = shop.row(1)["provider_ref"]
    found = charge.lookup_fn(shop.delivery(charge, 1)) if charge.lookup_fn else None
    assert found is not None and found.ref == ref
    charge_scenario(shop, charge, "order:quickstart")

    # The FastAPI part: mark_paid through AsyncSession and write_async, twice (a retried request).
    with Session(shop.engine) as s, s.begin():
        order = ns["Order"](amount_cents=500, currency="EUR")
        s.add(order)
        s.flush()
        order_id = order.id

    async def pay_twice() -> tuple[outbox.Written, outbox.Written]:
        try:
            async with ns["SessionLocal"]() as session:
                first = await ns["mark_paid"](session, order_id)
            async with ns["SessionLocal"]() as session:
                second = await ns["mark_paid"](session, order_id)
            return first, second
        finally:
            await ns["async_engine"].dispose()

    first, second = asyncio.run(pay_twice())
    assert first.created and not second.created and first.id == second.id
    assert shop.rows("key = %s", (f"order:{order_id}",)) == [
        (f"order:{order_id}", "charge", "payments.charge", "pending")
    ]


def check_handlers(run: PageRun, shop: Shop) -> None:
    from outbox import middleware

    # The page's middleware is on the list the worker's broker takes, and off it after the page.
    try:
        assert [type(m).__name__ for m in middleware.added()] == ["SlowMessageLog"]
    finally:
        middleware.clear()
    # The first handler module: charge, lookup, and a declined card.
    charge = run.handler("payments.charge", 0)
    charge_scenario(shop, charge, "order:7")
    declined = shop.write("order:8", "charge", "payments.charge", {"amount_cents": -1, "currency": "EUR"})
    assert shop.deliver(charge, declined) is DeliveryResult.FAILED
    assert "card declined" in shop.row(declined)["last_error"]

    # An async handler and lookup: the same scenario through an AsyncClient.
    capture = run.handler("payments.capture")
    assert capture.is_async and aio.is_async(capture.lookup_fn)
    charge_scenario(shop, capture, "order:12")

    # classify=: a throttled 400 is retried, another 400 fails, a 503 keeps the default (retry).
    sms = run.handler("sms.send")
    request = httpx.Request("POST", "https://api.sms.example/v2/messages")

    def status_error(code: int, headers: dict[str, str] | None = None) -> httpx.HTTPStatusError:
        response = httpx.Response(code, headers=headers, request=request)
        return httpx.HTTPStatusError(f"HTTP {code}", request=request, response=response)

    assert (
        policy.decide_exception(sms, status_error(400, {"X-Error-Code": "throttled"})).outcome
        is policy.Outcome.RETRY
    )
    assert policy.decide_exception(sms, status_error(400)).outcome is policy.Outcome.FAILED
    assert policy.decide_exception(sms, status_error(503)).outcome is policy.Outcome.RETRY

    # RetryableError: an unreachable SMTP server means nothing was sent; the row is retried.
    receipt = run.handler("mail.receipt")
    row_id = shop.write("order:9", "receipt", "mail.receipt", {"to": "ada@example.com", "text": "Thank you"})
    assert shop.deliver(receipt, row_id) is DeliveryResult.PENDING
    assert "SMTP server unreachable" in shop.row(row_id)["last_error"]

    # Chaining: recording the charge sent writes the receipt step in the same statement.
    chained = run.handler("payments.charge", 1)
    ref = charge_scenario(shop, chained, "order:10")
    assert shop.row(shop.rows_id("order:10", "receipt"))["parent_id"] == shop.rows_id("order:10", "charge")
    # A certain failure writes the compensation instead.
    declined = shop.write(
        "order:11", "charge", "payments.charge", {"amount_cents": -1, "email": "bo@example.com"}
    )
    assert shop.deliver(chained, declined) is DeliveryResult.FAILED
    assert shop.rows("key = %s", ("order:11",)) == [
        ("order:11", "charge", "payments.charge", "failed"),
        ("order:11", "declined-mail", "mail.receipt", "pending"),
    ]
    assert shop.rows("key = %s AND step = 'receipt'", ("order:10",)) == [
        ("order:10", "receipt", "mail.receipt", "pending")
    ]
    with Session(shop.engine) as s:
        payload = s.execute(
            text("SELECT payload FROM outbox_message WHERE key = 'order:10' AND step = 'receipt'")
        ).scalar_one()
    assert ref in payload["text"] and payload["to"] == "ada@example.com"


def check_chains(run: PageRun, shop: Shop) -> None:
    from outbox.reconciler.jobs.batches import finish_batches

    # The chain: each confirmed step writes the next in its record; every step is called once.
    issue, export, notify = (run.handler(d) for d in ("billing.issue", "accounting.post", "mail.notify"))
    assert shop.deliver(issue, shop.rows_id("invoice:7", "issue")) is DeliveryResult.SENT
    export_id = shop.rows_id("invoice:7", "export")
    assert shop.row(export_id)["via"] == "then"
    assert (
        shop.row(export_id)["payload"]["number"]
        == shop.row(shop.rows_id("invoice:7", "issue"))["provider_ref"]
    )
    assert shop.deliver(export, export_id) is DeliveryResult.SENT
    assert shop.deliver(notify, shop.rows_id("invoice:7", "notify")) is DeliveryResult.SENT
    assert shop.rows("key = %s", ("invoice:7",)) == [
        ("invoice:7", step, destination, "sent")
        for step, destination in (
            ("issue", "billing.issue"),
            ("export", "accounting.post"),
            ("notify", "mail.notify"),
        )
    ]
    effects = shop.provider.stats()["effects"]
    assert [effects.get(f"invoice:7:{s}") for s in ("issue", "export", "notify")] == [1, 1, 1]
    # A refused invoice writes its compensation instead.
    refused = shop.write("invoice:8", "issue", "billing.issue", {"invoice": 8, "amount_cents": -1})
    assert shop.deliver(issue, refused) is DeliveryResult.FAILED
    assert [r[1] for r in shop.rows("key = %s", ("invoice:8",))] == ["issue", "issue-failed"]
    # The batch: its then row once every chunk is sent.
    chunk = run.handler("crm.import")
    for n in range(3):
        assert shop.deliver(chunk, shop.rows_id("import:2026-12-01", f"chunk-{n}")) is DeliveryResult.SENT
    with psycopg.connect(libpq_url(shop.services.database_url), autocommit=True) as conn:
        assert finish_batches(conn) == {"then": 1, "written": 1}
    report = shop.row(shop.rows_id("import:2026-12-01", "report"))
    assert report["payload"] == {"import": "2026-12-01", "chunks": 3} and report["via"] == "batch_then"


def check_payloads(run: PageRun, shop: Shop) -> None:
    charge = run.handler("payments.charge")
    old, new = shop.rows_id("order:41", "charge"), shop.rows_id("order:42", "charge")
    # Written before release 2's handler was imported: version 1; after: version 2.
    assert (shop.row(old)["payload_version"], shop.row(new)["payload_version"]) == (1, 2)
    assert shop.row(old)["payload"] == {"amount": 12}
    assert shop.deliver(charge, old) is DeliveryResult.SENT
    assert shop.deliver(charge, new) is DeliveryResult.SENT
    assert shop.provider.stats()["effects"] == {"order:41:charge": 1, "order:42:charge": 1}
    assert run.namespace["amount_in_cents"]({"amount": 12}) == {"amount_cents": 1200}
    with pytest.raises(outbox.InvalidMessage, match="amount_cents"):
        shop.write_validated("order:43", "charge", "payments.charge", {"amount": 12})


def check_ordering(run: PageRun, shop: Shop) -> None:
    update = run.handler("crm.update")
    first = shop.rows_id("customer:7:change:1", "crm")
    second = shop.rows_id("customer:7:change:2", "crm")
    assert shop.row(second)["ordering_key"] == "customer:7"
    # The second change is not claimed while the first is not settled, then it is.
    assert shop.deliver(update, second) is DeliveryResult.EMPTY
    assert shop.deliver(update, first) is DeliveryResult.SENT
    assert shop.deliver(update, second) is DeliveryResult.SENT
    assert list(shop.provider.stats()["effects"]) == ["customer:7:change:1:crm", "customer:7:change:2:crm"]
    assert run.handler("crm.tag").on_failed_head == "skip"


def check_timings(run: PageRun, shop: Shop) -> None:
    rows = shop.rows()
    assert ("order:43", "charge", "payments.charge", "pending") in rows
    assert all(r[0] != "order:44" for r in rows), "the naive deadline must not have written a row"


def check_flow_control(run: PageRun, shop: Shop) -> None:
    handler = run.namespace["send"]
    assert handler.destination == "mail.send" and handler.max_in_flight == 10
    paced = run.namespace["charge"]
    assert paced.destination == "payments.charge" and paced.max_calls_per_second == 50
    assert paced.max_in_flight is None and paced.idempotent
    written = shop.row(1)
    assert (written["key"], written["priority"], written["fairness_key"]) == ("reset:7", 1, "tenant:42")


def check_not_a_queue(run: PageRun, shop: Shop) -> None:
    with shop.engine.begin() as conn:
        conn.execute(text("CREATE TABLE users (id bigint PRIMARY KEY, email text UNIQUE NOT NULL)"))
        conn.execute(
            text("CREATE TABLE password_resets (user_id bigint NOT NULL, token_sha256 text NOT NULL)")
        )
        conn.execute(text("INSERT INTO users VALUES (1, 'ada@example.com')"))
    try:
        run.namespace["request_password_reset"]("ada@example.com")
        run.namespace["request_password_reset"]("nobody@example.com")
        rows = shop.rows()
        assert len(rows) == 1 and rows[0][1:] == ("mail", "mail.password_reset", "pending")
        assert shop.row(1)["payload"]["to"] == "ada@example.com"
        assert shop.row(1)["deadline"] is not None
    finally:
        with shop.engine.begin() as conn:
            conn.execute(text("DROP TABLE IF EXISTS password_resets, users"))


def check_runbook(run: PageRun, shop: Shop) -> None:
    from outbox.alerts import AlertRow

    received = run.namespace["_received"]
    row = AlertRow(
        id=7,
        key="order:7",
        step="charge",
        destination="payments.charge",
        state="failed",
        reason="x",
        age=12.5,
    )
    run.namespace["page_oncall"](row)
    assert received == [
        {
            "summary": "outbox order:7:charge on payments.charge is failed",
            "details": "x",
            "outbox_id": 7,
            "waiting_seconds": 12,
        }
    ]


def check_dashboard(run: PageRun, shop: Shop) -> None:
    from starlette.testclient import TestClient

    client = TestClient(run.namespace["app"], base_url="https://testserver", follow_redirects=False)
    assert client.get("/outbox/").status_code == 401
    reader = client.get("/outbox/", headers={"x-forwarded-user": "rita"})
    assert reader.status_code == 200 and "rita" in reader.text
    token = re.search(r'name="csrf_token" value="([^"]+)"', reader.text).group(1)  # type: ignore[union-attr]
    form = {"action": "cancel", "id": "1", "csrf_token": token}
    assert client.post("/outbox/preview", data=form, headers={"x-forwarded-user": "rita"}).status_code == 403
    # The token is bound to its user: rita's is refused for olga, olga's own goes.
    assert client.post("/outbox/preview", data=form, headers={"x-forwarded-user": "olga"}).status_code == 403
    page = client.get("/outbox/", headers={"x-forwarded-user": "olga"})
    form["csrf_token"] = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)  # type: ignore[union-attr]
    olga = client.post("/outbox/preview", data=form, headers={"x-forwarded-user": "olga"})
    assert olga.status_code == 200 and "Nothing has been done yet" in olga.text


#: Page -> the check that drives what its python defined (pages without python need none).
PAGE_CHECKS: dict[str, Callable[[PageRun, Shop], None]] = {
    "README.md": check_readme,
    "docs/quickstart.md": check_quickstart,
    "docs/handlers.md": check_handlers,
    "docs/chains.md": check_chains,
    "docs/payloads.md": check_payloads,
    "docs/ordering.md": check_ordering,
    "docs/timings.md": check_timings,
    "docs/flow-control.md": check_flow_control,
    "docs/not-a-queue.md": check_not_a_queue,
    "docs/runbook.md": check_runbook,
    "docs/dashboard.md": check_dashboard,
}


def python_pages() -> list[str]:
    return sorted({b.page for b in blocks("python", "pycon") if not project_file(b)})


def project_pages() -> list[str]:
    return sorted({b.page for b in blocks("python") if project_file(b)})


def _database_names(url: str) -> set[str]:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        return {r[0] for r in conn.execute("SELECT datname FROM pg_database").fetchall()}


@pytest.mark.parametrize("page", project_pages())
def test_project_pages_pass_their_own_tests(page: str, clean: Any, engine: Engine, tmp_path: Path) -> None:
    """The page's files, as a user's project, run by pytest on the plugin: every test passes."""
    files: dict[str, list[str]] = {}
    for block in blocks_of(ROOT / page):
        name = project_file(block)
        if name:
            check_api(block.code, block.where, {})
            files.setdefault(name, []).append(block.code)
    for name, parts in files.items():
        (tmp_path / name).write_text("\n\n".join(parts), encoding="utf-8")
    tests = sum(
        len(re.findall(r"^def test_", "".join(parts), flags=re.MULTILINE))
        for name, parts in files.items()
        if name.startswith("test_")
    )
    assert tests, f"{page}: the project has no tests"
    # The user's own database: the plugin must leave it alone and clean up what it makes.
    with Session(engine) as s, s.begin():
        outbox.write(s, key="mine:1", step="charge", destination="payments.charge", payload={})
    before = _database_names(clean.database_url)
    returncode, out = run_user_project(tmp_path, OUTBOX_TEST_DATABASE_URL=clean.database_url)
    assert returncode == 0 and re.search(rf"\b{tests} passed in ", out), f"{page}:\n{out}"
    assert _database_names(clean.database_url) == before, "the plugin left a database behind"
    with engine.connect() as conn:
        assert conn.execute(text("SELECT key FROM outbox_message")).scalars().all() == ["mine:1"]


@pytest.mark.parametrize("page", python_pages())
def test_python_blocks_run(page: str, clean: Any, engine: Engine, provider: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("PAYMENTS_API", provider.url)
    for variable in ("INVOICES_URL", "LEDGER_URL", "MAIL_URL", "CRM_URL"):  # docs/chains.md
        monkeypatch.setenv(variable, f"{provider.url}/charges")
    monkeypatch.setenv("SMTP_HOST", "127.0.0.1")
    monkeypatch.setenv("SMTP_PORT", str(free_port()))  # nothing listens there
    shop = Shop(clean, engine, provider)
    seeds: dict[str, Any] = {"engine": engine}
    with contextlib.ExitStack() as stack:
        stack.callback(shop.close)
        if page == "README.md":
            _ReadmeBase.metadata.create_all(engine)
            seeds["order"] = _ReadmeOrder()
            seeds["URL"] = f"{provider.url}/charges"
        if page == "docs/quickstart.md":
            from sqlalchemy.ext.asyncio import create_async_engine

            seeds["async_engine"] = create_async_engine(async_database_url(clean.database_url))
            # The page builds its engine from the variable its step 1 exports.
            monkeypatch.setenv("OUTBOX_DATABASE_URL", settings.normalize_database_url(clean.database_url))
        if page == "docs/runbook.md":
            url, received = stack.enter_context(webhook_receiver())
            monkeypatch.setenv("ONCALL_WEBHOOK", url)
            seeds["_received"] = received
        run = run_page(page, seeds)
        if run.namespace.get("engine") is not engine:  # the page's own (docs/quickstart.md)
            stack.callback(run.namespace["engine"].dispose)
        if not run.executed and run.compiled_only:
            return  # only blocks of optional packages: compiled and API-checked, nothing to run
        assert run.executed, f"{page}: no python block ran"
        check = PAGE_CHECKS.get(page)
        assert check is not None, f"{page} has python blocks: add a check of what they define to PAGE_CHECKS"
        check(run, shop)


# -- shell -------------------------------------------------------------------------------------------


def _known_variables() -> set[str]:
    from outbox.alerts import ALERT_HOOK_ENV
    from outbox.cli.dashboard import INSECURE_ENV, SECRET_ENV, TRUSTED_PROXIES_ENV, USERS_ENV
    from outbox.cli.flags import LOG_LEVEL_ENV
    from outbox.logs import LOG_FORMAT_ENV
    from outbox.testing.pytest_plugin import DATABASE_ENV

    return {
        *settings.ENVIRONMENT,
        ALERT_HOOK_ENV,
        LOG_LEVEL_ENV,
        LOG_FORMAT_ENV,
        DATABASE_ENV,
        SECRET_ENV,
        USERS_ENV,
        INSECURE_ENV,
        TRUSTED_PROXIES_ENV,
    }


def _check_assignment(where: str, assignment: str) -> None:
    name, _, value = assignment.partition("=")
    if not name.startswith("OUTBOX_"):
        return
    assert name in _known_variables(), f"{where}: {name} is not a variable outbox reads"
    if name in settings.ENVIRONMENT:
        # A pooler and its direct URL are only accepted together (each checked on its own here).
        beside = {
            "OUTBOX_DATABASE_POOLER": {"OUTBOX_DIRECT_DATABASE_URL": "postgresql://db/app"},
            "OUTBOX_DIRECT_DATABASE_URL": {"OUTBOX_DATABASE_POOLER": "transaction"},
        }.get(name, {})
        settings.from_env({name: value, **beside})  # raises ConfigError for a bad value
    elif name == "OUTBOX_LOG_LEVEL":
        from outbox.cli.flags import log_level

        log_level(value)  # raises for a bad level
    elif name == "OUTBOX_TEST_DATABASE_URL":
        settings.normalize_database_url(value)  # raises ConfigError for a bad URL
    elif name == "OUTBOX_LOG_FORMAT":
        from outbox.logs import LOG_FORMATS

        assert value in LOG_FORMATS, f"{where}: {name}={value}"
    elif name == "OUTBOX_DASHBOARD_SECRET":
        from outbox.dashboard.security import MIN_SECRET_CHARS

        assert value.startswith("$") or len(value) >= MIN_SECRET_CHARS, f"{where}: {name} too short"
    elif name in (
        "OUTBOX_DASHBOARD_USERS",
        "OUTBOX_DASHBOARD_INSECURE_COOKIES",
        "OUTBOX_DASHBOARD_TRUSTED_PROXIES",
    ):
        assert value, f"{where}: {name} is empty"
    else:
        assert re.fullmatch(r"[\w.]+:[\w.]+", value), f"{where}: {name}={value} is not module:function"


def _parse_outbox(where: str, argv: list[str]) -> None:
    parser = cli.build_parser()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:
            if exc.code:
                pytest.fail(
                    f"{where}: `outbox {shlex.join(argv)}` is refused by the parser:\n{err.getvalue()}"
                )
            return
    # Values the parser takes as strings and the command parses later.
    if getattr(args, "interval", None):
        assert settings.parse_seconds(args.interval, "--interval") > 0
    if getattr(args, "since", None):
        from outbox.ops.audit import parse_since

        parse_since(args.since)
    if getattr(args, "alert_hook", None):
        assert re.fullmatch(r"[\w.]+:[\w.]+", args.alert_hook), f"{where}: --alert-hook {args.alert_hook}"
    for name in ("database_url", "redis_url", "namespace"):
        if getattr(args, name, None):
            settings.from_env({}, **{name: getattr(args, name)})


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.MULTILINE))


def shell_commands(block: Block) -> list[list[str]]:
    if block.lang == "console":
        lines = [line[2:] for line in block.code.splitlines() if line.startswith("$ ")]
    else:
        lines = block.code.replace("\\\n", " ").splitlines()
    commands: list[list[str]] = []
    for line in lines:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        for token in lexer:
            if token and set(token) <= set(";&|"):
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(token)
        if current:
            commands.append(current)
    return commands


@pytest.mark.parametrize("block", blocks("sh", "console"), ids=_ids(blocks("sh", "console")))
def test_shell_blocks_parse(block: Block) -> None:
    commands = shell_commands(block)
    assert commands, f"{block.where}: a shell block without a command"
    for tokens in commands:
        while tokens and re.match(r"^[A-Za-z_]\w*=", tokens[0]):
            _check_assignment(block.where, tokens.pop(0))
        assert tokens, f"{block.where}: an assignment without a command"
        command, rest = tokens[0], tokens[1:]
        if command == "outbox":
            _parse_outbox(block.where, rest)
        elif command == "python" and rest[:2] == ["-m", "outbox"]:
            _parse_outbox(block.where, rest[2:])
        elif command == "export":
            for assignment in rest:
                _check_assignment(block.where, assignment)
        elif command == "docker" and "outbox" in rest:
            # docker compose exec|run SERVICE outbox …
            _parse_outbox(block.where, rest[rest.index("outbox") + 1 :])
        elif command == "kubectl":
            # kubectl exec POD -- outbox …: the outbox command is parsed; the files applied exist.
            if "--" in rest and rest[rest.index("--") + 1 : rest.index("--") + 2] == ["outbox"]:
                _parse_outbox(block.where, rest[rest.index("--") + 2 :])
            for flag, value in itertools.pairwise(rest):
                if flag == "-f":
                    assert (ROOT / value).is_file(), f"{block.where}: kubectl -f {value}: no such file"
        elif command == "make":
            missing = set(rest) - _make_targets()
            assert not missing, f"{block.where}: no Makefile target {sorted(missing)}"
        else:
            assert command in OTHER_COMMANDS, f"{block.where}: unknown command {command!r}"


# -- yaml (compose services), sql, conf, mermaid -------------------------------------------------


@pytest.mark.parametrize("block", blocks("yaml"), ids=_ids(blocks("yaml")))
def test_compose_blocks_run_real_commands(block: Block) -> None:
    import yaml

    document = yaml.safe_load(block.code)
    services = document.get("services") if isinstance(document, dict) else None
    assert services, f"{block.where}: a yaml block must be compose services"
    for name, service in services.items():
        command = service.get("command", [])
        argv = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
        if argv[:1] == ["outbox"]:
            _parse_outbox(f"{block.where} ({name})", argv[1:])
        environment = service.get("environment") or {}
        items = environment if isinstance(environment, list) else [f"{k}={v}" for k, v in environment.items()]
        for assignment in items:
            _check_assignment(f"{block.where} ({name})", assignment)


_STATE_LITERALS = re.compile(r"\bstate\s*(?:=|<>|!=)\s*'([^']*)'|\bstate\s+IN\s*\(([^)]*)\)", re.IGNORECASE)


@pytest.mark.parametrize("block", blocks("sql"), ids=_ids(blocks("sql")))
def test_sql_blocks_run(block: Block, clean: Any, engine: Engine) -> None:
    for match in _STATE_LITERALS.finditer(block.code):
        literals = (
            [match.group(1)] if match.group(1) is not None else re.findall(r"'([^']*)'", match.group(2))
        )
        unknown = set(literals) - set(states.ALL)
        assert not unknown, f"{block.where}: not a state: {sorted(unknown)}"
    statements = [s.strip() for s in re.split(r";\s*(?:\n|$)", block.code) if s.strip()]
    assert statements, f"{block.where}: an empty sql block"
    with engine.connect() as conn:
        transaction = conn.begin()
        try:
            for statement in statements:
                conn.exec_driver_sql(statement)
        finally:
            transaction.rollback()


@pytest.mark.parametrize("block", blocks("conf"), ids=_ids(blocks("conf")))
def test_conf_blocks_name_real_redis_directives(block: Block, services: Any) -> None:
    client = redis.Redis.from_url(services.redis_url)
    try:
        for line in block.code.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            directive = line.split()[0]
            assert directive in client.config_get(directive), f"{block.where}: Redis has no {directive!r}"
    finally:
        client.close()


@pytest.mark.parametrize("block", blocks("mermaid"), ids=_ids(blocks("mermaid")))
def test_state_diagrams_name_the_real_states(block: Block) -> None:
    if "stateDiagram" not in block.code:
        return
    named = set()
    for line in block.code.splitlines():
        match = re.match(r"\s*(\S+)\s*-->\s*([^:\s]+)", line)
        if match:
            named |= {match.group(1), match.group(2)}
    assert named - {"[*]"} == set(states.ALL), f"{block.where}: {sorted(named - {'[*]'})}"


# -- every block is exercised; the pages exist and their tables match the code --------------------------


def test_every_block_has_a_known_language() -> None:
    unknown = [
        f"{b.where}: {b.lang or '(none)'}"
        for b in all_blocks()
        if b.lang not in RUN_LANGUAGES | SKIPPED_LANGUAGES
    ]
    assert not unknown, "code blocks with an info string this test does not exercise:\n" + "\n".join(unknown)


def test_readme_links_every_page() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in PAGES:
        assert f"](docs/{page})" in readme, f"README.md does not link docs/{page}"
        assert (DOCS / page).is_file(), f"docs/{page} is missing"


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")


def test_links_between_pages_resolve() -> None:
    problems = []
    for path in DOCS.glob("*.md"):
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                problems.append(f"{path.name}: {target}: no such file")
            elif anchor and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", linked.read_text(encoding="utf-8"), flags=re.MULTILINE)
                if anchor not in {_slug(h) for h in headings}:
                    problems.append(f"{path.name}: {target}: no such heading")
    assert not problems, "\n".join(problems)


def test_every_variable_named_exists() -> None:
    known = _known_variables() | TEST_VARIABLES
    for path in page_paths():
        named = set(re.findall(r"\bOUTBOX_[A-Z][A-Z_]*[A-Z]", path.read_text(encoding="utf-8")))
        assert named <= known, f"{path.name} names variables outbox does not read: {sorted(named - known)}"


def _table_rows(page: str, after: str) -> list[list[str]]:
    """The rows of the first table after the line containing ``after``, as lists of cells."""
    lines = (DOCS / page).read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if after in line)
    rows, seen = [], False
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            seen = True
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not set("".join(cells)) <= set("-: "):
                rows.append(cells)
        elif seen:
            break
    return rows[1:]  # without the header


def _code(cell: str) -> str | None:
    match = re.search(r"`([^`]+)`", cell)
    return match.group(1) if match else None


def test_configuration_table_matches_the_settings() -> None:
    rows = _table_rows("configuration.md", "## Environment variables")
    documented = {_code(r[0]): r for r in rows}
    assert set(documented) == _known_variables(), "the table must list every variable, and only those"
    defaults = settings.Settings()
    for name, field_name in settings.ENVIRONMENT.items():
        default = _code(documented[name][1])
        if default is None:
            assert getattr(defaults, field_name) is None, f"{name}: the table gives no default"
            continue
        parsed = getattr(settings.from_env({name: default}), field_name)
        assert parsed == getattr(defaults, field_name), (
            f"{name}: documented default {default} is not the default"
        )


def test_handler_options_table_matches_the_decorator() -> None:
    rows = _table_rows("handlers.md", "takes these options")
    documented = {_code(r[0]): _code(r[1]) for r in rows}
    parameters = {
        n: p for n, p in inspect.signature(outbox.handler).parameters.items() if p.kind is p.KEYWORD_ONLY
    }
    assert set(documented) == set(parameters)
    for name, default in documented.items():
        assert default is not None, name
        if name == "lease_seconds":
            for time_limit in (2, 10, 30, 120):
                h = outbox.handler("docs.check", time_limit=time_limit)(lambda d: None)
                assert eval(default, {"time_limit": time_limit}) == h.lease_seconds
                outbox.handlers.clear_registry()
        elif name == "breaker":
            assert eval(default, {"outbox": outbox}) == parameters[name].default
        else:
            assert ast.literal_eval(default) == parameters[name].default, name


def test_delivery_table_matches_the_class() -> None:
    rows = _table_rows("handlers.md", "## `Delivery`")
    documented = {_code(r[0]) for r in rows}
    fields = {f.name for f in dataclasses.fields(Delivery) if f.name != "handler"}
    assert documented == fields | {"http"}


def test_default_lease_table() -> None:
    for cells in _table_rows("timings.md", "## `lease_seconds`"):
        time_limit, lease = (float(c.split()[0]) for c in cells[:2])
        h = outbox.handler("docs.check", time_limit=time_limit)(lambda d: None)
        outbox.handlers.clear_registry()
        assert h.lease_seconds == lease, cells


def _status_error(code: int) -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "https://api.provider.example/charges")
    response = httpx.Response(code, request=request)
    return httpx.HTTPStatusError(f"HTTP {code}", request=request, response=response)


def _classification_samples() -> dict[str, list[Any]]:
    """Table row (a phrase of its first cell) -> what a handler returns or raises for it."""
    from dramatiq.middleware.time_limit import TimeLimitExceeded

    request = httpx.Request("POST", "https://api.provider.example/charges")
    return {
        "returned `Confirmed`": [outbox.Confirmed(ref="ch_1")],
        "raised `outbox.PermanentError`": [outbox.PermanentError("card declined")],
        "raised `outbox.RetryableError`": [outbox.RetryableError("not sent")],
        "raised `outbox.AmbiguousError`": [outbox.AmbiguousError("maybe")],
        "for 429 or 503": [_status_error(429), _status_error(503)],
        "any other 4xx except 408, 409 and 425": [_status_error(c) for c in (400, 401, 402, 404, 410, 422)],
        "for 408, 409, 425, any other 5xx, or a 1xx/3xx": [
            _status_error(c) for c in (408, 409, 425, 500, 502, 504, 301, 302)
        ],
        "`httpx.ConnectError`, `httpx.ConnectTimeout` or `httpx.PoolTimeout`": [
            httpx.ConnectError("refused", request=request),
            httpx.ConnectTimeout("slow", request=request),
            httpx.PoolTimeout("full", request=request),
        ],
        "`httpx.ReadTimeout` or `httpx.WriteTimeout`": [
            httpx.ReadTimeout("slow", request=request),
            httpx.WriteTimeout("slow", request=request),
        ],
        "any other `httpx.TransportError`": [
            httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request),
            httpx.ReadError("reset", request=request),
        ],
        "Dramatiq's time limit": [TimeLimitExceeded()],
        "a `ValueError` about JSON": [json.JSONDecodeError("Expecting value", "not json{", 0)],
        "raised anything else": [KeyError("id"), TypeError("bad")],
        "returned anything other than `Confirmed`": [None, {"id": "ch_1"}],
    }


def test_classification_table_is_what_the_policy_does() -> None:
    rows = _table_rows("handlers.md", "## Error classification")
    samples = _classification_samples()
    h = outbox.handler("docs.classify", time_limit=5)(lambda d: None)
    outbox.handlers.clear_registry()
    matched = set()
    for first, second, *_ in rows:
        phrases = [p for p in samples if p in first]
        assert len(phrases) == 1, f"handlers.md classification row {first!r}: add its samples to this test"
        matched.add(phrases[0])
        expected = re.search(r"\*\*(\w+)\*\*", second)
        assert expected, second
        for sample in samples[phrases[0]]:
            if isinstance(sample, BaseException):
                outcome = policy.decide_exception(h, sample).outcome
            else:
                outcome = policy.decide_result(sample).outcome
            assert outcome.value == expected.group(1), f"{first}: {sample!r} is {outcome.value}"
    assert matched == set(samples), f"rows missing from the table: {sorted(set(samples) - matched)}"
