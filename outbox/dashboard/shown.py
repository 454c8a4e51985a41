"""What a page shows of a row's texts: its history as lines, whatever shape each entry has, and
which error texts a reader without payload rights is not shown.

An error text (``last_error``, an attempt row's ``error``, a ``chain_problem``) is the provider's or
the application's words, and these often echo the request: a card number, an address. A reader
without payload rights sees that there is one and the classification around it (the state, the
attempt's outcome, its HTTP status), never the text.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

#: Shown in place of an error text to a reader without payload rights.
WITHHELD = "(hidden: error texts may echo the payload, and your role does not include payloads)"
#: History entries' fields that hold error texts (``resolve --failed``'s error, the problem of
#: next steps ``outbox repair`` could not write).
HISTORY_ERROR_FIELDS = ("error", "problem")

# The fields every line shows in its own place; the others are listed after it.
_PLACED = ("at", "by", "action", "from", "to", "reason", "after_attempt")
#: A field of a history entry longer than this is cut (an entry written by hand can hold anything).
_MAX_CHARS = 500


def _text(value: Any) -> str:
    if isinstance(value, str):
        out = value
    else:
        out = json.dumps(value, sort_keys=True, default=str, ensure_ascii=False)
    return out if len(out) <= _MAX_CHARS else out[: _MAX_CHARS - 1] + "…"


def _when(value: Any) -> str:
    try:
        return datetime.fromisoformat(str(value)).strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:
        return _text(value) if value is not None else "?"


@dataclasses.dataclass(frozen=True)
class HistoryLine:
    at: str
    action: str
    #: ``failed → pending``, or the state a lookup settled the row in, or "".
    move: str
    by: str
    reason: str
    #: The entry's other fields (a lookup's result, a reference, ``forced``...), in name order.
    details: list[tuple[str, str]]


def history_lines(entries: Iterable[Any], *, errors: bool) -> list[HistoryLine]:
    """Each history entry as a line, from any entry the code writes (an operator's action has
    ``from``, ``to`` and ``reason``; the reconciler's lookup has ``result`` and ``state`` and no
    reason) or a hand-written one. ``errors``: whether the error fields are shown."""
    lines = []
    for entry in entries:
        e: Mapping[str, Any] = entry if isinstance(entry, Mapping) else {"entry": entry}
        placed: tuple[str, ...] = _PLACED
        if e.get("from") is not None or e.get("to") is not None:
            move = f"{_text(e.get('from', '?'))} → {_text(e.get('to', '?'))}"
        elif e.get("state") is not None:
            move, placed = f"→ {_text(e['state'])}", (*_PLACED, "state")
        else:
            move = ""
        details = []
        for name in sorted(str(k) for k in e if k not in placed):
            value = e[name]
            if value is None or value == "":
                continue
            shown = _text(value) if errors or name not in HISTORY_ERROR_FIELDS else WITHHELD
            details.append((_text(name), shown))
        lines.append(
            HistoryLine(
                at=_when(e.get("at")),
                action=_text(e.get("action") or "?"),
                move=move,
                by=_text(e.get("by") or "?"),
                reason=_text(e["reason"]) if e.get("reason") else "",
                details=details,
            )
        )
    return lines


def _hide(text: Any) -> Any:
    return WITHHELD if text else text


def withhold_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row (of the row page, a list, a key's steps) without its error texts."""
    out = dict(row)
    for name in ("last_error", "chain_problem"):
        if name in out:
            out[name] = _hide(out[name])
    return out


def withhold_attempt(attempt: dict[str, Any]) -> dict[str, Any]:
    """An attempt row without its error text; its outcome and HTTP status stay."""
    return {**attempt, "error": _hide(attempt.get("error"))}


def withhold_blocked(key: Any) -> Any:
    """A blocked key (outbox.ops.ordering.BlockedKey) without its head's error text."""
    return dataclasses.replace(key, last_error=_hide(key.last_error))
