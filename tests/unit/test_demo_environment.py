"""The environment does not configure ``outbox demo``: OUTBOX_* variables are the application's,
so one the application reads wrongly, or not at all, must not stop the demo. The CLI used to read
and validate every OUTBOX_* variable before any command ran, the demo's included."""

from __future__ import annotations

import pytest

from outbox import cli
from outbox.cli import registry

# The demo is stopped here, by its own check of its own command line, before it starts anything.
DEMO = ["demo", "--plain", "--database-url", "mysql://demo-check"]

MALFORMED = [
    ("OUTBOX_POLL_INTERVAL", "abc"),
    ("OUTBOX_METRICS_PORT", "x"),
    ("OUTBOX_NAMESPACE", "no spaces allowed"),
    ("OUTBOX_LEDGER_HORIZON", "1d"),  # shorter than the default retention
    ("OUTBOX_DATABASE_URL", "mysql://app"),
    ("OUTBOX_REDIS_URL", "memcached://app"),
    ("OUTBOX_LOG_LEVEL", "loud"),
    ("OUTBOX_LOG_FORMAT", "xml"),
]


@pytest.mark.parametrize(("name", "value"), MALFORMED)
def test_a_malformed_outbox_variable_does_not_stop_the_demo(name, value, monkeypatch, capsys):
    monkeypatch.setenv(name, value)
    code = cli.main(DEMO)
    err = capsys.readouterr().err
    # What stops it is the demo's own flag, never the application's variable.
    assert code == 2, err
    assert "--database-url" in err and "mysql://demo-check" in err, err
    assert name not in err, err


def test_the_demo_is_the_one_command_the_environment_does_not_configure():
    assert [c.name for c in registry.COMMANDS if not c.environment] == ["demo"]


def test_the_demos_log_level_help_does_not_promise_the_environment(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "OUTBOX_LOG_LEVEL" not in out, out
    with pytest.raises(SystemExit):
        cli.main(["status", "--help"])
    assert "OUTBOX_LOG_LEVEL" in capsys.readouterr().out
