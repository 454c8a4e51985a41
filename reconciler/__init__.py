"""The reconciler: expires leases, resolves `unknown` rows through the handlers' lookups,
re-queues lost `dispatched` rows, purges old terminal rows and reports rows that need a human.

One module per job in ``reconciler.jobs`` (``from outbox.reconciler.jobs.expire_leases import
expire_leases`` works on a plain psycopg connection); ``reconciler.scheduler`` runs them.
"""

from outbox.alerts import AlertHook, AlertRow, load_alert_hook, log_alert
from outbox.reconciler.jobs.expire_leases import expire_leases
from outbox.reconciler.jobs.purge import purge
from outbox.reconciler.jobs.redispatch import redispatch
from outbox.reconciler.jobs.resolve_unknown import resolve_unknown
from outbox.reconciler.jobs.send_alerts import send_alerts
from outbox.reconciler.scheduler import Job, Reconciler
from outbox.settlement import LookupClients

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
