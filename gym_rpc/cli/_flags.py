"""Flags of the `gym-rpc` command that may also come from the environment (GYM_RPC_HEAD, GYM_RPC_TIMEOUT, ...).

A flag given on the command line wins over its variable, which wins over the built-in default. A variable with a
bad value is a usage error naming the variable (exit 2), checked as the command line is parsed, so a typo in a
launcher's environment never silently falls back to the default. `--help` shows each flag's variable and default.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from gym_rpc._environment import environment
from gym_rpc.client import checked_head_address
from gym_rpc.config import MIN_PROBE_INTERVAL_SECONDS
from gym_rpc.errors import ConfigError

ENV_ERRORS_ATTRIBUTE = "gym_rpc_env_errors"  # set on a parser: the bad variables found while building it
SUBCOMMANDS_ATTRIBUTE = "gym_rpc_subcommands"  # set on a parser: its subcommands' parsers, by name


class HelpFormatter(argparse.HelpFormatter):
    """Wider lines than argparse's 80 columns less two."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34, width=110)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, with a usage mistake reported as one line (argparse prints the whole usage text first), and each
    flag's default in --help, except `(default: False)` on switches and `(default: None)` where none means "not
    given" (added to the help as the flag is added: argparse's formatter hooks are not public API)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        shown = action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)
        if (
            action.help
            and action.help is not argparse.SUPPRESS
            and "%(default)" not in action.help
            and action.default is not argparse.SUPPRESS
            and action.default not in (None, False, [])
            and shown
        ):
            action.help += " (default: %(default)s)"
        return action


_DURATION = re.compile(
    r"(?P<number>[-+]?(?:[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|nan|inf))(?P<unit>ms|s|m|h)?", re.IGNORECASE
)
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def _seconds(text: str) -> float:
    """A duration: plain seconds (`30`, `0.5`) or with a unit (`500ms`, `30s`, `2m`, `1h`)."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a duration (30, 30s, 2m, 500ms, 1h), not {text!r}")
    unit = (match.group("unit") or "s").lower()
    return float(match.group("number")) * _UNIT_SECONDS[unit]


def head_address(text: str) -> str:
    """`--head` / GYM_RPC_HEAD: HOST:PORT (or a gRPC target such as unix:PATH), checked before anything runs."""
    try:
        return checked_head_address(text.strip())
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def readable_file(text: str) -> Path:
    """A file the command will read (a token, a certificate): it must be there and readable now."""
    path = Path(text).expanduser()
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {exc.strerror or exc}") from None
    return path


def positive_float(text: str) -> float:
    """A positive, finite number of seconds: 0 spins a core, nan and inf never end."""
    value = _seconds(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def probe_interval(text: str) -> float:
    """A probe interval: positive seconds, no shorter than a head accepts (a shorter one keeps a core busy)."""
    value = positive_float(text)
    if value < MIN_PROBE_INTERVAL_SECONDS:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_PROBE_INTERVAL_SECONDS:g} seconds, not {text}")
    return value


def non_negative_float(text: str) -> float:
    """A number of seconds >= 0 (NaN and negatives refused with a clear message)."""
    value = _seconds(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def port_number(text: str) -> int:
    """A port to bind, 0 for a free one: 70000 would silently bind 70000 - 65536."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, not {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535 (0 picks a free port), not {value}")
    return value


def choice_of(choices: Sequence[str]) -> Callable[[str], str]:
    """A case-insensitive choice (`INFO` and `info` alike), for values that often come from the environment."""

    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, not {text!r}")
        return value

    parse.__name__ = "choice"
    return parse


def env_flag(
    parser: argparse.ArgumentParser,
    *names: str,
    env: str,
    default: Any,
    parse: Callable[[str], Any] = str,
    help: str,
    environ: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> None:
    """Add a flag whose default is `$env` when that is set (parsed with `parse`), else `default`."""
    raw = (environment().by_name() if environ is None else environ).get(env)
    value = default
    if raw is not None and raw.strip():
        try:
            value = parse(raw)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            errors: list[str] = getattr(parser, ENV_ERRORS_ATTRIBUTE, [])
            errors.append(f"{env}={raw!r}: {exc}")
            setattr(parser, ENV_ERRORS_ATTRIBUTE, errors)
    parser.add_argument(*names, type=parse, default=value, help=f"{help} [env: {env}]", **kwargs)


def add_subcommand(
    parser: argparse.ArgumentParser, commands: Any, name: str, **kwargs: Any
) -> argparse.ArgumentParser:
    """`commands.add_parser(name, **kwargs)` (`commands` is what `parser.add_subparsers()` returned), remembered on
    `parser` by name: argparse lists a parser's subcommands only in its private actions."""
    sub: argparse.ArgumentParser = commands.add_parser(name, **kwargs)
    setattr(parser, SUBCOMMANDS_ATTRIBUTE, {**subcommands(parser), name: sub})
    return sub


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands added to `parser` with `add_subcommand`, by name."""
    found: dict[str, argparse.ArgumentParser] = getattr(parser, SUBCOMMANDS_ATTRIBUTE, {})
    return found


def env_errors(parser: argparse.ArgumentParser, command: str | None = None) -> list[str]:
    """The bad variables found while building `parser` and its subcommand `command` (the one being run: a bad
    variable only another subcommand reads is no reason to fail this one)."""
    found: list[str] = list(getattr(parser, ENV_ERRORS_ATTRIBUTE, []))
    sub = subcommands(parser).get(command) if command is not None else None
    if sub is not None:
        found += env_errors(sub)
    return found
