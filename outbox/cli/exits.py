"""The exit codes of every ``outbox`` command, defined once (documented in docs/cli.md)."""

from __future__ import annotations

#: Success: the command did what was asked, or the check passed.
OK = 0
#: A refusal or a failed check: a row refused or missing, a violation, a check that failed, a
#: plan that no longer matches, a schema that is not migrated, a handler module that fails.
FAILED = 1
#: Usage or configuration: a bad flag or setting, a missing URL, an optional package not installed
#: (the error names its extra: outbox.cli.extras). argparse uses 2 as well.
CONFIG = 2
#: A service cannot be reached: PostgreSQL or Redis.
UNAVAILABLE = 3
#: Interrupted (Ctrl-C) before the command finished: what it did so far is committed or not
#: by its own transaction, never half.
INTERRUPTED = 130
