"""Rendering the operator commands' data (outbox.ops) as text: aligned tables, cells, each
report; and JSON. The data classes know nothing of it: ``render(report)`` picks the form."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from .. import states
from ..ops.values import age, json_default, printable

if TYPE_CHECKING:  # `outbox --help` loads this module: the reports' modules load SQLAlchemy
    from ..ops.actions import ReplayPlan
    from ..ops.audit import AuditReport
    from ..ops.batches import BatchReport
    from ..ops.inspect import KeySteps, LedgerDetail, RowDetail, RowList, StatusReport
    from ..ops.progress import ChainsReport
    from ..ops.repair import RepairPlan, StalledReport


def render(report: Any) -> str:
    """The text form of one of outbox.ops' reports."""
    form = _FORMS.get(type(report).__name__)
    if form is None:
        raise TypeError(f"no text form for {type(report).__name__}")
    return form(report)


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


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """An aligned text table: numbers right-aligned, text left-aligned, ``-`` for None."""
    cells = [[("-" if v is None else printable(str(v))) for v in row] for row in rows]
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


# -- the operator commands' data as text ---------------------------------------------------------


def render_status(report: StatusReport) -> str:
    held = [p.describe() for p in report.paused] + [b.describe() for b in report.breakers]
    held += [f"limited: {lim.describe()}" for lim in report.limits]
    paused = "".join(f"\n{line}" for line in held)
    if not report.counts:
        return f"no outbox rows{paused}"
    totals = report.totals()
    rows: list[list[Any]] = [
        [d, *(c[s] for s in states.ALL), sum(c.values()), age(report.oldest_pending_age[d])]
        for d, c in report.counts.items()
    ]
    rows.append(
        ["TOTAL", *(totals[s] for s in states.ALL), report.total, age(report.oldest_pending_age_seconds)]
    )
    table = format_table(["destination", *states.ALL, "total", "oldest pending"], rows)
    summary = (
        f"unknown: {totals[states.UNKNOWN]}   failed: {totals[states.FAILED]}   total: {report.total}   "
        f"oldest due pending row: {age(report.oldest_pending_age_seconds) or 'none'}"
    )
    gaps = "".join(f"\n{n.describe()}" for n in report.no_consumer)
    blocked = (
        f"\nblocked ordering keys: {report.blocked_keys}, the longest for "
        f"{age(report.oldest_block_seconds) or '?'} (outbox ordering)"
        if report.blocked_keys
        else ""
    )
    return f"{table}\n\n{summary}{gaps}{blocked}{paused}"


def render_row(detail: RowDetail) -> str:
    width = max(len(k) for k in detail.row)
    lines = [
        f"{k.ljust(width)}  {cell(v, long=True) if v is not None else '-'}" for k, v in detail.row.items()
    ]
    if detail.payload is not None:
        lines.append(f"{'payload'.ljust(width)}  {json.dumps(detail.payload, ensure_ascii=False)}")
    lines += [
        "",
        f"attempts ({len(detail.attempts)} attempt rows, in claim order; # counts every claim, "
        "attempt restarts at each replay):",
    ]
    if detail.attempts:
        headers = ["attempt", "claim_token", "started_at", "finished_at", "outcome", "http_status", "error"]
        table = format_table(
            ["#", *headers], [[a["number"], *(cell(a[h]) for h in headers)] for a in detail.attempts]
        ).splitlines()
        lines += [f"  {line}" for line in table[:2]]
        for a, line in zip(detail.attempts, table[2:], strict=True):
            lines += [f"  {mark}" for mark in _marks(detail.history, a["number"] - 1)]
            lines.append(f"  {line}")
        lines += [f"  {mark}" for mark in _marks(detail.history, len(detail.attempts))]
    else:
        lines.append("  none: never claimed")
    lines += ["", f"history ({len(detail.history)} operator actions):"]
    if detail.history:
        keys = ["at", "by", "action", "from", "to", "reason"]
        extra = sorted({k for h in detail.history for k in h} - {*keys, "after_attempt"})
        lines.append(
            indent(
                format_table(
                    keys + extra,
                    [
                        [cell(_parsed(h.get(k)) if k == "at" else h.get(k)) for k in keys + extra]
                        for h in detail.history
                    ],
                )
            )
        )
    else:
        lines.append("  none")
    return "\n".join(lines)


def _marks(history: Sequence[dict[str, Any]], after: int) -> list[str]:
    """The history entries between attempt row #after and the next one, as marker lines."""
    marks = []
    for h in history:
        if h.get("after_attempt") != after:
            continue
        move = f"{h['from']} -> {h['to']}" if h.get("from") and h.get("to") else h.get("state")
        why = f": {short(str(h['reason']), 60)}" if h.get("reason") else ""
        by = f" by {h['by']}" if h.get("by") else ""
        marks.append(f"-- {h.get('action', '?')}{by} at {cell(_parsed(h.get('at')))}, {move or '-'}{why}")
    return marks


def _parsed(value: Any) -> Any:
    # The history's timestamps are JSON strings: shown like the attempt rows' datetimes.
    try:
        return datetime.fromisoformat(str(value))
    except ValueError:
        return value


def render_ledger(entry: LedgerDetail) -> str:
    width = max(len(k) for k in entry.entry)
    lines = [
        f"row {entry.entry['id']} was purged; the key ledger keeps its key until the horizon "
        "(OUTBOX_LEDGER_HORIZON), so writing it again answers as before the purge.",
        "Its attempts, history and payload are gone; the payload's SHA-256 is kept.",
        "",
    ]
    lines += [f"{k.ljust(width)}  {'-' if v is None else cell(v, long=True)}" for k, v in entry.entry.items()]
    return "\n".join(lines)


def render_rows(listed: RowList) -> str:
    where = "".join(
        [
            f" for destination {listed.destination}" if listed.destination else "",
            f" with a key starting {listed.key_prefix!r}" if listed.key_prefix else "",
        ]
    )
    if not listed.rows:
        named = listed.state or ("" if set(listed.states) == set(states.ALL) else "/".join(listed.states))
        return f"no {named + ' ' if named else ''}rows{where}"
    # The state column only when several states are listed: `outbox failed` says it already.
    several = listed.state is None
    state_column = ["state"] if several else []
    table = format_table(
        ["id", "key", "step", "destination", *state_column, "attempts", "age", "last_error"],
        [
            [
                r.id,
                r.key,
                r.step,
                r.destination,
                *([r.state] if several else []),
                r.attempts,
                age(r.age_seconds),
                short(r.last_error),
            ]
            for r in listed.rows
        ],
    )
    more = (
        f"\nshowing {len(listed.rows)} of {listed.matching}; use --limit"
        if listed.matching > len(listed.rows)
        else ""
    )
    return f"{table}{more}"


def render_replay_plan(plan: ReplayPlan) -> str:
    scope = f"destination {plan.destination}" if plan.destination else "the rows named"
    lines = [
        f"replay preview for {scope}: {len(plan.to_replay)} row(s) to replay, "
        f"{len(plan.refused) + len(plan.missing)} refused"
    ]
    if plan.to_replay:
        lines += ["", "will replay (failed -> pending, attempts reset):"]
        lines.append(
            indent(
                format_table(
                    ["id", "key", "step", "destination", "failed at", "last_error"],
                    [
                        [r.id, r.key, r.step, r.destination, cell(r.failed_at), short(r.last_error)]
                        for r in plan.to_replay
                    ],
                )
            )
        )
    if plan.refused or plan.missing:
        lines += ["", "refused (left untouched):"]
        lines += [f"  #{r.id} {r.key} {r.step}: {r.refusal()}" for r in plan.refused]
        lines += [f"  #{i}: no outbox row with id {i}" for i in plan.missing]
    lines += ["", f"plan {plan.fingerprint}"]
    return "\n".join(lines)


def render_audit(report: AuditReport) -> str:
    scope = (
        f"messages with activity since {report.since.isoformat(timespec='seconds')}"
        if report.since
        else "all messages in the database"
    )
    lines = [f"outbox audit: {scope} (at {report.generated_at.isoformat(timespec='seconds')})", ""]
    rows = [*sorted(report.destinations.values(), key=lambda d: d.destination), report.totals]
    lines.append(
        format_table(
            ["destination", *states.ALL, "total"],
            [[d.destination, *(d.states[s] for s in states.ALL), d.messages] for d in rows],
        )
    )
    lines.append("")
    lines.append(
        format_table(
            [
                "destination",
                "attempts",
                "confirmed calls",
                "sent rows",
                "claimed >1",
                "sent w/o ref",
                "confirmed >1",
                "confirmed, unsent",
                "not terminal",
            ],
            [
                [
                    d.destination,
                    d.attempts,
                    d.confirmed_calls,
                    d.sent,
                    d.claimed_more_than_once,
                    d.sent_without_ref,
                    d.double_confirmed,
                    d.confirmed_not_sent,
                    d.not_terminal,
                ]
                for d in rows
            ],
        )
    )
    lines.append("")
    if report.totals.purged.keys:
        lines.append("purged keys (key ledger):")
        lines.append(
            format_table(
                [
                    "destination",
                    *states.TERMINAL,
                    "attempts",
                    "claimed >1",
                    "sent w/o ref",
                    "confirmed >1",
                    "confirmed, unsent",
                    "ambiguous",
                ],
                [
                    [
                        d.destination,
                        *(d.purged.states.get(s, 0) for s in states.TERMINAL),
                        d.purged.attempts,
                        d.purged.claimed_more_than_once,
                        d.purged.sent_without_ref,
                        d.purged.double_confirmed,
                        d.purged.confirmed_not_sent,
                        d.purged.ambiguous,
                    ]
                    for d in rows
                    if d.purged.keys
                ],
            )
        )
        lines.append("")
    multi = report.totals.claimed_more_than_once
    if multi:
        # Retries after a certain failure are normal; this list is where to look first when
        # a customer reports two charges.
        lines.append(f"keys claimed more than once: {multi} (retries; each claim is one attempt row)")
        for e in report.multi_claimed_examples:
            lines.append(f"  #{e.id} {e.key} {e.step} [{e.destination}] {e.claims} claims, now {e.state}")
    else:
        lines.append("keys claimed more than once: 0")
    lines.append("")
    totals = report.totals
    lines.append(
        f"called again after an unsettled ambiguous call: {totals.recalled_unsettled}   "
        f"forced replays (operator, with a reason): {totals.forced_replays}"
    )
    lines.append("")
    if report.ok:
        lines.append(
            "OK: no violation: every sent row has a provider reference, no message was confirmed "
            "twice, no confirmed call is missing from the rows, no call followed an unsettled "
            "ambiguous one"
        )
    else:
        lines.append(f"FAIL: {report.violation_count} violation(s):")
        for v in report.violations:
            lines.append(f"  #{v.id} {v.key} {v.step} [{v.destination}] {v.state}: {v.detail}")
        if len(report.violations) < report.violation_count:
            lines.append(f"  … {report.violation_count - len(report.violations)} more not listed")
    return "\n".join(lines)


def _written_by(step: dict[str, Any]) -> str:
    """Who wrote a step: the application (``-``), or a step's ``then`` / ``on_failure``."""
    if not step.get("via"):
        return "-"
    if str(step["via"]).startswith("batch_"):
        return f"batch {step['via'][len('batch_') :]}"
    return f"{step['via']} of {step.get('after') or '(gone)'}"


def render_key_steps(report: KeySteps) -> str:
    """``outbox show KEY``: one line a step, its milestones, then where the key's work stopped."""
    rows = [
        [
            s["step"],
            _written_by(s),
            s["destination"],
            s["state"] + (" (purged)" if s["purged"] else ""),
            s["attempts"],
            cell(s["written"]),
            cell(s["published"]),
            cell(s["claimed"]),
            cell(s["confirmed"]),
            s["provider_ref"],
        ]
        for s in report.steps
    ]
    headers = ["step", "by", "destination", "state", "attempts", "written", "published", "first claimed"]
    table = format_table([*headers, "confirmed", "provider ref"], rows)
    stopped = report.stopped
    if stopped is None:
        verdict = f"{report.key}: every step confirmed (or cancelled)"
    elif stopped["waiting"]:
        verdict = f"{report.key}: under way at step {stopped['step']} ({stopped['state']})"
        if stopped["why"] != "under way":
            verdict += f"; last error: {short(stopped['why'])}"
    else:
        verdict = (
            f"{report.key}: stopped at step {stopped['step']} ({stopped['state']}): {short(stopped['why'])}"
        )
    return f"{table}\n\n{verdict}"


def render_chains(report: ChainsReport) -> str:
    """``outbox chains``: the chains under way, one line each, the longest waiting first, then
    how many are under way and how many keys ``--stalled`` lists."""
    lines = []
    if report.keys:
        rows = [
            [
                k["key"],
                k["step"],
                k["destination"],
                k["state"],
                age(k["age_seconds"]),
                f"{k['done']}/{k['steps']}",
            ]
            for k in report.keys
        ]
        lines.append(format_table(["key", "waiting at", "destination", "state", "for", "done"], rows))
        more = report.under_way - len(report.keys)
        if more > 0:
            lines.append(f"… and {more} more (--limit)")
        lines.append("")
    where = f" with a step of {report.destination} waiting" if report.destination else ""
    threshold = f"{report.stalled_after_seconds / 60:g}m"
    lines.append(
        f"{report.under_way} chain(s) under way{where}; {report.stalled} key(s) stopped for {threshold} "
        "or more (outbox chains --stalled lists them)"
    )
    return "\n".join(lines)


def render_stalled(report: StalledReport) -> str:
    """``outbox chains --stalled``: one line a key, the longest stopped first."""
    rows = [
        [
            k["key"],
            k["step"],
            k["destination"],
            k["state"],
            age(k["age_seconds"]),
            k["steps"],
            "yes" if k["chained"] else "no",
            short(k["why"], 70),
        ]
        for k in report.keys
    ]
    where = f" of {report.destination}" if report.destination else ""
    t = report.older_than_seconds
    threshold = next(
        (f"{t / n:g}{u}" for n, u in ((86400, "d"), (3600, "h"), (60, "m")) if t >= n and t % n == 0),
        f"{t:g}s",
    )
    if not rows:
        return f"no key{where} stopped for {threshold} or more"
    table = format_table(
        ["key", "stopped at", "destination", "state", "for", "steps", "chained", "why"], rows
    )
    more = report.matching - len(report.keys)
    tail = f"\n… and {more} more (--limit)" if more > 0 else ""
    return (
        f"{table}{tail}\n\n{report.matching} key(s){where} stopped for {threshold} or more; "
        "outbox show KEY for every step, outbox repair MODULE KEY… to resume them"
    )


def render_repair_plan(plan: RepairPlan) -> str:
    """``outbox repair`` before ``--yes``: what it will do for each key."""
    rows = [[i.key, i.step, i.state, i.action.replace("_", " "), short(i.detail, 100)] for i in plan.items]
    return format_table(["key", "stopped at", "state", "repair will", "detail"], rows)


def render_batch(report: BatchReport) -> str:
    """``outbox batch show``: the batch, its members by group, how it ends."""

    def step(s: dict[str, Any] | None) -> str:
        return f"{s['step']} -> {s['destination']}" if s else "-"

    rows = [[g, report.counts[g]] for g in ("sent", "failed", "unknown", "waiting", "cancelled")]
    lines = [
        f"batch {printable(report.name)} (id {report.id}), created {cell(report.created_at)}",
        f"then: {step(report.then_step)}    catch: {step(report.catch_step)}",
        "",
        format_table(["members", "count"], [*rows, ["total", report.total]]),
        "",
        report.ending(),
    ]
    return "\n".join(lines)


#: Each report class of outbox.ops (by name: importing them here would load SQLAlchemy), and
#: its text form.
_FORMS: dict[str, Any] = {
    "StatusReport": render_status,
    "RowDetail": render_row,
    "LedgerDetail": render_ledger,
    "RowList": render_rows,
    "ReplayPlan": render_replay_plan,
    "AuditReport": render_audit,
    "KeySteps": render_key_steps,
    "StalledReport": render_stalled,
    "ChainsReport": render_chains,
    "RepairPlan": render_repair_plan,
    "BatchReport": render_batch,
}
