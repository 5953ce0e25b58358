"""The `gym-rpc` command (run by `gym_rpc.__main__`) and the end-to-end demo.

* `_dispatch`: `main`: parse, run the command, exit with its code.
* `_serving`: the commands that serve (head, bridge, relay, demo); they import the server layer when they run.
* `_asking`: the commands that ask a running head (config, reload, status and its watch, wait).
* `demo`: the end-to-end demo (`gym-rpc demo`, `make demo`); its servers are public for examples.
* `_render`: the status table and the JSON rows both print, and the plain text table it is drawn with.
* `_parser`: the parser: every command and its flags (the exit codes in its description).
* `_flags`: flags whose default comes from a variable; one-line usage errors.
* `_exit_codes`: the exit codes (docs/cli.md), and which one a failure means.

Importing this package imports the commands (a good part of a second; `gym_rpc.__main__` catches Ctrl-C around it).
"""

from gym_rpc.cli._dispatch import main
from gym_rpc.cli._exit_codes import (
    EXIT_BROKEN_PIPE,
    EXIT_CREDENTIALS_REFUSED,
    EXIT_DOWN,
    EXIT_HEAD_UNREACHABLE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
)
from gym_rpc.cli._parser import build_parser

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_CREDENTIALS_REFUSED",
    "EXIT_DOWN",
    "EXIT_HEAD_UNREACHABLE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "build_parser",
    "main",
]
