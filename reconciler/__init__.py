"""The reconciler: expires leases, resolves `unknown` rows through the handlers' lookups,
re-queues lost `dispatched` rows, purges old terminal rows and reports rows that need a human.

``from reconciler.jobs import expire_leases`` works on its own (a plain psycopg connection).
"""

from reconciler.alerts import AlertHook, AlertRow, load_alert_hook, log_alert
from reconciler.jobs import LookupClients, expire_leases, purge, redispatch, resolve_unknown, send_alerts
from reconciler.scheduler import Job, Reconciler

__all__ = [
    "AlertHook",
    "AlertRow",
    "Job",
    "LookupClients",
    "Reconciler",
    "expire_leases",
    "load_alert_hook",
    "log_alert",
    "purge",
    "redispatch",
    "resolve_unknown",
    "send_alerts",
]
