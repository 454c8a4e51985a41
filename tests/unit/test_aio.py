"""The process's event loop (outbox.aio) outlives what one coroutine raises."""

from __future__ import annotations

import pytest

from outbox import aio


@pytest.mark.parametrize("escape", [SystemExit, KeyboardInterrupt])
def test_a_coroutine_that_raises_systemexit_or_keyboardinterrupt_leaves_the_loop_running(escape):
    """An ``async def`` lookup or handler that calls sys.exit() (or is interrupted) ends its own
    call, raised in the thread that waits for it; the loop every other async call of the process
    shares goes on."""

    async def bails_out() -> None:
        raise escape()

    async def answers() -> str:
        return "still here"

    aio.loop()
    with pytest.raises(escape):
        aio.run(bails_out(), timeout_seconds=5)
    assert aio.alive()
    assert aio.run(answers(), timeout_seconds=5) == "still here"
