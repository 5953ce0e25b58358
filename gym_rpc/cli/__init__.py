"""The `gym-rpc` command (run by `gym_rpc.__main__`) and the end-to-end demo.

* `_commands`: the parser and every subcommand, the exit codes (docs/cli.md).
* `demo`: the end-to-end demo (`gym-rpc demo`, `make demo`); its servers are public for examples.
* `_render`: the status table and the JSON rows both print, and the plain text table it is drawn with.
* `_flags`: flags whose default comes from a variable; one-line usage errors.

Importing this package imports the commands (a good part of a second; `gym_rpc.__main__` catches Ctrl-C around it).
"""

from gym_rpc.cli._commands import (
    EXIT_BROKEN_PIPE,
    EXIT_CREDENTIALS_REFUSED,
    EXIT_DOWN,
    EXIT_HEAD_UNREACHABLE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    build_parser,
    main,
)

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
