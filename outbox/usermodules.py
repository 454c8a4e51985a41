"""Importing the application's own modules by name: handler modules and alert hooks."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType


def import_user_module(name: str) -> ModuleType:
    """``importlib.import_module(name)``, with the working directory on ``sys.path``.

    As uvicorn's and Dramatiq's command lines do: ``outbox worker myapp.handlers`` run from the
    application's directory finds ``myapp`` without ``PYTHONPATH``. The directory goes last, after
    what is installed, so that a file of the application named like a library (``redis.py``)
    cannot replace the library for the modules outbox imports later.
    """
    here = os.getcwd()
    if not any(os.path.abspath(entry or os.curdir) == here for entry in sys.path):
        sys.path.append(here)
    return importlib.import_module(name)
