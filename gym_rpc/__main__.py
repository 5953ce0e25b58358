"""`python -m gym_rpc` and the `gym-rpc` command (pyproject's [project.scripts]): the CLI, exiting 130 on Ctrl-C.

Exit code 130 is documented for Ctrl-C whenever it comes, yet `gym_rpc.cli` takes a good part of a second to import
(grpc, pydantic; seconds on a loaded machine), and a KeyboardInterrupt escaping to the interpreter kills the
process by SIGINT instead (returncode -2). So nothing but `signal` and `sys` is imported before the `try`.
"""

import signal
import sys

EXIT_INTERRUPTED = 130  # gym_rpc.cli.EXIT_INTERRUPTED: importing it from there is what may be interrupted


def main() -> None:
    try:
        try:
            from gym_rpc.cli import main as run_command

            run_command()  # ends in SystemExit with the command's code
        finally:
            _ending()
    except KeyboardInterrupt:  # also a second Ctrl-C that came before `_ending` ignored SIGINT
        _ending()
        sys.exit(EXIT_INTERRUPTED)


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
