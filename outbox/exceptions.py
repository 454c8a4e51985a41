"""Every error the package raises on purpose derives from :class:`OutboxError`."""

from __future__ import annotations


class OutboxError(Exception):
    """Base class of every exception raised by outbox."""


class InvalidMessage(OutboxError, ValueError):
    """The arguments of ``outbox.write`` break an input rule; nothing was sent to the database."""


class KeyConflict(OutboxError):
    """A row with this ``(key, step)`` exists with a different destination or payload."""

    def __init__(self, key: str, step: str, existing_id: int) -> None:
        super().__init__(
            f"outbox row {key}:{step} already exists (id {existing_id}) with a different "
            "destination or payload; a business key names one operation"
        )
        self.key = key
        self.step = step
        self.existing_id = existing_id


class BatchConflict(OutboxError):
    """A batch of this name exists with other ``then``/``catch`` steps, or a row was added to a
    batch that an earlier transaction created (its members are fixed once it commits)."""


class NotMigrated(OutboxError):
    """The outbox tables are missing or behind the packaged migrations."""

    def __init__(self, detail: str = "") -> None:
        msg = "the outbox schema is missing or out of date: run `outbox migrate`"
        super().__init__(f"{msg} ({detail})" if detail else msg)


class ConfigError(OutboxError, ValueError):
    """A setting, flag or handler declaration is invalid."""


class UnsafeBroker(OutboxError):
    """Redis is configured in a way that can drop queued messages (eviction, shared namespace)."""


class PermanentError(OutboxError):
    """Raised by a handler: the provider refused for good; the row becomes ``failed``."""


class RetryableError(OutboxError):
    """Raised by a handler: the call certainly did not take effect; retry with backoff."""


class AmbiguousError(OutboxError):
    """Raised by a handler: the call may have taken effect; the row becomes ``unknown``."""


class InvalidTransition(OutboxError):
    """An operator action asked for a move the row's current state does not allow."""


class NotFound(OutboxError, LookupError):
    """No outbox row matches the given id or key."""


class FeatureNotEnabled(OutboxError):
    """A row uses a feature the database refuses until an operator enables it (``outbox features
    enable NAME``): a process of an older release, still running, would break its rule."""

    def __init__(self, feature: str, detail: str = "") -> None:
        super().__init__(
            f"feature {feature} is not enabled on this database{': ' + detail if detail else ''}; "
            f"once no process older than it runs: outbox features enable {feature}"
        )
        self.feature = feature


class FeatureRefused(OutboxError):
    """``outbox features enable`` refused: a live process's code does not know the feature (its
    heartbeat names an older schema range, or none: a release before ranges)."""

    def __init__(self, feature: str, processes: list[str]) -> None:
        super().__init__(
            f"cannot enable {feature}: {len(processes)} live process(es) run code that does not "
            f"know it ({'; '.join(processes[:10])}{' …' if len(processes) > 10 else ''}); "
            "stop or upgrade them, then enable it"
        )
        self.feature = feature
        self.processes = processes
