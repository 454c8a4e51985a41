"""The operator's CLI as a new user finds it: one line (or one JSON document) for every error,
on an unmigrated database, for a refusal, for a handler module that raises."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from sqlalchemy.orm import Session

import outbox
from outbox.cli import exits, main

from .test_ops import make_failed, make_sent


def write(engine, key: str) -> int:
    with Session(engine) as session, session.begin():
        return outbox.write(session, key=key, step="charge", destination="payments.charge", payload={}).id


@pytest.mark.parametrize(
    "argv",
    [
        ["status"],
        ["show", "1"],
        ["failed"],
        ["unknown"],
        ["audit"],
        ["replay", "1"],
        ["resolve", "1", "--not-sent"],
    ],
)
def test_operator_commands_on_an_unmigrated_database_say_run_migrate(empty_database_url, capsys, argv):
    code = main([*argv, "--database-url", empty_database_url])
    out, err = capsys.readouterr()
    assert code == exits.FAILED and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "run `outbox migrate`" in err

    code = main([*argv, "--json", "--database-url", empty_database_url])
    out, err = capsys.readouterr()
    assert code == exits.FAILED and err == ""
    error = json.loads(out)["error"]
    assert error["exit_code"] == exits.FAILED and "run `outbox migrate`" in error["message"]


def test_resolve_json_refusal_is_an_error_document(clean, engine, capsys):
    sent = write(engine, "order:1")
    make_sent(clean, sent)
    code = main(["resolve", str(sent), "--sent", "ch_2", "--json", "--database-url", clean.database_url])
    out, err = capsys.readouterr()
    assert code == exits.FAILED and err == ""
    assert json.loads(out) == {
        "error": {"message": f"row {sent} is sent, only unknown rows can be resolved", "exit_code": 1}
    }


def test_replay_json_refusal_carries_the_error_member(clean, engine, capsys):
    sent, failed = write(engine, "order:1"), write(engine, "order:2")
    make_sent(clean, sent)
    make_failed(clean, failed)
    code = main(["replay", str(sent), "--json", "--database-url", clean.database_url])
    data = json.loads(capsys.readouterr().out)
    assert code == exits.FAILED
    assert data["error"] == {
        "message": f"row {sent} is sent, only failed rows can be replayed",
        "exit_code": exits.FAILED,
    }
    code = main(["replay", str(failed), "--json", "--database-url", clean.database_url])
    data = json.loads(capsys.readouterr().out)
    assert code == exits.OK and "error" not in data and data["replayed"] == 1


@pytest.mark.parametrize("command", ["worker", "reconcile"])
def test_a_handler_module_raising_on_import_is_one_line(clean, tmp_path, command):
    (tmp_path / "raising_handlers.py").write_text("import os\nos.environ['NO_SUCH_KEY_FOR_TEST']\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]),
        OUTBOX_DATABASE_URL=clean.database_url,
        OUTBOX_REDIS_URL=clean.redis_url,
        OUTBOX_NAMESPACE=clean.namespace,
    )
    extra = ["--once"] if command == "reconcile" else []
    proc = subprocess.run(
        [sys.executable, "-m", "outbox", command, "raising_handlers", *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == exits.CONFIG, proc
    assert "Traceback" not in proc.stderr
    [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("outbox:")]
    assert line == (
        "outbox: handler module 'raising_handlers' raised KeyError on import: 'NO_SUCH_KEY_FOR_TEST'"
    )
