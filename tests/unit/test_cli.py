"""The ``outbox`` command line without services: what it imports, its shared flags, its errors."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

import outbox
from outbox import cli
from outbox.cli import exits, flags
from outbox.cli.handlers import load_handlers
from outbox.logs import JsonFormatter, KeyValueFormatter, logfmt_value

HEAVY = ("sqlalchemy", "dramatiq", "httpx", "psycopg", "redis", "alembic", "apscheduler")


def imported_by(*argv: str) -> set[str]:
    """The heavy top-level packages loaded by running `outbox ARGV` in a fresh interpreter."""
    code = textwrap.dedent(
        f"""
        import contextlib, io, sys
        from outbox.cli import main
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            main({list(argv)!r})
        print(" ".join(sorted({{m.split(".")[0] for m in sys.modules}})))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return set(proc.stdout.split()) & set(HEAVY)


@pytest.mark.parametrize("argv", [["--help"], ["status", "--help"], ["--version"]])
def test_help_imports_no_driver_or_broker(argv):
    assert imported_by(*argv) == set()


def test_import_outbox_is_lazy_and_keeps_its_public_names():
    code = "import sys, outbox; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert set(proc.stdout.split()) & set(HEAVY) == set()
    for name in outbox.__all__:
        assert getattr(outbox, name) is not None, name
    assert issubclass(outbox.ConfigError, outbox.OutboxError)
    assert "public" in (outbox.__doc__ or "") and "__all__" in (outbox.__doc__ or "")


def test_no_module_of_the_package_shadows_a_public_name():
    # `import outbox.NAME` binds the submodule as outbox.NAME: a module named like a public
    # function (write.py once was) would replace the function for every later reader.
    import importlib
    import pkgutil

    modules = {info.name for info in pkgutil.iter_modules(outbox.__path__)}
    assert modules & set(outbox.__all__) == set()
    importlib.import_module("outbox.writing")
    assert callable(outbox.write) and outbox.write.__module__ == "outbox.writing"


def test_every_registered_command_builds_and_has_a_run_function():
    parser = cli.build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) == {c.name for c in cli.COMMANDS}
    for command in cli.COMMANDS:
        assert callable(cli.registry.load(command.run)), command.name


def test_nothing_in_the_reconciler_imports_the_cli():
    import outbox.reconciler

    for path in Path(outbox.reconciler.__file__).parent.glob("*.py"):
        assert "outbox.cli" not in path.read_text(encoding="utf-8"), path


@pytest.mark.parametrize(
    "argv",
    [
        ["--log-level", "debug", "status", "--json"],
        ["status", "--log-level", "Debug", "--json"],
        ["--json", "status", "--log-level", "DEBUG"],
        ["--log-level=debug", "--json", "status"],
    ],
)
def test_global_flags_before_or_after_the_subcommand_in_any_case(argv):
    args = cli.build_parser().parse_args(argv)
    assert (args.command, args.log_level, args.json) == ("status", "DEBUG", True)


def test_shared_url_flags_before_the_subcommand():
    args = cli.build_parser().parse_args(["--database-url", "postgresql://h/db", "status"])
    assert args.database_url == "postgresql://h/db"


def test_metrics_port_on_the_services_only(capsys):
    args = cli.build_parser().parse_args(["relay", "--metrics-port", "9400"])
    assert args.metrics_port == 9400
    args = cli.build_parser().parse_args(["--metrics-port", "9401", "reconcile", "shop.handlers"])
    assert args.metrics_port == 9401
    for argv in (["relay", "--metrics-port", "0"], ["relay", "--metrics-port", "http"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == exits.CONFIG
        assert "TCP port" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--metrics-port", "9400", "status"])
    assert exit_info.value.code == exits.CONFIG
    assert "--metrics-port does not apply to `outbox status`" in capsys.readouterr().err


def test_log_level_from_the_environment(monkeypatch):
    monkeypatch.setenv("OUTBOX_LOG_LEVEL", "warning")
    args = argparse.Namespace()
    flags.defaults(args)
    assert args.log_level == "WARNING"
    monkeypatch.setenv("OUTBOX_LOG_LEVEL", "loud")
    with pytest.raises(outbox.ConfigError, match="OUTBOX_LOG_LEVEL"):
        flags.defaults(argparse.Namespace())


def test_a_bad_log_level_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--log-level", "loud", "status"])
    assert exit_info.value.code == exits.CONFIG
    assert "any case" in capsys.readouterr().err


def test_a_flag_the_subcommand_does_not_take_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--redis-url", "redis://localhost", "migrate"])
    assert exit_info.value.code == exits.CONFIG
    assert "--redis-url does not apply to `outbox migrate`" in capsys.readouterr().err
    # Asked for JSON, the refusal is the error document, worded as everywhere else.
    assert cli.main(["--json", "migrate"]) == exits.CONFIG
    out, err = capsys.readouterr()
    assert err == ""
    assert (
        json.loads(out)["error"]["message"]
        == "--json does not apply to `outbox migrate`: it prints no JSON document"
    )


def test_json_errors_are_one_document_on_stdout(capsys, monkeypatch):
    monkeypatch.delenv("OUTBOX_DATABASE_URL", raising=False)
    code = cli.main(["replay", "--json"])
    out, err = capsys.readouterr()
    assert code == exits.CONFIG and err == ""
    assert json.loads(out) == {
        "error": {
            "message": "replay takes row ids or --destination D, not both and not neither",
            "exit_code": exits.CONFIG,
        }
    }
    code = cli.main(["status", "--json"])
    out, err = capsys.readouterr()
    assert code == exits.CONFIG and err == ""
    assert "OUTBOX_DATABASE_URL" in json.loads(out)["error"]["message"]


def test_ctrl_c_in_an_operator_command_is_one_line_and_exit_130(capsys, monkeypatch):
    import outbox.cli.operator as operator

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(operator, "status", interrupted)
    assert cli.main(["status", "--database-url", "postgresql://postgres@127.0.0.1:1/x"]) == 130
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == "outbox: interrupted"
    assert cli.main(["status", "--json", "--database-url", "postgresql://postgres@127.0.0.1:1/x"]) == 130
    out, err = capsys.readouterr()
    assert json.loads(out) == {"error": {"message": "interrupted", "exit_code": exits.INTERRUPTED}}


def test_unreachable_database_as_json(capsys):
    code = cli.main(["status", "--json", "--database-url", "postgresql://postgres@127.0.0.1:1/x"])
    out, err = capsys.readouterr()
    assert code == exits.UNAVAILABLE and err == ""
    error = json.loads(out)["error"]
    assert error["exit_code"] == exits.UNAVAILABLE and error["message"].startswith("cannot reach PostgreSQL")


def test_a_handler_module_raising_on_import_is_one_config_error(tmp_path, monkeypatch):
    (tmp_path / "broken_handlers.py").write_text("raise RuntimeError('no API key\\nsecond line')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(outbox.ConfigError) as info:
        load_handlers("broken_handlers")
    assert str(info.value) == "handler module 'broken_handlers' raised RuntimeError on import: no API key"


@pytest.mark.parametrize("use_session", [True, False])
def test_write_refuses_sqlite_with_a_clear_error(use_session):
    engine = create_engine("sqlite://")
    try:
        with Session(engine) if use_session else engine.connect() as target:
            with pytest.raises(outbox.ConfigError, match="outbox needs PostgreSQL, got sqlite"):
                outbox.write(target, key="order:1", step="charge", destination="payments.charge", payload={})
    finally:
        engine.dispose()


def record(message: str = "claimed %s", *args: object, **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("outbox.test", logging.INFO, __file__, 1, message, args, None)
    rec.__dict__.update(extra)
    return rec


def test_logfmt_values_are_quoted_and_escaped():
    assert logfmt_value("payments.charge") == "payments.charge"
    assert logfmt_value("card declined") == '"card declined"'
    assert logfmt_value('say "no"') == '"say \\"no\\""'
    assert logfmt_value("a=b") == '"a=b"'
    assert logfmt_value("line\nbreak") == '"line\\nbreak"'
    assert logfmt_value("") == '""'
    line = KeyValueFormatter("%(levelname)s %(name)s %(message)s").format(
        record("row %s", 7, error="HTTP 500 body=x", token="abc", rows=3)
    )
    assert line == 'INFO outbox.test row 7 error="HTTP 500 body=x" token=*** rows=3'


def test_json_log_lines():
    line = JsonFormatter().format(record("row %s", 7, destination="payments.charge", password="p"))
    entry = json.loads(line)
    assert "\n" not in line
    assert {k: entry[k] for k in ("level", "logger", "message", "destination", "password")} == {
        "level": "INFO",
        "logger": "outbox.test",
        "message": "row 7",
        "destination": "payments.charge",
        "password": "***",
    }
    assert entry["time"].endswith("+00:00")


def test_log_format_from_the_environment(monkeypatch, capsys):
    from outbox.logs import configure

    monkeypatch.setenv("OUTBOX_LOG_FORMAT", "json")
    configure("info")
    assert isinstance(logging.getLogger().handlers[0].formatter, JsonFormatter)
    monkeypatch.setenv("OUTBOX_LOG_FORMAT", "xml")
    with pytest.raises(outbox.ConfigError, match="OUTBOX_LOG_FORMAT"):
        configure("info")


def test_a_usage_error_with_json_is_the_error_document(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["status", "--json", "--limit", "3"])
    out, err = capsys.readouterr()
    assert exit_info.value.code == exits.CONFIG and err == ""
    assert json.loads(out) == {
        "error": {"message": "outbox: unrecognized arguments: --limit 3", "exit_code": exits.CONFIG}
    }


def _stamp_a_card_check_accepts(render) -> float:
    # A timestamp whose digits, read as one run, pass the card check (about one in ten of the
    # 20:00-23:59 ones): the formatters must print it as it is.
    from outbox.sanitize import redact_text

    for ms in range(0, 4 * 3600 * 1000, 997):
        created = 1796075200.0 + ms / 1000  # 2026-11-30 20:00:00 UTC onwards
        if redact_text(render(created)) != render(created):
            return created
    raise AssertionError("no such timestamp found")


def test_log_timestamps_are_never_masked_as_card_numbers(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    import time as time_module

    time_module.tzset()
    try:
        iso = _stamp_a_card_check_accepts(
            lambda t: datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")
        )
        entry = record("row %s", 7)
        entry.created = iso
        line = json.loads(JsonFormatter().format(entry))
        assert line["time"] == datetime.fromtimestamp(iso, UTC).isoformat(timespec="milliseconds")
        assert line["message"] == "row 7"

        formatter = KeyValueFormatter("%(asctime)s %(levelname)s %(name)s %(message)s")

        def asctime(t: float) -> str:
            r = record("x")
            r.created, r.msecs = t, int((t % 1) * 1000)
            return formatter.formatTime(r)

        text_stamp = _stamp_a_card_check_accepts(asctime)
        entry = record("card 4111 1111 1111 1111")
        entry.created, entry.msecs = text_stamp, int((text_stamp % 1) * 1000)
        text = formatter.format(entry)
        assert text.startswith(asctime(text_stamp)) and "4111 1111" not in text
    finally:
        monkeypatch.delenv("TZ")
        time_module.tzset()


def test_worker_concurrency_flag_its_former_name_and_its_variable(capsys):
    from outbox import settings
    from outbox.cli.services import worker_concurrency

    def resolved(argv: list[str], env: dict[str, str] | None = None) -> int:
        args = cli.build_parser().parse_args(["worker", "shop.handlers", *argv])
        return worker_concurrency(args, settings.from_env(env or {}))

    assert resolved([]) == settings.DEFAULT_WORKER_CONCURRENCY
    assert resolved([], {"OUTBOX_WORKER_CONCURRENCY": "150"}) == 150
    assert resolved(["--concurrency", "64"], {"OUTBOX_WORKER_CONCURRENCY": "150"}) == 64
    assert capsys.readouterr().err == ""
    # The former name still works for a release, and says so once.
    assert resolved(["--threads", "12"]) == 12
    assert "--threads is deprecated, use --concurrency" in capsys.readouterr().err
    with pytest.raises(outbox.ConfigError, match="give one of them"):
        resolved(["--threads", "4", "--concurrency", "8"])
    with pytest.raises(outbox.ConfigError, match="at least 1"):
        resolved(["--concurrency", "0"])
    with pytest.raises(outbox.ConfigError, match="OUTBOX_WORKER_CONCURRENCY"):
        settings.from_env({"OUTBOX_WORKER_CONCURRENCY": "many"})


def test_bare_outbox_prints_the_command_list(capsys):
    assert cli.main([]) == exits.CONFIG
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith("usage: outbox") and "worker" in out and "run the handlers of MODULE" in out
    assert cli.main(["--log-level", "debug"]) == exits.CONFIG
    assert "reconcile" in capsys.readouterr().out


def test_the_command_list_is_grouped_one_line_a_command_and_the_same_in_help(capsys):
    # Every command in exactly one group, in the list `outbox` and `outbox --help` print.
    grouped = [name for _title, names in cli.registry.GROUPS for name in names]
    assert sorted(grouped) == sorted(c.name for c in cli.COMMANDS)
    cli.main([])
    bare = capsys.readouterr().out
    listing = cli.command_list()
    assert listing in bare
    lines = listing.splitlines()
    for title, names in cli.registry.GROUPS:
        start = lines.index(f"{title}:")
        for offset, name in enumerate(names, 1):
            assert lines[start + offset].split() == [name, *cli.BY_NAME[name].help.split()]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == exits.OK
    assert listing in capsys.readouterr().out


def test_a_mistyped_command_is_one_line_with_the_nearest_names(capsys):
    assert cli.main(["wokrer", "shop.handlers"]) == exits.CONFIG
    out, err = capsys.readouterr()
    assert out == ""
    assert err == ("outbox: error: unknown command 'wokrer'; did you mean `outbox worker`? (outbox --help)\n")
    assert cli.main(["frobnicate"]) == exits.CONFIG
    assert capsys.readouterr().err == "outbox: error: unknown command 'frobnicate' (outbox --help)\n"
    assert cli.main(["repiar"]) == exits.CONFIG
    assert "did you mean `outbox repair` or `outbox replay`?" in capsys.readouterr().err
    assert cli.main(["statsu", "--json"]) == exits.CONFIG
    out, err = capsys.readouterr()
    assert err == "" and "did you mean `outbox status`?" in json.loads(out)["error"]["message"]


def test_a_usage_error_is_one_line_naming_the_commands_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["worker", "--concurrency", "x", "shop.handlers"])
    assert exit_info.value.code == exits.CONFIG
    out, err = capsys.readouterr()
    assert out == ""
    assert (
        err == "outbox worker: error: argument --concurrency: invalid int value: 'x' (outbox worker --help)\n"
    )
    with pytest.raises(SystemExit):
        cli.main(["status", "--limit", "3"])
    assert (
        capsys.readouterr().err
        == "outbox status: error: unrecognized arguments: --limit 3 (outbox status --help)\n"
    )


@pytest.mark.parametrize("command", [c.name for c in cli.COMMANDS])
def test_every_command_reports_a_usage_error_in_one_line(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--no-such-flag"])
    assert exit_info.value.code == exits.CONFIG
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "usage:" not in err
    assert err.startswith(f"outbox {command}: error: ") and err.endswith(f"(outbox {command} --help)\n")


def test_flags_that_do_not_go_together_are_a_usage_error_too(capsys, monkeypatch):
    monkeypatch.delenv("OUTBOX_DATABASE_URL", raising=False)
    assert cli.main(["replay"]) == exits.CONFIG
    assert capsys.readouterr().err == (
        "outbox replay: error: replay takes row ids or --destination D, not both and not neither "
        "(outbox replay --help)\n"
    )
    assert cli.main(["status", "--count", "2"]) == exits.CONFIG
    assert (
        capsys.readouterr().err
        == "outbox status: error: --interval and --count go with --watch (outbox status --help)\n"
    )
    # A setting is a configuration error, not a usage one: no command's help would fix it.
    assert cli.main(["status"]) == exits.CONFIG
    err = capsys.readouterr().err
    assert err.startswith("outbox: ") and "OUTBOX_DATABASE_URL" in err


@pytest.mark.parametrize("command", [c.name for c in cli.COMMANDS if flags.JSON not in c.flags])
def test_json_is_refused_one_way_by_every_command_that_prints_none(command, capsys):
    expected = f"--json does not apply to `outbox {command}`: it prints no JSON document"
    for argv in (["--json", command], [command, "--json"]):
        assert cli.main(argv) == exits.CONFIG
        out, err = capsys.readouterr()
        assert err == ""
        assert json.loads(out) == {"error": {"message": expected, "exit_code": exits.CONFIG}}


# MODULE, the first argument of every command taking the user's module.

#: Each command taking MODULE: its arguments besides MODULE, and whether MODULE is required.
MODULE_COMMANDS = {
    "worker": ([], True),
    "reconcile": ([], True),
    "doctor": ([], False),
    "dashboard": ([], False),
    "resolve": (["42", "--not-sent"], False),
    "repair": (["order:1"], True),
}


def _parsed(argv: list[str]) -> argparse.Namespace:
    args = cli.build_parser([argv[0]]).parse_args(argv)
    cli.resolve_module(args, argv[0])
    return args


@pytest.mark.parametrize("command", MODULE_COMMANDS)
def test_module_is_the_first_argument(command, capsys):
    rest, required = MODULE_COMMANDS[command]
    args = _parsed([command, "shop.handlers", *rest])
    assert args.module == "shop.handlers"
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    shown = capsys.readouterr().out
    usage = shown.split("\n\n")[0]
    assert "MODULE" in usage and ("[MODULE]" in usage) is not required and "--module" not in shown


@pytest.mark.parametrize("command", MODULE_COMMANDS)
def test_module_flag_still_works_for_a_release_with_one_line_saying_so(command, capsys):
    rest, _required = MODULE_COMMANDS[command]
    args = _parsed([command, *rest, "--module", "shop.handlers"])
    assert args.module == "shop.handlers"
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(
        f"outbox {command}: --module is deprecated; pass MODULE as the first argument: "
        f"outbox {command} shop.handlers"
    )
    if command == "repair":
        assert args.keys == ["order:1"]
    if command == "resolve":
        assert args.id == "42"


@pytest.mark.parametrize("command", MODULE_COMMANDS)
def test_module_both_ways_or_missing_where_required_is_a_usage_error(command, capsys, monkeypatch):
    rest, required = MODULE_COMMANDS[command]
    monkeypatch.delenv("OUTBOX_DATABASE_URL", raising=False)
    extra = ["--stalled"] if command == "repair" else []
    positional = [] if command == "repair" else rest
    assert cli.main([command, "a.handlers", *positional, *extra, "--module", "b.handlers"]) == exits.CONFIG
    out, err = capsys.readouterr()
    assert out == "" and err == (
        f"outbox {command}: error: MODULE given twice (a.handlers and --module b.handlers): give it "
        f"once, as the first argument (outbox {command} --help)\n"
    )
    if required:
        assert cli.main([command]) == exits.CONFIG
        err = capsys.readouterr().err
        assert err.startswith(f"outbox {command}: error: MODULE is required") and err.count("\n") == 1
        assert f"outbox {command} myapp.handlers" in err


def test_resolve_takes_module_before_the_row_id(capsys, monkeypatch):
    monkeypatch.delenv("OUTBOX_DATABASE_URL", raising=False)
    args = _parsed(["resolve", "42", "--sent", "ch_1"])
    assert (args.module, args.id) == (None, "42")
    assert cli.main(["resolve", "42", "shop.handlers", "--sent", "ch_1"]) == exits.CONFIG
    assert capsys.readouterr().err == (
        "outbox resolve: error: MODULE comes before the row id: outbox resolve myapp.handlers 42 … "
        "(outbox resolve --help)\n"
    )


def test_module_flag_through_the_console_script():
    # The installed entry point, as an operator types it: the line, then the usage error (MODULE
    # twice), both on stderr, nothing on stdout.
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    proc = subprocess.run(
        [sys.executable, "-m", "outbox", "worker", "a.handlers", "--module", "b.handlers"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == exits.CONFIG and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "outbox worker: error: MODULE given twice (a.handlers and --module b.handlers): give it once, "
        "as the first argument (outbox worker --help)"
    ]
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "outbox", "repair", "--stalled", "--module", "outbox.demo.invoicing"),
            *("--yes", "--database-url", "postgresql://postgres@127.0.0.1:1/x"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    # The deprecation line, then the unreachable database: --module was taken as MODULE.
    assert proc.returncode == exits.UNAVAILABLE
    lines = proc.stderr.splitlines()
    assert lines[0] == (
        "outbox repair: --module is deprecated; pass MODULE as the first argument: "
        "outbox repair outbox.demo.invoicing KEY… (--module goes in the next release)"
    )
    assert lines[-1].startswith("outbox: cannot reach PostgreSQL")


def test_doctor_verdict_counts_warnings():
    from outbox.cli.operator import doctor_verdict
    from outbox.ops.doctor import FAIL, OK, WARN, Check

    ok, warn, fail = Check("a", OK, ""), Check("b", WARN, ""), Check("c", FAIL, "")
    assert doctor_verdict([ok, ok]) == "all checks passed"
    assert doctor_verdict([ok, warn, warn]) == "passed with 2 warning(s)"
    assert doctor_verdict([ok, fail]) == "1 check(s) failed"
    assert doctor_verdict([warn, fail, fail]) == "2 check(s) failed, 1 warning(s)"
