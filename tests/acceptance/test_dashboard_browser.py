"""The dashboard in a real browser (issue 16): Playwright drives Debian's Chromium against
``outbox dashboard`` served by uvicorn as a real process, with ``outbox relay`` and ``outbox
worker`` running against the same PostgreSQL and Redis and the provider simulator.

An operator logs in, searches a key, reads its attempts (a declined charge), replays the failed
row from the failed list through the preview, and watches it reach ``sent``; a read-only user
sees no action and is refused when it posts one anyway; a POST without the CSRF token is refused.
Screenshots go to ``.artifacts/dashboard/`` (or ``$OUTBOX_ARTIFACTS``).

Needs Chromium (``apt-get install chromium``; ``.ci/run`` installs it when missing): without it
these tests are skipped, and say why.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import sql, wait_for
from sqlalchemy.orm import Session

import outbox
from outbox.dashboard import hash_password

from .support import Processes

pytestmark = [pytest.mark.timeout(180), pytest.mark.browser]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# As root, in a container, on a machine whose network is closed: no sandbox, no background calls.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = (
    Path(os.environ.get("OUTBOX_ARTIFACTS", Path(__file__).resolve().parents[2] / ".artifacts")) / "dashboard"
)
SECRET = "browser-test-secret-0123456789abcdef"
PASSWORDS = {"olga": "operator-pw-1", "rita": "reader-pw-1"}


def _playwright() -> Any:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:  # pragma: no cover - the dev extra installs it
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    if CHROMIUM is None:
        pytest.skip(
            "Chromium is not installed (apt-get install chromium; .ci/run installs it): browser tests skipped"
        )
    return sync_playwright


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def served(clean: Any, provider: Any, tmp_path: Path) -> Any:
    """``outbox dashboard`` (a real uvicorn process), relay and worker, all real processes."""
    sync_playwright = _playwright()
    users = tmp_path / "users"
    users.write_text(
        f"olga operate {hash_password(PASSWORDS['olga'])}\nrita read {hash_password(PASSWORDS['rita'])}\n"
    )
    procs = Processes(clean, provider.url, tmp_path)
    port = _free_port()
    dashboard = procs.start(
        "dashboard",
        "--port",
        str(port),
        "--users",
        str(users),
        "--insecure-cookies",  # plain HTTP on 127.0.0.1
        OUTBOX_DASHBOARD_SECRET=SECRET,
    )
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return True
        except OSError:
            assert dashboard.poll() is None, procs.logs()
            return False

    wait_for(up, 30, f"the dashboard to listen\n{procs.logs()}")
    procs.start("relay")
    procs.start("worker", "examples.shop.handlers", "--concurrency", "2")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield base, browser, procs
        finally:
            browser.close()
            procs.stop_all()


def _login(browser: Any, base: str, user: str) -> Any:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{base}/")
    assert "/login" in page.url, "an anonymous visit did not land on the login page"
    page.fill("input[name=user]", user)
    page.fill("input[name=password]", PASSWORDS[user])
    page.click("form.login button[type=submit]")
    page.wait_for_selector("header .who")
    return page


def _write_order(engine: Any, key: str) -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(
            s,
            key=key,
            step="charge",
            destination="payments.charge",
            payload={"amount_cents": 4200, "currency": "EUR"},
        ).id


def _state(clean: Any, row: int) -> str:
    return str(sql(clean, "SELECT state FROM outbox_message WHERE id = %s", (row,))[0][0])


def test_an_operator_searches_reads_the_attempts_and_replays_through_the_preview(
    served: Any, clean: Any, engine: Any, provider: Any
) -> None:
    base, browser, procs = served
    provider.configure(fault_next=["decline"])
    row = _write_order(engine, "order:77")
    wait_for(lambda: _state(clean, row) == "failed", 30, f"the declined charge to fail\n{procs.logs()}")

    page = _login(browser, base, "olga")
    page.screenshot(path=str(ARTIFACTS / "01-overview.png"), full_page=True)
    assert page.locator(".card.bad").count() >= 1, "the overview does not flag the failed row"

    page.fill("form.search input[name=q]", "order:77")
    page.press("form.search input[name=q]", "Enter")
    page.wait_for_url("**/keys?key=order%3A77")
    page.click(f"a[href='/rows/{row}']")
    page.wait_for_selector("table.attempts")
    attempts = page.locator("table.attempts tbody tr")
    # Every attempt row is shown: one, unless a loaded machine made the first call outlive its time
    # limit (unknown, looked up, not found, called again: the decline came on the second).
    stored = sql(clean, "SELECT count(*) FROM outbox_attempt WHERE message_id = %s", (row,))[0][0]
    assert stored >= 1 and attempts.count() == stored
    shown = page.locator("table.attempts").inner_text()
    assert "declined" in shown or "failed" in shown
    page.screenshot(path=str(ARTIFACTS / "02-row-failed.png"), full_page=True)

    page.click("nav a[href='/rows?state=failed']")
    page.wait_for_selector("form.bulk")
    page.click("form.bulk button[value=replay]")
    page.wait_for_selector("form.confirm")
    assert "Nothing has been done yet" in page.content()
    assert _state(clean, row) == "failed", "the preview acted"
    page.screenshot(path=str(ARTIFACTS / "03-replay-preview.png"), full_page=True)
    page.fill("form.confirm input[name=reason]", "customer updated the card")
    page.click("form.confirm button[type=submit]")
    page.wait_for_selector("ul.done")
    page.screenshot(path=str(ARTIFACTS / "04-replayed.png"), full_page=True)

    wait_for(lambda: _state(clean, row) == "sent", 30, f"the replayed row to be sent\n{procs.logs()}")
    page.goto(f"{base}/rows/{row}")
    assert page.locator("h1 .state").inner_text() == "sent"
    assert page.locator("table.attempts tbody tr").count() == 2
    assert "customer updated the card" in page.locator("ul.history").inner_text()
    assert "olga (dashboard)" in page.locator("ul.history").inner_text()
    page.screenshot(path=str(ARTIFACTS / "05-row-sent.png"), full_page=True)
    assert provider.stats()["charges"] == 1  # one decline, then one charge


def test_a_reader_is_refused_and_a_post_without_csrf_is_refused(
    served: Any, clean: Any, engine: Any, provider: Any
) -> None:
    base, browser, procs = served
    provider.configure(fault_next=["decline"])
    row = _write_order(engine, "order:78")
    wait_for(lambda: _state(clean, row) == "failed", 30, f"the declined charge to fail\n{procs.logs()}")

    page = _login(browser, base, "rita")
    page.goto(f"{base}/rows/{row}")
    assert page.locator("section.actions").count() == 0, "a reader is offered actions"
    assert "payload is hidden" in page.content()
    page.screenshot(path=str(ARTIFACTS / "06-reader-row.png"), full_page=True)
    token = page.locator("form.logout input[name=csrf_token]").get_attribute("value")
    refused = page.request.post(
        f"{base}/preview", form={"action": "replay", "id": str(row), "csrf_token": token}
    )
    assert refused.status == 403

    operator = _login(browser, base, "olga")
    no_token = operator.request.post(f"{base}/preview", form={"action": "replay", "id": str(row)})
    assert no_token.status == 403 and "CSRF" in no_token.text()
    operator.set_content(no_token.text())
    operator.screenshot(path=str(ARTIFACTS / "07-csrf-refused.png"))
    assert _state(clean, row) == "failed"


def test_the_dashboard_command_without_users_names_the_variable(
    clean: Any, provider: Any, tmp_path: Path
) -> None:
    procs = Processes(clean, provider.url, tmp_path)
    try:
        proc = procs.start("dashboard", "--port", str(_free_port()), OUTBOX_DASHBOARD_SECRET=SECRET)
        assert proc.wait(30) == 2
        log = procs.logs()
        assert "OUTBOX_DASHBOARD_USERS" in log and "Traceback" not in log
    finally:
        procs.stop_all()


def test_hash_password_reads_stdin(tmp_path: Path) -> None:
    from outbox.dashboard.security import verify_password

    out = subprocess.run(
        [sys.executable, "-m", "outbox", "dashboard", "--hash-password"],
        input="correct horse\n",
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    assert out.startswith("scrypt$") and verify_password("correct horse", out)
    assert not verify_password("wrong", out)
