"""Values the operator commands' data carry, made presentable: seconds rounded, an age as
"3m05s", text a terminal shows as written, JSON for datetimes, UUIDs and decimals. Shared by
outbox.ops (the data), the CLI's rendering (outbox.cli.render) and the dashboard."""

from __future__ import annotations

import re
from datetime import datetime
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


def json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, Decimal):
        return float(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def printable(text: str) -> str:
    """``text`` with its control characters escaped (``\\n``, ``\\x1b``): a key or an error
    written by plain SQL must not forge table lines or colour a terminal."""
    return _CONTROL.sub(lambda m: repr(m.group(0))[1:-1], text)
