"""The reconciler's jobs, one module each (River's ``internal/maintenance`` layout).

Each module holds a job's statements, its function of a connection (``expire_leases``,
``resolve_unknown``, ``redispatch``, ``purge``, ``send_alerts``, ``no_consumer``,
``held_destinations``), a frozen
config (timings in ``*_seconds``, batch sizes) and a job object whose ``run_once(conn)`` returns
the counts of what it did: ``{}`` when it had nothing to do.

Every transition is one guarded statement: the row moves only if it is still in the state (and
under the claim token, or dispatch time) the job read, so a consumer, an operator or another
reconciler acting at the same moment wins cleanly and the job just counts the row as ``raced``.

Connections are psycopg connections in autocommit mode: every statement is its own short
transaction, and nothing is held open while a lookup talks to a provider. Only
``expire_leases`` also works inside a caller's transaction (the caller commits).

Import a job from its module (``from outbox.reconciler.jobs.purge import purge``): this package
re-exports nothing, so that ``reconciler.jobs.purge`` stays the module.
"""
