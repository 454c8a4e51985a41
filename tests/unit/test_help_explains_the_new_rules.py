"""`outbox COMMAND --help` explains each rule an operator meets at that command: the forwarded
headers of the dashboard, the provider's answer of a resolve, the operator's failure a repair
respects, and how long a batch's name answers (the purge and the reuse rule)."""

from __future__ import annotations

import pytest

from outbox import cli


def help_of(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    ("command", "phrases"),
    [
        ("dashboard", ["OUTBOX_DASHBOARD_TRUSTED_PROXIES", "X-Forwarded-For", "--insecure-cookies"]),
        ("resolve", ["--response JSON", "response=None"]),
        ("repair", ["failed by an operator", "--force", "--reason"]),
        ("batch", ["OUTBOX_LEDGER_HORIZON", "BatchConflict", "no such batch"]),
    ],
)
def test_help_names_the_rule(command, phrases, capsys):
    text = help_of(command, capsys)
    missing = [p for p in phrases if p not in text]
    assert missing == [], text
