"""Every statement that writes an ``outbox_*`` table lives in the store (``outbox/store/``): a
reviewer checks the guarded statements in one place. A write anywhere else in the product fails
here, with where it is, unless it is tooling exempt by name."""

from __future__ import annotations

import re
from pathlib import Path

import outbox
from outbox import states, store

ROOT = Path(outbox.__file__).resolve().parent.parent
PRODUCT = ("outbox", "relay", "reconciler")
WRITES = re.compile(
    r"\b(?:UPDATE\s+(?:ONLY\s+)?|INSERT\s+INTO\s+|DELETE\s+FROM\s+(?:ONLY\s+)?|TRUNCATE\s+(?:TABLE\s+)?)"
    r"(outbox_\w+|\{FLOOR_TABLE\})",
    re.IGNORECASE,
)
HOME = ROOT / "outbox" / "store"
#: Tooling, exempt by name: tests and the demo make time pass (every instant moves back, no
#: state changes), and empty the tables between a user's tests.
TOOLING = {
    ROOT / "outbox" / "testing" / "clock.py": {"outbox_message", "outbox_attempt"},
    ROOT / "outbox" / "testing" / "databases.py": {"outbox_message"},
}
#: The tables of the rows and their moves: none of them is written outside the store, ever.
ROW_TABLES = {"outbox_message", "outbox_attempt", "outbox_batch"}


def product_sources() -> list[Path]:
    # rglob does not follow the links outbox/relay and outbox/reconciler: each file once.
    return sorted(p for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py"))


def writes_in(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(1).lower()) for m in WRITES.finditer(text)]


def test_the_pattern_finds_writes() -> None:
    # The grep below is only as good as its pattern: it must see each kind of write.
    for sql, table in (
        ("UPDATE outbox_message SET", "outbox_message"),
        ("update  outbox_destination d", "outbox_destination"),
        ("INSERT INTO outbox_attempt (key)", "outbox_attempt"),
        ("DELETE FROM outbox_key_ledger WHERE", "outbox_key_ledger"),
        ("TRUNCATE outbox_message", "outbox_message"),
        ("INSERT INTO {FLOOR_TABLE} (migration)", "{floor_table}"),
    ):
        found = WRITES.search(sql)
        assert found and found.group(1).lower() == table, sql
    assert not WRITES.search("SELECT * FROM outbox_message")
    assert not WRITES.search("UPDATE my_orders SET")


def test_only_the_store_writes_the_outbox_tables() -> None:
    sources = product_sources()
    assert len(sources) > 40 and any(HOME in p.parents for p in sources)
    elsewhere = []
    for path in sources:
        if HOME in path.parents:
            continue
        allowed = TOOLING.get(path, set())
        for line, table in writes_in(path):
            if table not in allowed:
                elsewhere.append(f"{path.relative_to(ROOT)}:{line}: writes {table}")
    assert elsewhere == [], "writes outside outbox/store/:\n" + "\n".join(elsewhere)
    in_store = {t for p in sorted(HOME.glob("*.py")) for _, t in writes_in(p)}
    # Every table the product writes, each from the store.
    assert in_store >= ROW_TABLES | {
        "outbox_key_ledger",
        "outbox_destination",
        "outbox_process",
        "outbox_no_consumer",
        "outbox_db_identity",
        "outbox_feature",
        "{floor_table}",
        "outbox_dashboard_session_end",
    }


def moves() -> dict[str, str]:
    """Every public function of the store's modules that moves something: name -> module."""
    found: dict[str, str] = {}
    for module in (
        store.application,
        store.relay,
        store.delivery,
        store.recovery,
        store.operator,
        store.processes,
        store.counts,
    ):
        for name, value in vars(module).items():
            if (
                not name.startswith("_")
                and callable(value)
                and not isinstance(value, type)
                and getattr(value, "__module__", "") == module.__name__
            ):
                assert name not in found, f"{name} in both {found[name]} and {module.__name__}"
                found[name] = module.__name__.rsplit(".", 1)[1]
    return found


ASYNC_TWINS = {"insert_async", "cancel_by_key_async", "insert_batch_async", "insert_member_async"}


def store_tables() -> tuple[dict[str, str], dict[str, str]]:
    """The store's two tables (its docstring): the moves of the rows, the writes of the others."""
    doc = store.__doc__ or ""
    split = doc.index("The other tables:")
    pattern = r"``(application|relay|delivery|recovery|operator|processes|counts)\.([a-z_]+)``"
    rows, others = (
        {name: module for module, name in re.findall(pattern, part)} for part in (doc[:split], doc[split:])
    )
    return rows, others


def test_every_move_is_named_in_the_state_table() -> None:
    # The state table (outbox.states) names the function behind each move of a row: each name is
    # a function of the store, and each such move of the store is named there.
    named = set(re.findall(r"``([a-z_]+)``", states.__doc__ or "")) - set(states.ALL)
    named -= {"available_at", "provider_ref", "outbox_message"}
    found = moves()
    assert {name for name in named if name not in found} == set()
    rows, _ = store_tables()
    assert set(rows) == named


def test_the_stores_tables_list_each_statement_in_its_module() -> None:
    rows, others = store_tables()
    assert not set(rows) & set(others)
    # Async twins share their sync move's statement.
    assert {**rows, **others} == {name: module for name, module in moves().items() if name not in ASYNC_TWINS}
