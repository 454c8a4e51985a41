"""One value a field on a log line: a text line does not repeat as ``name=value`` a field its
message already shows (``queues=a,b``, ``outbox row 42``, ``order:42:charge``, ``attempt 2``),
while a JSON line carries every field as a field of its own."""

from __future__ import annotations

import json
import logging

import pytest

from outbox.consumer import _RUN_SHOWN
from outbox.logs import JsonFormatter, KeyValueFormatter

TEXT = KeyValueFormatter("%(levelname)s %(name)s %(message)s")


def record(message: str, *args: object, **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("outbox.consumer", logging.WARNING, __file__, 1, message, args, None)
    rec.__dict__.update(extra)
    return rec


def fields_of(line: str) -> list[str]:
    """The ``name=`` of every field appended after the message (split on spaces outside quotes)."""
    names, quoted, token = [], False, ""
    for ch in line + " ":
        if ch == '"' and not token.endswith("\\"):
            quoted = not quoted
        if ch == " " and not quoted:
            if "=" in token:
                names.append(token.split("=", 1)[0])
            token = ""
        else:
            token += ch
    return names


RUN = (
    "outbox %s:%s -> %s (attempt %s)%s",
    "order:42",
    "charge",
    "failed",
    2,
    ": card declined",
)
RUN_FIELDS = {
    "outbox_id": 42,
    "key": "order:42",
    "step": "charge",
    "destination": "payments.charge",
    "attempt": 2,
    "outbox_run": "failed",
    "provider_ref": None,
}


def test_the_run_line_shows_key_step_attempt_and_result_once():
    line = TEXT.format(record(*RUN, **RUN_FIELDS, _shown=_RUN_SHOWN))
    assert line == (
        "WARNING outbox.consumer outbox order:42:charge -> failed (attempt 2): card declined "
        "outbox_id=42 destination=payments.charge provider_ref=None"
    )


def test_the_run_line_in_json_keeps_every_field():
    entry = json.loads(JsonFormatter().format(record(*RUN, **RUN_FIELDS, _shown=_RUN_SHOWN)))
    assert entry["message"] == "outbox order:42:charge -> failed (attempt 2): card declined"
    assert {name: entry[name] for name in RUN_FIELDS} == RUN_FIELDS
    assert "_shown" not in entry


@pytest.mark.parametrize(
    ("message", "args", "extra", "kept"),
    [
        # name=value in the message: not appended again.
        (
            "outbox worker started: queues=%s concurrency=%s",
            ("a,b", 4),
            {"queues": ["a", "b"], "concurrency": 4, "pid": 9},
            ["pid"],
        ),
        # The row and the destination in words.
        (
            "outbox row %s held: destination %s is at its limit",
            (42, "mail.send"),
            {"outbox_id": 42, "destination": "mail.send", "outbox_run": "held"},
            ["outbox_run"],
        ),
        ("breaker of %s tripped", ("mail.send",), {"destination": "mail.send"}, []),
        (
            "outbox row %s -> unknown: %s",
            (42, "its lease expired"),
            {"outbox_id": 42, "destination": "mail.send", "outbox_run": "unknown"},
            ["destination"],
        ),
        ("fetching from queue %s failed", ("mail.send",), {"queue": "mail.send"}, []),
        # A key and step in words, only as a whole: order:4 is not order:42.
        (
            "outbox %s:%s released",
            ("order:42", "charge"),
            {"key": "order:42", "step": "charge", "outbox_id": 7},
            ["outbox_id"],
        ),
        ("outbox order:42:charge released", (), {"key": "order:4", "step": "charge"}, ["key", "step"]),
        # Another row's number, a longer name or a longer number is no repeat.
        ("outbox row 4 waits", (), {"outbox_id": 42}, ["outbox_id"]),
        ("outbox row 42.5 waits", (), {"outbox_id": 42}, ["outbox_id"]),
        ("async_queues=none", (), {"queues": "x"}, ["queues"]),
        ("destination mail.send.eu paused", (), {"destination": "mail.send"}, ["destination"]),
    ],
)
def test_a_field_the_message_shows_is_not_repeated_on_a_text_line(message, args, extra, kept):
    rec = record(message, *args, **extra)
    line = TEXT.format(rec)
    shown = rec.getMessage()
    assert line.startswith(f"WARNING outbox.consumer {shown}")
    assert fields_of(line[len(f"WARNING outbox.consumer {shown}") :]) == kept, line
    entry = json.loads(JsonFormatter().format(record(message, *args, **extra)))
    assert all(entry[name] == value for name, value in extra.items()), entry


def test_a_field_named_like_a_secret_is_masked_wherever_it_is():
    rec = record("row %s", 7, idempotency_key="order:7:charge", payload={"amount": 1}, key="order:7")
    line = TEXT.format(rec)
    assert "idempotency_key=*** payload=*** key=order:7" in line
    entry = json.loads(JsonFormatter().format(record("row %s", 7, idempotency_key="k", payload={"a": 1})))
    assert entry["idempotency_key"] == "***" and entry["payload"] == "***"


def test_no_log_call_names_a_field_the_log_record_has_already():
    """``extra={"module": …}`` raises KeyError at the call (LogRecord has ``module``): a line
    that is logged rarely (a start, an error) would kill its process only when it is."""
    import ast
    from pathlib import Path

    reserved = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}
    root = Path(__file__).resolve().parents[2]
    found = []
    paths = [p for top in ("outbox", "relay", "reconciler") for p in (root / top).rglob("*.py")]
    assert any(p.parts[-2:] == ("reconciler", "scheduler.py") for p in paths)
    for path in sorted(paths):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and any(k.arg == "extra" for k in node.keywords):
                [extra] = [k.value for k in node.keywords if k.arg == "extra"]
                if isinstance(extra, ast.Dict):
                    names = [k.value for k in extra.keys if isinstance(k, ast.Constant)]
                    found += [f"{path.relative_to(root)}:{node.lineno}: {n}" for n in names if n in reserved]
    assert found == []
