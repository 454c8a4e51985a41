"""Texts the outbox writes itself ("no consumer for D since T, K rows waiting", a deadline reason)
go through the card-number masking of alert, log and error text: a timestamp and the numbers
beside it must never read as one card number."""

from datetime import UTC, datetime, timedelta

from outbox.heartbeat import NoConsumer
from outbox.sanitize import redact_text

COUNTS = (1, 3, 42, 12345, 9_876_543)


def _times():
    start = datetime(2026, 12, 3, tzinfo=UTC)
    return [start + timedelta(seconds=s) for s in range(0, 86_400, 7)]


def test_no_timestamp_and_count_is_masked_as_a_card_number() -> None:
    for since in _times():
        for count in COUNTS:
            text = NoConsumer("payments.charge", count, since, 1).describe()
            assert redact_text(text) == text, text
            assert f"{count} rows waiting" in text


def test_the_space_separated_form_it_replaced_was_masked_on_some_days() -> None:
    # Why the timestamp carries "T" and "Z": with a space and "+00:00, " the date, the time and
    # the count formed one digit run, and about one in ten passed the Luhn check (CI saw
    # "since [card ****0003] rows waiting").
    masked = [
        since
        for since in _times()
        if "[card" in redact_text(f"since {since.isoformat(sep=' ', timespec='seconds')}, 3 rows waiting")
    ]
    assert masked


def test_a_deadline_reason_keeps_its_time_whatever_the_microseconds() -> None:
    # "23:59:59.999999+00:00" held 14 digits starting with 2: one in ten was masked.
    from outbox.policy import deadline_error

    start = datetime(2026, 12, 3, 23, 0, tzinfo=UTC)
    for n in range(5000):
        at = start + timedelta(seconds=n * 0.7, microseconds=n * 137)
        text = deadline_error(at, "HTTP 503") or ""
        assert redact_text(text) == text, text
