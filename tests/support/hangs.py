"""When pytest-timeout's guard fires on a test whose event loop is still turning (a fixture's teardown awaiting
something that never completes, say), print every task of that loop with the chain of awaits it is suspended in,
down to the innermost `await` line: pytest-timeout's own dump shows only threads, and the loop's thread there is
in its selector, which names nothing.

Only the signal method (pytest-timeout's default here): its handler runs in the main thread, between two steps of
the loop, where reading the tasks is safe. The dump goes where pytest-timeout's goes (the item's captured output).
"""

from __future__ import annotations

import asyncio
import gc
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest

_FRAMES = ("cr_frame", "gi_frame", "ag_frame")
_AWAITS = ("cr_await", "gi_yieldfrom", "ag_await")


def _frame(awaitable: object) -> FrameType | None:
    return next((f for f in (getattr(awaitable, name, None) for name in _FRAMES) if f is not None), None)


def await_chain(task: asyncio.Task[Any]) -> Iterator[str]:
    """One line per coroutine, generator or async generator frame `task` is suspended in, outermost first, then
    what the innermost one awaits (a future, a task, a lock's waiter)."""
    awaited: Any = task.get_coro()
    while awaited is not None:
        frame = _frame(awaited)
        if frame is None:
            # An async generator's asend, a future's iterator: no frame of their own; what they wrap has one (an
            # async fixture's generator) or is the future waited on.
            inner = gc.get_referents(awaited)
            wrapped = next((o for o in inner if _frame(o) is not None), None)
            if wrapped is None:
                futures = [o for o in inner if asyncio.isfuture(o)]
                yield f"    awaiting {futures[0] if futures else awaited!r}"
                return
            awaited, frame = wrapped, _frame(wrapped)
        assert frame is not None
        code = frame.f_code
        yield f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}'
        awaited = next((a for a in (getattr(awaited, name, None) for name in _AWAITS) if a is not None), None)


def loop_tasks_text() -> str:
    """Every task of the running loop with its await chain; "" when no loop runs in this thread."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return ""
    blocks = []
    for task in sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name()):
        blocks.append("\n".join([repr(task), *await_chain(task)]))
    return "\n".join(blocks) + "\n"


@pytest.hookimpl(wrapper=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> object:
    """Around pytest-timeout's own timer: its SIGALRM handler, once installed, is called after the tasks' dump."""
    result = yield
    handler = signal.getsignal(signal.SIGALRM)
    if threading.current_thread() is not threading.main_thread() or not callable(handler):
        return result  # the thread method (or no timer): the loop's thread cannot be read safely from another

    def dump_tasks_then_fail(signum: int, frame: FrameType | None) -> None:
        text = loop_tasks_text()
        if text:
            terminal = item.config.get_terminal_writer()
            terminal.sep("+", title="Tasks of the running event loop")
            terminal.write(text)
        handler(signum, frame)

    signal.signal(signal.SIGALRM, dump_tasks_then_fail)
    return result
