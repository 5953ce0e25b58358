"""`python -m gym_rpc` and the `gym-rpc` command (pyproject's [project.scripts]): the CLI, exiting 130 on Ctrl-C.

Exit code 130 is documented for Ctrl-C whenever it comes, yet `gym_rpc.cli` takes a good part of a second to import
(grpc, pydantic; seconds on a loaded machine), and a KeyboardInterrupt escaping to the interpreter kills the
process by SIGINT instead (returncode -2). So nothing but `signal` and `sys` is imported before the `try`.
"""

from __future__ import annotations

import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

EXIT_INTERRUPTED = 130  # gym_rpc.cli.EXIT_INTERRUPTED: importing it from there is what may be interrupted
REDELIVERY_SECONDS = 0.01  # long enough for the callback that dropped a Ctrl-C to have returned


def main() -> None:
    run_until_interrupted(_command_line)


def _command_line() -> None:
    from gym_rpc.cli import main as run_command

    run_command()  # ends in SystemExit with the command's code


def run_until_interrupted(command: Callable[[], None]) -> None:
    """Run `command`; a Ctrl-C at any point of it (its imports included) ends the process with exit code 130."""
    sys.unraisablehook = _redelivering_interrupts(sys.unraisablehook)
    try:
        try:
            command()
        finally:
            _ending()
    except KeyboardInterrupt:  # also a second Ctrl-C that came before `_ending` ignored SIGINT
        _ending()
        sys.exit(EXIT_INTERRUPTED)


def _redelivering_interrupts(previous: Callable[[sys.UnraisableHookArgs], object]) -> Callable[..., None]:
    """An unraisable-exception hook that delivers a dropped Ctrl-C again.

    A SIGINT that lands while Python runs code that cannot raise (a weakref callback, such as the one importlib
    runs to drop a module lock, or a __del__) is printed as "Exception ignored" and lost: the command runs on, a
    watch forever. A thread sends it again once that code has returned, and never while this hook runs: raised in
    the hook, it would be lost with the hook's own error (soak run B3 of 2026-12-06: a timer due 10 ms on fired
    while the hook, starved on a loaded machine, still waited in `Thread.start`).
    """
    hooks_running = [0]  # how many calls of the hook have not returned yet (a callback may run inside one)

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            previous(unraisable)
            return
        hooks_running[0] += 1
        try:
            import _thread
            import functools
            import threading

            send: Callable[[], object] = _thread.interrupt_main  # Windows: flagged for the next instruction
            if hasattr(signal, "pthread_kill"):  # a real signal: a sleep or a blocking call wakes
                main_thread = threading.main_thread().ident
                assert main_thread is not None  # it runs: this process is running Python
                send = functools.partial(signal.pthread_kill, main_thread, signal.SIGINT)
            threading.Thread(target=_send_once_returned, args=(hooks_running, send), daemon=True).start()
        finally:
            # The hook's last statement: Python checks for signals nowhere between it and the return.
            hooks_running[0] -= 1

    return hook


def _send_once_returned(hooks_running: list[int], send: Callable[[], object]) -> None:
    import time

    time.sleep(REDELIVERY_SECONDS)
    while hooks_running[0]:  # the hook is still running (a starved main thread): wait for its return
        time.sleep(REDELIVERY_SECONDS)
    send()


def _ending() -> None:
    """Keep the exit code the command chose from here on, whatever Ctrl-C does.

    SIGINT is ignored: the interpreter restores its default action while it shuts down, where a second Ctrl-C would
    kill the process. And CPython marks a KeyboardInterrupt raised inside code run from a string (a namedtuple or
    dataclass being made while a module imports) as unhandled even when it was caught, and then `python -m` ends by
    killing itself with SIGINT; running a string that raises nothing clears that mark.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    eval("None")  # a constant, run only to clear the interpreter's mark (see above)


if __name__ == "__main__":
    main()
