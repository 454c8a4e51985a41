"""Rendering the operator commands' data: aligned text tables, ages, cells, and JSON."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any
from uuid import UUID


def seconds(value: Decimal | float | None) -> float | None:
    return None if value is None else round(float(value), 3)


def age(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def short(value: str | None, width: int = 80) -> str | None:
    if value is None:
        return None
    flat = " ".join(value.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def cell(value: Any, *, long: bool = False) -> Any:
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat(sep=" ", timespec="seconds")
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False, default=json_default)
    if isinstance(value, str) and not long:
        return short(value)
    return value


def indent(block: str) -> str:
    return textwrap.indent(block, "  ")


def json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, Decimal):
        return float(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """An aligned text table: numbers right-aligned, text left-aligned, ``-`` for None."""
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    numeric = [
        bool(rows) and all(isinstance(row[i], int | float) or row[i] is None for row in rows)
        for i in range(len(headers))
    ]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def to_json(data: Any) -> str:
    """One JSON document (indented; datetimes, UUIDs and decimals as JSON values)."""
    return json.dumps(data, indent=2, ensure_ascii=False, default=json_default)
