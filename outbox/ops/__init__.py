"""What the person on call does, as functions returning data: look (``inspect``: status, show,
lists; ``audit``; ``doctor``) and act (``actions``: replay, resolve, cancel). No argparse and no
printing here: ``outbox.cli`` parses the flags and prints, ``outbox.cli.render`` renders.

Every action is one guarded statement per row, so a row that moved since the operator looked is
refused, never overwritten. The functions take a SQLAlchemy ``Connection`` and never commit: the
caller owns the transaction. Looking never writes. Payloads may hold personal data, so they are
only returned on request.

The audit and the doctor are their own modules (``outbox.ops.audit.audit``,
``outbox.ops.doctor.run_checks``); the names below are the inspect and action functions, loaded on
first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .actions import (
        ActionResult,
        CancelPlan,
        ReplayCandidate,
        ReplayPlan,
        cancel_rows,
        default_actor,
        execute_replay,
        operator_text,
        plan_replay,
        replay,
        replay_destination,
        resolve,
    )
    from .inspect import (
        DEFAULT_LIST_LIMIT,
        LedgerDetail,
        ListedRow,
        RowDetail,
        RowList,
        StatusReport,
        list_rows,
        show,
        status,
    )

__all__ = [
    "DEFAULT_LIST_LIMIT",
    "ActionResult",
    "CancelPlan",
    "LedgerDetail",
    "ListedRow",
    "ReplayCandidate",
    "ReplayPlan",
    "RowDetail",
    "RowList",
    "StatusReport",
    "cancel_rows",
    "default_actor",
    "execute_replay",
    "list_rows",
    "operator_text",
    "plan_replay",
    "replay",
    "replay_destination",
    "resolve",
    "show",
    "status",
]

# Loaded on first use: `outbox status` needs the queries of inspect, not those of actions.
_HOME = {
    **dict.fromkeys(
        (
            "ActionResult",
            "CancelPlan",
            "ReplayCandidate",
            "ReplayPlan",
            "cancel_rows",
            "default_actor",
            "execute_replay",
            "operator_text",
            "plan_replay",
            "replay",
            "replay_destination",
            "resolve",
        ),
        "actions",
    ),
    **dict.fromkeys(
        (
            "DEFAULT_LIST_LIMIT",
            "LedgerDetail",
            "ListedRow",
            "RowDetail",
            "RowList",
            "StatusReport",
            "list_rows",
            "show",
            "status",
        ),
        "inspect",
    ),
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    globals()[name] = value
    return value
