"""`gym-rpc`'s main: parse the command line, check the command's extra is installed, set up logging, run the
command, and exit with the code its outcome means (`_exit_codes`).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence

from gym_rpc._logging import LOG_LEVELS, configure_logging
from gym_rpc.cli._asking import cmd_config, cmd_reload, cmd_status, cmd_wait
from gym_rpc.cli._exit_codes import (
    EXIT_BROKEN_PIPE,
    EXIT_DOWN,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    exit_code_of,
)
from gym_rpc.cli._flags import env_errors
from gym_rpc.cli._parser import build_parser
from gym_rpc.cli._serving import cmd_bridge, cmd_demo, cmd_head, cmd_relay
from gym_rpc.errors import ControlPlaneError, GymRpcError

# What each command needs beyond the base install: the extra that brings it, and the modules to look for.
_HEAD_MODULES = (
    "uvicorn",
    "connectrpc",
    "grpc_reflection",
    "opentelemetry.sdk",
    "opentelemetry.exporter.prometheus",
    "opentelemetry.instrumentation.grpc",
)
COMMAND_EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "head": ("head", _HEAD_MODULES),
    "bridge": ("head", _HEAD_MODULES),
    "relay": ("head", _HEAD_MODULES),
    "demo": ("head", _HEAD_MODULES),
    "completion": ("completion", ("shtab",)),
}


def missing_extra(command: str) -> str | None:
    """One line naming the `pip install` that brings what `command` needs, when something is not installed."""
    extra, modules = COMMAND_EXTRAS.get(command, ("", ()))
    missing = [name for name in modules if not _importable(name)]
    if not missing:
        return None
    return (
        f"gym-rpc {command}: needs the {extra!r} extra ({', '.join(missing)} not installed): "
        f"pip install 'gym-rpc[{extra}]'"
    )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    for problem in env_errors(parser, args.command):
        parser.exit(EXIT_USAGE, f"gym-rpc {args.command}: error: {problem}\n")
    missing = missing_extra(args.command)
    if missing is not None:
        parser.exit(EXIT_USAGE, missing + "\n")
    _set_up_logging(args)
    try:
        commands = {
            "head": cmd_head,
            "bridge": cmd_bridge,
            "relay": cmd_relay,
            "status": cmd_status,
            "wait": cmd_wait,
            "config": cmd_config,
            "reload": cmd_reload,
            "demo": cmd_demo,
            "completion": cmd_completion,
        }
        code = commands[args.command](args)
        sys.stdout.flush()  # here, where a closed pipe can still be told apart from a failure
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    except BrokenPipeError:
        code = _reader_gone()
    except UsageError as exc:
        print(f"gym-rpc {args.command}: error: {exc}", file=sys.stderr)
        code = EXIT_USAGE
    except ControlPlaneError as exc:
        print(f"gym-rpc {args.command}: error: {exc}", file=sys.stderr)
        code = exit_code_of(exc)
    except GymRpcError as exc:
        print(f"gym-rpc {args.command}: error: {exc}", file=sys.stderr)
        code = EXIT_DOWN
    sys.exit(code)


def _reader_gone() -> int:
    """Our reader closed the pipe (`gym-rpc status | head -1`): end quietly, as a command killed by SIGPIPE does,
    and point stdout at /dev/null so the interpreter's last flush cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE


def _set_up_logging(args: argparse.Namespace) -> None:
    level = getattr(args, "log_level", "warning")
    if getattr(args, "verbose", False) and LOG_LEVELS.index(level) > LOG_LEVELS.index("info"):
        level = "info"
    configure_logging(level, getattr(args, "log_format", "text"))


def cmd_completion(args: argparse.Namespace) -> int:
    import shtab

    print(shtab.complete(build_parser(), shell=args.shell))
    return EXIT_OK
