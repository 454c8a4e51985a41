"""What the person on call does, as functions returning data: look (``inspect``: status, show,
lists; ``audit``; ``doctor``) and act (``actions``: replay, resolve, cancel). No argparse and no
printing here: ``outbox.cli`` parses the flags and prints, ``outbox.ops.tables`` renders.

Every action is one guarded statement per row, so a row that moved since the operator looked is
refused, never overwritten. The functions take a SQLAlchemy ``Connection`` and never commit: the
caller owns the transaction. Looking never writes. Payloads may hold personal data, so they are
only returned on request.
"""

from __future__ import annotations

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
from .audit import AuditReport, audit, parse_since
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
    "AuditReport",
    "CancelPlan",
    "LedgerDetail",
    "ListedRow",
    "ReplayCandidate",
    "ReplayPlan",
    "RowDetail",
    "RowList",
    "StatusReport",
    "audit",
    "cancel_rows",
    "default_actor",
    "execute_replay",
    "list_rows",
    "operator_text",
    "parse_since",
    "plan_replay",
    "replay",
    "replay_destination",
    "resolve",
    "show",
    "status",
]
