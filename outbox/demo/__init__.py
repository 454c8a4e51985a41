"""``outbox demo``: the whole pipeline, end to end, with crashes injected, ending in an audit.

Tooling, not product: nothing in ``outbox``, ``relay`` or ``reconciler`` imports it. Its parts:
``arguments`` (the command line, standard library only), ``run`` (the orchestration),
``servers`` (embedded or yours), ``processes`` (the children it starts and stops), ``chaos``
(the faults), ``display`` (progress), ``report`` (the audit), and the shop it drives, shipped
here so that the demo runs from an install: ``shop`` and ``handlers``.

Light on purpose: ``outbox --help`` reads ``arguments`` without importing the demo.
"""

from __future__ import annotations
