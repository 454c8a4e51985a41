"""Payload models and versions: what a handler accepts, and old payloads brought up to date.

A handler may declare ``payload_model=Model`` (a pydantic model, or any class with a
``model_validate`` class method) and ``upgrades={1: fn, 2: fn}``. A row carries the version its
writer meant (``outbox_message.payload_version``, default 1). The handler's *current* version is
the model's ``payload_version`` class attribute (``payload_version: ClassVar[int] = 3``), else
one past the highest upgrade, else 1.

Before a call the worker brings the payload to the current version (``upgrades[v]`` turns a
version ``v`` payload into version ``v + 1``; a version without an upgrade is taken as it is:
a bump that added an optional field needs none) and validates it against the model:

* invalid: the row fails with the validation message, before any call (certain, never retried);
* newer than the current version (new writers deployed before the workers): the claim is released
  for a newer worker, no attempt spent (``outbox.consumer``).

``outbox.write(..., validate=True)`` runs the same check in the writer, and
``outbox doctor MODULE --payloads`` runs it over every waiting row before a deploy.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .exceptions import InvalidMessage

#: Seconds a row whose payload is newer than this worker's handler waits before it is published
#: again (for a newer worker); its claim is released, no attempt spent.
NEWER_PAYLOAD_RETRY_SECONDS = 30.0
#: A row waiting that long for a newer worker is logged at ERROR (the deploy is stuck half-way).
NEWER_PAYLOAD_ALERT_AFTER_SECONDS = 900.0

Upgrade = Callable[[dict[str, Any]], dict[str, Any]]


class PayloadInvalid(InvalidMessage):
    """The payload does not fit the handler's model (after its upgrades)."""


class PayloadTooNew(InvalidMessage):
    """The row's payload version is newer than the handler knows: a newer worker delivers it."""


@dataclass(frozen=True)
class Prepared:
    """A payload at the handler's current version: the dict the handler sees, and the model
    instance (None without a model)."""

    payload: dict[str, Any]
    model: Any = None


def imported_handler(destination: str) -> Any:
    """The handler of ``destination`` when this process imported it, else None; without
    importing ``outbox.handlers`` (and httpx) into a process that only writes."""
    module = sys.modules.get("outbox.handlers")
    return module.registered(destination) if module is not None else None


def declared_version(model: Any, upgrades: Mapping[int, Upgrade] | None) -> int:
    version = getattr(model, "payload_version", None) if model is not None else None
    if version is not None:
        return int(version)
    return max(upgrades) + 1 if upgrades else 1


def declaration_problems(model: Any, upgrades: Any) -> list[str]:
    problems: list[str] = []
    if model is not None and not callable(getattr(model, "model_validate", None)):
        problems.append(
            f"payload_model must be a pydantic model (a class with model_validate), got {model!r}"
        )
    if upgrades is not None:
        if not isinstance(upgrades, Mapping):
            return [
                *problems,
                f"upgrades must be a dict {{version: function}}, got {type(upgrades).__name__}",
            ]
        for version, fn in upgrades.items():
            if not _is_version(version):
                problems.append(f"upgrades: version {version!r} is not a whole number >= 1")
            if not callable(fn):
                problems.append(f"upgrades[{version!r}] is not callable")
    if problems:
        return problems
    version = getattr(model, "payload_version", None) if model is not None else None
    if version is not None and not _is_version(version):
        return [f"{model.__name__}.payload_version must be a whole number >= 1, got {version!r}"]
    current = declared_version(model, upgrades)
    too_new = sorted(v for v in upgrades or {} if v >= current)
    if too_new:
        problems.append(
            f"upgrades {too_new} reach past the current payload version {current} "
            "(upgrades[v] turns version v into v + 1)"
        )
    return problems


def _is_version(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_version(value: Any) -> int:
    """``write(payload_version=)``: a whole number >= 1."""
    if not _is_version(value):
        raise InvalidMessage(f"payload_version must be a whole number >= 1, got {value!r}")
    return int(value)


def prepare(
    *,
    destination: str,
    model: Any,
    upgrades: Mapping[int, Upgrade] | None,
    payload: Mapping[str, Any],
    version: int,
) -> Prepared:
    """``payload`` (at ``version``) brought to the current version and validated.

    Raises :class:`PayloadTooNew` or :class:`PayloadInvalid` (with the validation message). An
    upgrade that raises, or returns something that is not a JSON object, is PayloadInvalid too.
    """
    current = declared_version(model, upgrades)
    if version > current:
        raise PayloadTooNew(
            f"payload version {version} of {destination} is newer than this handler's "
            f"({current}): left for a worker running the newer release"
        )
    if not isinstance(payload, Mapping):
        # A plain-SQL writer may store any jsonb.
        raise PayloadInvalid(
            f"payload of {destination} is a JSON {_json_kind(payload)}, not an object; no handler "
            "version reads it"
        )
    data: dict[str, Any] = dict(payload)
    for v in range(version, current):
        upgrade = (upgrades or {}).get(v)
        if upgrade is None:
            continue
        name = getattr(upgrade, "__qualname__", repr(upgrade))
        try:
            # A copy: an upgrade that changes its argument in place must not reach the stored row.
            upgraded = upgrade(json.loads(json.dumps(data)))
        except Exception as exc:
            raise PayloadInvalid(
                f"payload of {destination}: upgrade {v} -> {v + 1} ({name}) raised "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(upgraded, dict):
            raise PayloadInvalid(
                f"payload of {destination}: upgrade {v} -> {v + 1} ({name}) returned "
                f"{type(upgraded).__name__}, expected a dict"
            )
        data = upgraded
    if model is None:
        return Prepared(data)
    try:
        instance = model.model_validate(data)
    except Exception as exc:
        raise PayloadInvalid(
            f"payload of {destination} (version {version}"
            f"{f', upgraded to {current}' if version < current else ''}) does not match "
            f"{model.__name__}: {_describe(exc)}"
        ) from exc
    return Prepared(data, instance)


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return "null" if value is None else type(value).__name__


def _describe(exc: Exception) -> str:
    """A pydantic ValidationError as one line per field (``field: message``), the input values
    left out (a payload may carry personal data); anything else as its text."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            items = errors(include_input=False, include_url=False)
        except TypeError:
            items = None
        if isinstance(items, list):
            parts = [
                f"{'.'.join(str(p) for p in item.get('loc', ())) or '(payload)'}: {item.get('msg', '?')}"
                for item in items
            ]
            return "; ".join(parts)
    return f"{type(exc).__name__}: {exc}"


class Unreadable:
    """A stored value this process cannot load, in place of the value: a ``jsonb`` nested deeper
    than Python's JSON parser goes (written by plain SQL; ``outbox.write`` cannot write one),
    as outbox.db.tolerate_unloadable loads it. A claimed row whose payload is one is settled
    before any call (outbox.consumer.preflight)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"Unreadable({self.reason!r})"
